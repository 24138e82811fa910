#!/bin/bash
# On the GPU host (device `run`), from the checkout root, with the bundle carried (stage.sh writes it: .gpu/ for
# the host's pair (gpu_pod.HOST_PAIR), .gpup<V>/ for another; this script finds it as its own parent directory): bench/ =
# benchmarks/gpu/*.py and the rendered examples' sources, operator/, rendered/, oci/ (the captures,
# benchmarks/gpu/oci/<backend>/), crun/ (Debian crun 1.8.1 + its libraries), dev/ = this directory (+ the parts'
# SHA256SUMS-<pair>); each carried part directory holds one part of the pair's wheel site (carry.sh).
#   mkdir -p /root/kvstash && mv <part dir>/site*.part* /root/kvstash/   one call per part (kept while the machine is warm)
#   bash <bundle>/dev/dev.sh install [PAIR]  the serving "image" of PAIR (default: gpu_pod.HOST_PAIR, the host's torch
#                                            + wheels, in /opt/kvimage/serving; another pair, e.g. 0.33.0-0.5.6, its own
#                                            torch in /opt/kvimage/serving-PAIR), the operator package, crun
#   bash <bundle>/dev/dev.sh check PAIR      the installed pair loads on this GPU: torch, vLLM, LMCache's CUDA extension
#   bash <bundle>/dev/dev.sh bench ARGS...   gpu_bench.py --runtime crun ARGS (--rendered F --oci <bundle>/oci/<backend> ...)
#   bash <bundle>/dev/dev.sh plan TOTAL_S    the 1 Dec measurement: every bench below, each skipped when TOTAL_S would not hold it
#   bash <bundle>/dev/dev.sh plan-rest TOTAL_S   the runs the captures had not had (vllm-native, the server's read-only
#                                            sidecar, the disk tier alone); each bench's directory comes back as one $OUT/NAME.tar.xz
#   bash <bundle>/dev/dev.sh plan-layerwise TOTAL_S  issue 21: the cold-request cost with LMCache's layer-wise store (bf16 cache)
#   bash <bundle>/dev/dev.sh plan034 TOTAL_S     issue 34 (0.33.0-0.5.6): the check, then lmcache-server eager, lazy and
#                                            no connector under load; plan034-rest: vllm-native, the disk tier, the
#                                            server at 32K; plan034-server: the server at 32K with --shm-name, then eager,
#                                            lazy and no connector under a load with a repeat; plan-load (the host's
#                                            pair): the server and no connector under load
#   bash <bundle>/dev/dev.sh plan-routing TOTAL_S [BUDGET_S]  issue 33: the rendered router per policy before two rendered
#                                            vllm-native replicas (routing_gpu.py), detached; plan-routing-wait TOTAL_S
#   bash <bundle>/dev/dev.sh plan035 TOTAL_S [BUDGET_S [ARGS...]]  issue 35: PerNode's shared server and two
#                                            replicas as rendered (shared_gpu.py ARGS, e.g. --plan reload), detached;
#                                            plan035-wait TOTAL_S
#   bash <bundle>/dev/dev.sh plan033 TOTAL_S [RUNS]  vLLM 0.33.0 + LMCache 0.5.6: check, then its rendered example under
#                                            crun (RUNS: connector,baseline by default)
set -u -o pipefail
K=${KVSTASH:-/root/kvstash}
IMG=${KVIMAGE:-/opt/kvimage}  # both overridable for the offline check (offline_check.sh); gpu_pod reads /opt/kvimage
G=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1
# The pair the host's own torch serves (gpu_pod.HOST_PAIR); it keeps the first protocol's names (serving/, site.part*).
DEFAULT_PAIR=$(sed -n 's/^HOST_PAIR = "\(.*\)"$/\1/p' "$G/bench/gpu_pod.py")
[ -n "$DEFAULT_PAIR" ] || { echo "dev.sh: no HOST_PAIR in $G/bench/gpu_pod.py" >&2; exit 2; }
serving() { if [ "${1:-$DEFAULT_PAIR}" = "$DEFAULT_PAIR" ]; then echo serving; else echo "serving-$1"; fi; }
stem() { if [ "${1:-$DEFAULT_PAIR}" = "$DEFAULT_PAIR" ]; then echo site; else echo "site-$1"; fi; }
case "$1" in
install)
  t0=$(date +%s)
  pair=${2:-$DEFAULT_PAIR}
  S=$IMG/$(serving "$pair")
  st=$(stem "$pair")
  if [ -f "$G/dev/SHA256SUMS-$pair" ]; then  # parts broken on the way fail here, not as a bad archive
    (cd $K && sha256sum --quiet -c "$G/dev/SHA256SUMS-$pair") || { echo "parts of $pair: checksum mismatch or missing in $K"; exit 1; }
  fi
  rm -rf "$S" $IMG/operator $IMG/crun && mkdir -p "$S/site" "$S/bin" $IMG/operator/site $IMG/operator/bin $IMG/crun
  # One or more concatenated xz streams of tar archives (carry.sh: the wheels, then LMCache as compiled).
  cat $K/"$st".part* | xz -dc -T0 | tar -x -i -C "$S/site" || exit 1
  rm -rf "$S/site/bin"
  if [ "$pair" != "$DEFAULT_PAIR" ]; then
    # torch's RPATH is $ORIGIN/../../nvidia/<lib>/lib: the host's CUDA libraries for every one not carried (NCCL is).
    host_nvidia=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])') || { echo "the host's Python has no nvidia/ libraries"; exit 1; }
    mkdir -p "$S/site/nvidia"
    for d in "$host_nvidia"/*/; do
      d=${d%/}
      [ -d "$d" ] && [ ! -e "$S/site/nvidia/${d##*/}" ] && ln -s "$d" "$S/site/nvidia/${d##*/}"
    done
    echo "nvidia/: carried $(find "$S/site/nvidia" -maxdepth 1 -mindepth 1 -type d -printf '%f '); the host's linked:" \
         "$(find "$S/site/nvidia" -maxdepth 1 -type l -printf '%f ')"
  fi
  cp -r $G/operator/kvoffload $IMG/operator/site/
  if [ -d "$G/router" ]; then  # vLLM's router (stage.sh: its wheel and what the host lacks of its imports)
    rm -rf $IMG/router && mkdir -p $IMG/router/site
    python3 -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
      $IMG/router/site $G/router/*.whl || exit 1
  fi
  cp -r $G/crun/. $IMG/crun/
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/crun/lib exec %s/crun/crun "$@"\n' $IMG $IMG > $IMG/crun/run && chmod 755 $IMG/crun/run
  python3 $G/dev/shims.py $IMG "$(command -v python3)" "$(serving "$pair")" operator || exit 1
  python3 -m compileall -q -j 0 "$S/site" $IMG/operator/site >/dev/null 2>&1
  chmod -R a+rX $IMG
  $IMG/crun/run --version | head -1
  python3 -c "import torch; print('host torch', torch.__version__, torch.cuda.get_device_name(0))"
  grep MemTotal /proc/meminfo
  echo "install $pair took $(( $(date +%s) - t0 )) s" ;;
check)
  # The installed pair in the environment its containers get (gpu_pod.image_env), as the host's root.
  pair=${2:?check PAIR}
  S=$IMG/$(serving "$pair")
  PYTHONPATH=$S/site PATH=$S/bin:$PATH python3 $G/dev/check_pair.py "$pair" "$G/dev/extension_check.py" ;;
bench)
  shift
  for id in $($IMG/crun/run --root /run/kvbench-crun list -q 2>/dev/null); do $IMG/crun/run --root /run/kvbench-crun delete -f $id; done
  cd $G/bench && PYTHONPATH=$G/operator python3 gpu_bench.py --runtime crun --crun $IMG/crun/run --no-smoke --no-probe \
      --work /var/tmp/kvpod --disk-root /var/tmp/kvdisk --keep-volume home "$@" ;;
plan|plan033)
  # Priority order; a bench starts only when its estimate fits what is left of TOTAL_S (gpu_bench --budget-s).
  end=$(( $(date +%s) + $2 )); R=$G/rendered; O=$G/oci; out=${OUT:-/root/out}  # 4 x 2 files: the 8 that come back
  left() { echo $(( end - $(date +%s) )); }
  b() { local first=$1; shift; [ "$(left)" -gt "$first" ] || { echo "skipped (left $(left) s): $*"; return; }
        bash $G/dev/dev.sh bench --budget-s "$(left)" --run-estimate-s "$first" --request-timeout 100 "$@"; }
  if [ "$1" = plan ]; then
    b 150 --rendered $R/workstation-llama31-8b.yaml --oci $O/lmcache --runs connector --tag-suffix=-oci --out $out/ws
    b 110 --rendered $R/workstation-llama31-8b.yaml --oci $O/lmcache --runs connector --tag-suffix=-chunk2048 \
        --lmcache-overrides '{"chunk_size": 2048}' --out $out/c2048
    b 120 --rendered $R/server-llama31-8b.yaml --oci $O/lmcache-server --runs connector --tag-suffix=-server-odirect \
        --rescan-wait 20 --out $out/server
    b 100 --rendered $R/workstation-llama31-8b.yaml --oci $O/lmcache --runs baseline --tag-suffix=-oci --out $out/base
  else
    # The rendered example for vLLM 0.33.0 + LMCache 0.5.6 (spec.engine.image: stage.sh renders it) from the
    # lmcache capture: its containers differ from the captured 0.26 pod's in the image alone (stage.sh lists it).
    # RUNS (default connector,baseline): a later call with what an earlier one skipped.
    mkdir -p $out/check033
    bash $G/dev/dev.sh check 0.33.0-0.5.6 2>&1 | tee $out/check033/check.log
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "check failed: no bench"; exit 1; }
    for run in $(echo "${3:-connector,baseline}" | tr , ' '); do
      b "$([ "$run" = connector ] && echo 200 || echo 130)" --rendered $R/workstation-llama31-8b-vllm-0.33.0.yaml \
          --oci $O/lmcache --runs "$run" --tag-suffix=-vllm033 --out "$out/$run-033"
    done
  fi
  echo "$1 done, $(left) s left" ;;
plan034|plan034-rest|plan034-server|plan-load)
  # Issue 34 on vLLM 0.33.0 + LMCache 0.5.6 (plan034, plan034-rest, plan034-server) and issue 36's signals on the
  # host's pair (0.26.0-0.5.3)
  # (plan-load). The load runs: 8,192-token prompts on a GPU tier cut to 4,352 blocks (--num-gpu-blocks-override:
  # 16 requests in flight overflow it, so blocks are evicted while requests run, the case a lazy store must keep
  # up with), --load 16:32,8:16 (vLLM's pages sampled: the autoscaling queries run on them afterwards). Each bench's
  # directory comes back as $OUT/NAME.tar.xz.
  end=$(( $(date +%s) + $2 )); R=$G/rendered; O=$G/oci; out=/root/kvout; mkdir -p $out  # not $OUT: each call empties that
  left() { echo $(( end - $(date +%s) )); }
  # A bench an earlier call of this warm machine finished is skipped: a second call goes on where the first stopped.
  b() { local name=$1 first=$2; shift 2; [ -f $out/$name.done ] && { echo "$name: done in an earlier call"; return; }
        [ "$(left)" -gt "$first" ] || { echo "skipped (left $(left) s): $name"; return; }
        bash $G/dev/dev.sh bench --budget-s "$(left)" --run-estimate-s "$first" --request-timeout 100 --out $out/$name "$@"
        tar -C $out -cJf "${OUT:-/root}/$name.tar.xz" $name; touch $out/$name.done; echo "$name done, $(left) s left"; }
  LOAD=(--prompt-tokens 8192 --engine-arg "--num-gpu-blocks-override 4352" --load 16:32:again,8:16)
  # The baseline's steps are longer than the queue-time query's 2m rate window, so that its value at a step's end
  # is that load's alone; the compile cache (home) is kept from the first run on (start-up time only).
  LONG=(--prompt-tokens 8192 --engine-arg "--num-gpu-blocks-override 4352" --load 16:32:again,16:560,8:480)
  LAZY='{"lmcache.mp.lazy_offload": true, "lmcache.mp.lazy_offload_policy": "EVICTION_AWARE"}'
  # plan034-server: the same load with the repeat (no reset: what the GPU tier evicted while the step ran comes back
  # from the server, or is recomputed: the lazy store's test) before the again (after a reset).
  REPEAT=(--prompt-tokens 8192 --engine-arg "--num-gpu-blocks-override 4352" --load 16:32:repeat:again,8:16)
  case "$1" in
  plan034)
    if [ ! -f $out/check033.done ]; then
      mkdir -p $out/check033
      bash $G/dev/dev.sh check 0.33.0-0.5.6 > $out/check033/check.log 2>&1 || { cat $out/check033/check.log; echo "check failed: no bench"; exit 1; }
      tar -C $out -cJf "${OUT:-/root}/check033.tar.xz" check033; touch $out/check033.done
    fi
    S=$R/server-llama31-8b-vllm-0.33.0.yaml
    b server033-eager-load 250 --rendered $S --oci $O/lmcache-server --runs connector --tag-suffix=-server033-eager-load \
        --rescan-wait 20 --keep-volume home "${LOAD[@]}"
    b server033-lazy-load 170 --rendered $S --oci $O/lmcache-server --runs connector --tag-suffix=-server033-lazy-load \
        --rescan-wait 20 --kv-extra "$LAZY" --keep-volume home "${LOAD[@]}"
    b server033-base-load 400 --rendered $S --oci $O/lmcache-server --runs baseline --tag-suffix=-server033-load \
        --keep-volume home "${LONG[@]}" ;;
  plan034-rest)
    b native033 200 --rendered $R/native-llama31-8b-vllm-0.33.0.yaml --oci $O/vllm-native --runs connector \
        --tag-suffix=-native033 --keep-volume home
    b disk033 150 --rendered $R/workstation-llama31-8b-vllm-0.33.0.yaml --oci $O/lmcache --runs disk --tag-suffix=-disk033
    b server033 130 --rendered $R/server-llama31-8b-vllm-0.33.0.yaml --oci $O/lmcache-server --runs connector \
        --tag-suffix=-server033 --rescan-wait 20 ;;
  plan034-server)
    # The server on 0.33.0 + 0.5.6 as rendered after plan034-rest (--shm-name, 45 GiB limit): 32K at one request
    # (reload vs recompute, the token check, memory, the exporter), then eager and lazy under load, then no connector.
    if [ ! -f $out/check033.done ]; then
      mkdir -p $out/check033
      bash $G/dev/dev.sh check 0.33.0-0.5.6 > $out/check033/check.log 2>&1 || { cat $out/check033/check.log; echo "check failed: no bench"; exit 1; }
      tar -C $out -cJf "${OUT:-/root}/check033.tar.xz" check033; touch $out/check033.done
    fi
    S=$R/server-llama31-8b-vllm-0.33.0.yaml
    b server033-shm 230 --rendered $S --oci $O/lmcache-server --runs connector --tag-suffix=-server033-shm \
        --rescan-wait 20 --keep-volume home
    b server033-eager-repeat 200 --rendered $S --oci $O/lmcache-server --runs connector \
        --tag-suffix=-server033-eager-repeat --rescan-wait 20 --keep-volume home "${REPEAT[@]}"
    b server033-lazy-repeat 200 --rendered $S --oci $O/lmcache-server --runs connector \
        --tag-suffix=-server033-lazy-repeat --rescan-wait 20 --kv-extra "$LAZY" --keep-volume home "${REPEAT[@]}"
    b server033-base-repeat 150 --rendered $S --oci $O/lmcache-server --runs baseline \
        --tag-suffix=-server033-base-repeat --keep-volume home "${REPEAT[@]}" ;;
  plan-load)
    b server026-eager-load 170 --rendered $R/server-llama31-8b.yaml --oci $O/lmcache-server --runs connector \
        --tag-suffix=-server026-eager-load --rescan-wait 20 "${LOAD[@]}"
    b server026-base-load 130 --rendered $R/server-llama31-8b.yaml --oci $O/lmcache-server --runs baseline \
        --tag-suffix=-server026-load "${LOAD[@]}" ;;
  esac
  echo "$1 done, $(left) s left" ;;
plan-routing|plan-routing-wait)
  # Issue 33: vLLM's router as rendered for each policy in front of two rendered vllm-native replicas of Qwen2.5-7B on
  # this GPU (benchmarks/gpu/routing_gpu.py), each engine at 0.4 of the GPU with its GPU tier cut to 4,096 blocks
  # (65,536 tokens: the overflow workload's 44 documents of 8,192 tokens overflow it, and the half each replica keeps
  # under affinity fits its 14 GiB CPU tier). It runs detached (setsid: a call ends at 600 s, the run may not), in
  # /root/kvout/routing; plan-routing-wait waits for it; each call brings back what it has so far as
  # $OUT/routing.tar.xz.
  end=$(( $(date +%s) + $2 )); out=/root/kvout/routing; mkdir -p /root/kvout
  if [ "$1" = plan-routing ] && [ ! -f /root/kvout/routing.pid ]; then
    rm -rf $out && mkdir -p $out
    ( cd $G/bench && PYTHONPATH=$G/operator setsid python3 routing_gpu.py run --rendered $G/rendered/routing.json \
        --out $out --router-site "$IMG/router/site:$IMG/$(serving)/site" --budget-s "${3:-1500}" --settle-s 8 \
        --engine-arg "--gpu-memory-utilization 0.4 --num-gpu-blocks-override 4096" \
        > /root/kvout/routing.log 2>&1 < /dev/null & echo $! > /root/kvout/routing.pid )
  fi
  pid=$(cat /root/kvout/routing.pid 2>/dev/null)
  while [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  kill -0 "$pid" 2>/dev/null && echo "routing: still running (pid $pid)" || echo "routing: finished"
  tail -40 /root/kvout/routing.log
  cp /root/kvout/routing.log $out/ 2>/dev/null
  tar -C /root/kvout -cJf "${OUT:-/root}/routing.tar.xz" routing ;;
plan035|plan035-wait)
  # Issue 35: spec.offload.server PerNode as rendered (benchmarks/gpu/shared_gpu.py): the node's shared LMCache server
  # pod and two serving pods of the shared example (runs 1-4, 4 Dec 2026: vLLM 0.26.0 + LMCache 0.5.3, the host's pair;
  # PerNode now needs LMCache >= 0.5.6, so the example renders the 0.33.0-0.5.6 pair, whose site must be installed
  # and this entry taught to use it, as plan033 does, before the next run), from the captures
  # oci/shared and oci/shared-server: a second replica's and a recreated replica's first request for a stored 32K
  # prefix, the server killed under load and replaced, the reload from its kept L2. Detached (setsid: a call ends at
  # 600 s, the run may not) in /root/kvout/shared; plan035-wait waits for it; each call brings back what it has as
  # $OUT/shared.tar.xz. BUDGET_S (default 540): the run skips a phase that would not end within it.
  end=$(( $(date +%s) + $2 )); out=/root/kvout/shared; mkdir -p /root/kvout
  if [ "$1" = plan035 ] && [ ! -f /root/kvout/shared.pid ]; then
    for id in $($IMG/crun/run --root /run/kvbench-crun list -q 2>/dev/null); do $IMG/crun/run --root /run/kvbench-crun delete -f $id; done
    rm -rf $out && mkdir -p $out
    ( cd $G/bench && PYTHONPATH=$G/operator setsid python3 shared_gpu.py --rendered $G/rendered/shared-llama31-8b.yaml \
        --oci-serving $G/oci/shared --oci-server $G/oci/shared-server --out $out --crun $IMG/crun/run \
        --budget-s "${3:-540}" "${@:4}" > /root/kvout/shared.log 2>&1 < /dev/null & echo $! > /root/kvout/shared.pid )
  fi
  pid=$(cat /root/kvout/shared.pid 2>/dev/null)
  while [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  kill -0 "$pid" 2>/dev/null && echo "shared: still running (pid $pid)" || echo "shared: finished"
  tail -60 /root/kvout/shared.log
  cp /root/kvout/shared.log $out/ 2>/dev/null
  tar -C /root/kvout -cJf "${OUT:-/root}/shared.tar.xz" shared ;;
plan-layerwise)
  # Issue 21's cold-request cost: does LMCache 0.5.3's layer-wise store (which overlaps the forward pass; its GPU
  # connector refuses vLLM 0.26.0's fp8 cache) bring it to <= 3 %? The workstation example with a bf16 cache
  # (benchmarks/gpu/workstation-llama31-8b-bf16.yaml), from the lmcache capture: no connector, as rendered,
  # use_layerwise, use_layerwise with chunk 2048. Each bench's directory comes back as $OUT/NAME.tar.xz.
  end=$(( $(date +%s) + $2 )); R=$G/rendered; O=$G/oci; out=/root/out; mkdir -p $out
  left() { echo $(( end - $(date +%s) )); }
  b() { local name=$1 first=$2; shift 2; [ "$(left)" -gt "$first" ] || { echo "skipped (left $(left) s): $name"; return; }
        bash $G/dev/dev.sh bench --budget-s "$(left)" --run-estimate-s "$first" --request-timeout 100 \
            --rendered $R/workstation-llama31-8b-bf16.yaml --oci $O/lmcache "$@" --out $out/$name
        tar -C $out -cJf "${OUT:-/root}/$name.tar.xz" $name; echo "$name done, $(left) s left"; }
  b base-bf16 110 --runs baseline --tag-suffix=-bf16
  b layerwise-bf16 150 --runs connector --tag-suffix=-bf16-layerwise --lmcache-overrides '{"use_layerwise": true}'
  b conn-bf16 150 --runs connector --tag-suffix=-bf16
  b layerwise2048-bf16 150 --runs connector --tag-suffix=-bf16-layerwise-c2048 \
      --lmcache-overrides '{"use_layerwise": true, "chunk_size": 2048}'
  echo "plan-layerwise done, $(left) s left" ;;
plan-rest)
  end=$(( $(date +%s) + $2 )); R=$G/rendered; O=$G/oci; out=/root/out
  left() { echo $(( end - $(date +%s) )); }
  b() { local name=$1 first=$2; shift 2; [ "$(left)" -gt "$first" ] || { echo "skipped (left $(left) s): $name"; return; }
        bash $G/dev/dev.sh bench --budget-s "$(left)" --run-estimate-s "$first" --request-timeout 100 --out $out/$name "$@"
        tar -C $out -cJf "${OUT:-/root}/$name.tar.xz" $name; echo "$name done, $(left) s left"; }
  b native 150 --rendered $R/native-llama31-8b.yaml --oci $O/vllm-native --runs connector --tag-suffix=-native-oci
  b server 130 --rendered $R/server-llama31-8b.yaml --oci $O/lmcache-server --runs connector --tag-suffix=-server-ro \
      --rescan-wait 20
  b disk 150 --rendered $R/workstation-llama31-8b.yaml --oci $O/lmcache --runs disk --tag-suffix=-disk-oci
  echo "plan-rest done, $(left) s left" ;;
*)
  echo "usage: dev.sh install [PAIR] | check PAIR | bench ARGS... | plan TOTAL_S | plan-rest TOTAL_S | plan-layerwise TOTAL_S | plan033 TOTAL_S [RUNS] | plan034|plan034-rest|plan034-server|plan-load TOTAL_S | plan-routing[-wait] TOTAL_S [BUDGET_S] | plan035[-wait] TOTAL_S [BUDGET_S]" >&2; exit 2 ;;
esac
