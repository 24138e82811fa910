#!/bin/bash
# On the GPU host (device `run`), from the checkout root, with .gpu/ carried: bench/ = benchmarks/gpu/*.py, operator/,
# rendered/, oci/ (the captures, benchmarks/gpu/oci/<backend>/), crun/ (Debian crun 1.8.1 + its libraries), dev/ = this
# directory; .gpupN/ = one wheel-site part each (`make`-free: see device/requirements-h200.txt).
#   mkdir -p /root/kvstash && mv .gpupN/site.part* /root/kvstash/   one call per part (kept while the machine is warm)
#   bash .gpu/dev/dev.sh install         the serving "image" (host torch + wheels), the operator package, crun
#   bash .gpu/dev/dev.sh bench ARGS...   gpu_bench.py --runtime crun ARGS (--rendered F --oci .gpu/oci/<backend> ...)
#   bash .gpu/dev/dev.sh plan TOTAL_S    the 1 Dec measurement: every bench below, each skipped when TOTAL_S would not hold it
#   bash .gpu/dev/dev.sh plan-rest TOTAL_S   the runs the captures had not had (vllm-native, the server's read-only
#                                        sidecar, the disk tier alone); each bench's directory comes back as one $OUT/NAME.tar.xz
set -u -o pipefail
K=/root/kvstash
IMG=/opt/kvimage
G=$PWD/.gpu
export PYTHONUNBUFFERED=1
case "$1" in
install)
  t0=$(date +%s)
  rm -rf $IMG && mkdir -p $IMG/serving/site $IMG/serving/bin $IMG/operator/site $IMG/operator/bin $IMG/crun
  cat $K/site.part* | xz -dc -T0 | tar -x -C $IMG/serving/site || exit 1
  rm -rf $IMG/serving/site/bin
  cp -r $G/operator/kvoffload $IMG/operator/site/
  cp -r $G/crun/. $IMG/crun/
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/crun/lib exec %s/crun/crun "$@"\n' $IMG $IMG > $IMG/crun/run && chmod 755 $IMG/crun/run
  python3 $G/dev/shims.py $IMG "$(command -v python3)" || exit 1
  python3 -m compileall -q -j 0 $IMG/serving/site $IMG/operator/site >/dev/null 2>&1
  chmod -R a+rX $IMG
  $IMG/crun/run --version | head -1
  python3 -c "import torch; print('host torch', torch.__version__, torch.cuda.get_device_name(0))"
  grep MemTotal /proc/meminfo
  echo "install took $(( $(date +%s) - t0 )) s" ;;
bench)
  shift
  for id in $($IMG/crun/run --root /run/kvbench-crun list -q 2>/dev/null); do $IMG/crun/run --root /run/kvbench-crun delete -f $id; done
  cd $G/bench && PYTHONPATH=$G/operator python3 gpu_bench.py --runtime crun --crun $IMG/crun/run --no-smoke --no-probe \
      --work /var/tmp/kvpod --disk-root /var/tmp/kvdisk --keep-volume home "$@" ;;
plan)
  # Priority order; a bench starts only when its estimate fits what is left of TOTAL_S (gpu_bench --budget-s).
  end=$(( $(date +%s) + $2 )); R=$G/rendered; O=$G/oci; out=${OUT:-/root/out}  # 4 x 2 files: the 8 that come back
  left() { echo $(( end - $(date +%s) )); }
  b() { local first=$1; shift; [ "$(left)" -gt "$first" ] || { echo "skipped (left $(left) s): $*"; return; }
        bash $G/dev/dev.sh bench --budget-s "$(left)" --run-estimate-s "$first" --request-timeout 100 "$@"; }
  b 150 --rendered $R/workstation-llama31-8b.yaml --oci $O/lmcache --runs connector --tag-suffix=-oci --out $out/ws
  b 110 --rendered $R/workstation-llama31-8b.yaml --oci $O/lmcache --runs connector --tag-suffix=-chunk2048 \
      --lmcache-overrides '{"chunk_size": 2048}' --out $out/c2048
  b 120 --rendered $R/server-llama31-8b.yaml --oci $O/lmcache-server --runs connector --tag-suffix=-server-odirect \
      --rescan-wait 20 --out $out/server
  b 100 --rendered $R/workstation-llama31-8b.yaml --oci $O/lmcache --runs baseline --tag-suffix=-oci --out $out/base
  echo "plan done, $(left) s left" ;;
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
esac
