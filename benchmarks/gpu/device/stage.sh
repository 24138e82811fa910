#!/usr/bin/env bash
# Lays out in CHECKOUT (the repo the device tool copies: /work/main) what the GPU host needs for one engine pair,
# in folders its .git/info/exclude ignores (/.gpu/, /.gpup*/) so that only a call's `carry` takes them along,
# and prints the device calls, in order, with their carry lists and sizes:
#   stage.sh PAIR [CHECKOUT]      e.g. stage.sh 0.33.0-0.5.6 /work/main
# - the bundle: .gpu/ for the host's pair (gpu_pod.HOST_PAIR: dev.sh's first protocol), .gpup-PAIR/ for another: bench/ (benchmarks/gpu
#   *.py), operator/kvoffload, rendered/ (`kvoffload render` of the examples and of
#   benchmarks/gpu/workstation-llama31-8b-vllm-*.yaml), oci/ (the captures), crun/ (from CHECKOUT/.gpu/crun or
#   $CRUN_DIR: Debian's crun 1.8.1 + its libraries), dev/ (dev.sh, shims.py, check_pair.py, extension_check.py,
#   SHA256SUMS-PAIR);
# - one folder per part of the pair's wheel site (carry.sh builds it, cached): .gpup-PAIR-NN/ (hard links).
# The code comes from this script's worktree; re-running it replaces what it staged before, nothing else.
set -euo pipefail
PAIR=${1:?usage: stage.sh PAIR [CHECKOUT], e.g. 0.33.0-0.5.6 /work/main}
CHECKOUT=$(cd "${2:-/work/main}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(cd "$HERE/../../.." && pwd)
PY=${OPERATOR_PYTHON:-$SRC/.venv/bin/python}  # one with the operator's dependencies, for `kvoffload render`
[ -x "$PY" ] || PY=$CHECKOUT/.venv/bin/python
CARRY=$(PY=python3 bash "$HERE/carry.sh" "$PAIR")  # the cached parts (built now if missing)
DEFAULT=$(sed -n 's/^HOST_PAIR = "\(.*\)"$/\1/p' "$SRC/benchmarks/gpu/gpu_pod.py")  # the host's torch's pair
[ -n "$DEFAULT" ] || { echo "stage.sh: no HOST_PAIR in $SRC/benchmarks/gpu/gpu_pod.py" >&2; exit 2; }
if [ "$PAIR" = "$DEFAULT" ]; then B=.gpu; STEM=site; PDIR=.gpup; PLAN=plan; else B=.gpup-$PAIR; STEM=site-$PAIR; PDIR=.gpup-$PAIR-; PLAN=plan$(echo "${PAIR%%-*}" | tr -d . | cut -c1-3); fi
grep -qE "(^|[|( ])${PLAN}[|)]" "$HERE/dev.sh" || { echo "stage.sh: dev.sh has no $PLAN for $PAIR" >&2; exit 2; }
for pat in '/.gpu/' '/.gpup*/'; do
  grep -qxF "$pat" "$CHECKOUT/.git/info/exclude" || { echo "stage.sh: $CHECKOUT/.git/info/exclude lacks $pat" >&2; exit 2; }
done
crun=${CRUN_DIR:-$CHECKOUT/.gpu/crun}
[ -x "$crun/crun" ] || { echo "stage.sh: no crun at $crun (set CRUN_DIR to Debian's crun 1.8.1 + libs)" >&2; exit 2; }

tmp=$(mktemp -d "$CHECKOUT/.gpup-stage.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp"/{bench,operator,rendered,oci,crun,dev}
cp "$SRC"/benchmarks/gpu/*.py "$tmp/bench/"
(cd "$SRC/operator" && tar --exclude=__pycache__ -cf - kvoffload) | tar -xf - -C "$tmp/operator"
(cd "$SRC/benchmarks/gpu/oci" && tar --exclude=__pycache__ -cf - .) | tar -xf - -C "$tmp/oci"
cp -a "$crun/." "$tmp/crun/"
cp "$HERE"/dev.sh "$HERE"/shims.py "$HERE"/check_pair.py "$HERE"/requirements-h200*.txt "$SRC/images/serving/extension_check.py" "$tmp/dev/"
cp "$CARRY/SHA256SUMS" "$tmp/dev/SHA256SUMS-$PAIR"
render() { PYTHONPATH=$SRC/operator "$PY" -m kvoffload.cli render -f "$1" > "$tmp/rendered/$2"; }
render "$SRC/examples/workstation-llama31-8b.yaml" workstation-llama31-8b.yaml
render "$SRC/examples/server-llama31-8b.yaml" server-llama31-8b.yaml
render "$SRC/benchmarks/gpu/native-llama31-8b.yaml" native-llama31-8b.yaml
render "$SRC/benchmarks/gpu/workstation-llama31-8b-bf16.yaml" workstation-llama31-8b-bf16.yaml
for f in "$SRC"/benchmarks/gpu/*-vllm-*.yaml; do render "$f" "$(basename "$f")"; done
# PerNode (issue 35, dev.sh plan035): the resource's serving pods and the server pod of the node "gpu-host"
# (shared_gpu.SERVER_NODE), with the admin's tmpfs root it needs.
PYTHONPATH=$SRC/operator "$PY" -m kvoffload.cli render -f "$SRC/examples/shared-llama31-8b.yaml" --node gpu-host \
  --operator-config "$SRC/benchmarks/gpu/shared-operator-config.yaml" > "$tmp/rendered/shared-llama31-8b.yaml"
# The routing benchmark (dev.sh plan-routing): each policy's rendering of its resource with two Ready replicas, and
# vLLM's router as the router image holds it (its PyPI wheel) with what the host's Python lacks of its imports.
PYTHONPATH=$SRC/operator "$PY" "$SRC/benchmarks/gpu/routing_gpu.py" render --spec "$SRC/benchmarks/gpu/routing-qwen25-7b.yaml" \
  --out "$tmp/rendered/routing.json"
ROUTER=$(PYTHONPATH=$SRC/operator "$PY" -c 'from kvoffload.engine.router import VERSION; print(VERSION)')
mkdir -p "$tmp/router"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$tmp/router" "vllm-router==$ROUTER" setproctitle==1.3.8 orjson==3.13.0
# What the pair's rendering changes against the example's, whose pod (0.26.0-0.5.3) its backend's capture is of.
for f in "$tmp"/rendered/*-vllm-*.yaml; do
  diff "$tmp/rendered/$(basename "${f%-vllm-*}").yaml" "$f" > "${f%.yaml}.diff-from-default.txt" || true
  echo "rendered $(basename "$f"): differs from the example's rendering in" \
       "$(grep -c '^>' "${f%.yaml}.diff-from-default.txt") lines: $(grep '^>' "${f%.yaml}.diff-from-default.txt" | sed 's/^> *//' | sort -u | tr '\n' ';')"
done
rm -rf "${CHECKOUT:?}/$B" "$CHECKOUT/$PDIR"[0-9]*
mv "$tmp" "$CHECKOUT/$B"
trap - EXIT
i=0
parts=()
for p in "$CARRY/$STEM".part*; do
  d=$(printf '%s%02d' "$PDIR" $i)
  mkdir -p "$CHECKOUT/$d"
  ln "$p" "$CHECKOUT/$d/" 2>/dev/null || cp "$p" "$CHECKOUT/$d/"
  parts+=("$d")
  i=$((i + 1))
done

# The calls: each carries the checkout (tracked + untracked files that git does not ignore) plus its carry list,
# 64 MiB at most; the bundle rides with the last part when both fit, else alone after it.
mib() { echo $(( ($1 + 1048575) / 1048576 )); }
checkout=$(cd "$CHECKOUT" && { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 du -cb 2>/dev/null | awk 'END {print $1}')
bundle=$(du -sb "$CHECKOUT/$B" | cut -f1)
n=${#parts[@]}
echo "staged $PAIR in $CHECKOUT: bundle $B ($(mib "$bundle") MiB), $n parts of $(cat "$CARRY/.done" | tr '\n' ' '), checkout $(mib "$checkout") MiB"
stash="mkdir -p /root/kvstash && n=\$(ls /root/kvstash/$STEM.part* 2>/dev/null | wc -l) && { [ \$n = %d ] || { echo \"STASH LOST: \$n parts there, expected %d: a fresh machine; start again at call 1\"; exit 9; }; } && mv %s/$STEM.part* /root/kvstash/"
survey="python3 -m pip list --format=freeze 2>/dev/null | grep -iE '^(nvidia|cuda|torch|triton|numpy|numba|cupy|transformers|huggingface|tokenizers|opencv|pillow|requests|aiohttp|protobuf|grpcio|setuptools|typing.extensions|packaging)' | tr '\n' ' '; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; df -h /root | tail -1"
last=$(stat -c %s "$CHECKOUT/${parts[$((n - 1))]}"/*)
for ((k = 0; k < n; k++)); do
  # shellcheck disable=SC2059  # the format is ours
  cmd=$(printf "$stash" "$k" "$k" "${parts[$k]}")
  carry="[\"${parts[$k]}\"]"
  size=$(du -sb "$CHECKOUT/${parts[$k]}" | cut -f1)
  [ $k = 0 ] && cmd="$cmd && $survey"
  if [ $k = $((n - 1)) ] && [ $((checkout + last + bundle)) -le $((64 * 1048576)) ]; then
    carry="[\"${parts[$k]}\", \"$B\"]"; size=$((size + bundle))
    cmd="$cmd && bash $B/dev/dev.sh install $PAIR && bash $B/dev/dev.sh $PLAN \$((570 - SECONDS))"
  fi
  echo "call $((k + 1)): carry=$carry  ($(mib $((checkout + size))) MiB with the checkout)"
  echo "  $cmd"
done
if [ $((checkout + last + bundle)) -gt $((64 * 1048576)) ]; then
  echo "call $((n + 1)): carry=[\"$B\"]  ($(mib $((checkout + bundle))) MiB with the checkout)"
  echo "  bash $B/dev/dev.sh install $PAIR && bash $B/dev/dev.sh $PLAN \$((570 - SECONDS))"
fi
echo "then, while time is left (a run the plan skipped: its line says so): carry=[\"$B\"]"
echo "  bash $B/dev/dev.sh $PLAN 570 baseline"
