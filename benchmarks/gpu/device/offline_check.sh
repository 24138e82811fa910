#!/usr/bin/env bash
# What of the GPU plan needs no GPU, checked here on the staged files (stage.sh) before any device time:
#   offline_check.sh PAIR HOST_PYTHON [CHECKOUT]
# HOST_PYTHON: a Python 3.12 venv standing in for the GPU host's /opt/torch/.venv (its torch, CUDA wheels and
# packages at the host's versions). Runs the staged dev.sh itself: `install PAIR` from the staged parts (their
# SHA256SUMS, the xz streams, the nvidia/ links to the host venv's libraries, the console scripts), then
# `check PAIR` with NO_GPU=1: the carried torch shadows the host's, the serving path imports, LMCache's
# extension loads with every symbol bound, the unmet requirements. libcuda.so.1 (the driver's, absent here) is
# a stand-in stub whose functions all return CUDA_ERROR_NO_DEVICE: enough for the dynamic loader, no more.
set -euo pipefail
PAIR=${1:?usage: offline_check.sh PAIR HOST_PYTHON [CHECKOUT]}
HOST_PYTHON=${2:?host python}
CHECKOUT=$(cd "${3:-/work/main}" && pwd)
B=$CHECKOUT/.gpup-$PAIR
[ -f "$B/dev/dev.sh" ] || { echo "offline_check.sh: nothing staged at $B (stage.sh $PAIR $CHECKOUT)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/stash" "$work/bin" "$work/stub"
for p in "$CHECKOUT/.gpup-$PAIR"-[0-9]*/site-*.part*; do ln -s "$p" "$work/stash/"; done
printf '#!/bin/sh\nexec %s "$@"\n' "$HOST_PYTHON" > "$work/bin/python3" && chmod 755 "$work/bin/python3"  # a venv's, as on the host
export KVSTASH=$work/stash KVIMAGE=$work/kvimage PATH=$work/bin:$PATH
t0=$(date +%s)
bash "$B/dev/dev.sh" install "$PAIR"  # its last line, the host torch's GPU name, fails here: there is none
site=$KVIMAGE/serving-$PAIR/site
[ -d "$site/torch" ] && [ -d "$site/vllm" ] && [ -d "$site/lmcache" ] || { echo "install left no torch/vllm/lmcache in $site" >&2; exit 1; }
# The stand-in driver library: every cu* function the carried ELF objects bind.
find "$site" -name '*.so*' -type f -print0 | xargs -0 nm -D --undefined-only 2>/dev/null | awk '{print $2}' | sed 's/@.*//' |
  grep -E '^cu[A-Z]' | sort -u | awk '{print "int " $1 "(void){return 100;}"}' > "$work/stub/libcuda.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$work/stub/libcuda.so.1" "$work/stub/libcuda.c"
echo "offline install $(( $(date +%s) - t0 )) s; stub libcuda.so.1 with $(wc -l < "$work/stub/libcuda.c") functions"
NO_GPU=1 LD_LIBRARY_PATH=$work/stub bash "$B/dev/dev.sh" check "$PAIR"
