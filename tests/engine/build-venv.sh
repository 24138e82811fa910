#!/usr/bin/env bash
# A pinned engine pair (vLLM + LMCache) in a cached venv, for the fidelity tests only:
# vLLM's real `vllm serve` parser and create_engine_config(), LMCache's real config loader, LMCache's
# CUDA extension loaded against vLLM's torch. Never a dependency of the operator package. Built once
# per pair under ~/.cache/kvoffload; a finished venv has .done (with its timings); a broken
# half-install is rebuilt.
#   tests/engine/build-venv.sh [VLLM_VERSION LMCACHE_VERSION [wheel|source]]   -> prints the venv's path
# LMCACHE_FROM (the third argument, engine/images.py KnownImage.lmcache_from):
#   wheel   LMCache's PyPI wheel (its extension is built against one torch: only where that is vLLM's)
#   source  LMCache's sdist from PyPI, its CUDA extension compiled here against vLLM's own torch by
#           images/serving/build-lmcache.sh, the serving image's own build step (nvcc from PyPI, no GPU).
#           One GPU architecture (TORCH_CUDA_ARCH_LIST, default 9.0: H100/H200) keeps the compile
#           short; the serving image compiles LMCache's own list (images/serving/Dockerfile). The compiled
#           wheel is kept in $CACHE/lmcache-wheel-vllm-<v>-lmcache-<v>-arch-<list> (LMCACHE_WHEEL_DIR of
#           build-lmcache.sh), and `make test`'s build of the pair's serving image installs that wheel
#           instead of compiling LMCache a second time (tests/support/kvtest/images.py).
set -euo pipefail
VLLM_VERSION=${1:-0.26.0}
LMCACHE_VERSION=${2:-0.5.3}
LMCACHE_FROM=${3:-wheel}
case "$LMCACHE_FROM" in wheel|source) ;; *) echo "LMCACHE_FROM must be wheel or source, not $LMCACHE_FROM" >&2; exit 2;; esac
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/support/cached-venv.sh"
DEST=$CACHE/engine-vllm-$VLLM_VERSION-lmcache-$LMCACHE_VERSION
cached_venv_begin "$DEST"

start=$(date +%s)
"$PY" -m venv "$DEST" >&2
PIP=("$DEST/bin/pip" install -q --no-cache-dir --disable-pip-version-check)
"${PIP[@]}" --upgrade pip >&2
if [ "$LMCACHE_FROM" = wheel ]; then
  # Both from PyPI with their declared deps: the same wheels the serving image installs.
  "${PIP[@]}" "vllm==$VLLM_VERSION" "lmcache==$LMCACHE_VERSION" >&2
  lmcache_build_seconds=0
else
  "${PIP[@]}" "vllm==$VLLM_VERSION" >&2
  compile_start=$(date +%s)
  arch=${TORCH_CUDA_ARCH_LIST:-9.0}
  TORCH_CUDA_ARCH_LIST=$arch LMCACHE_WHEEL_DIR=$CACHE/lmcache-wheel-vllm-$VLLM_VERSION-lmcache-$LMCACHE_VERSION-arch-${arch// /_} \
    "$ROOT/images/serving/build-lmcache.sh" "$DEST/bin/python" "$LMCACHE_VERSION" >&2
  lmcache_build_seconds=$(( $(date +%s) - compile_start ))
fi
"$DEST/bin/python" - "$VLLM_VERSION" "$LMCACHE_VERSION" >&2 <<'PY'
import sys
from importlib.metadata import version
want = {"vllm": sys.argv[1], "lmcache": sys.argv[2]}
got = {name: version(name) for name in want}
assert got == want, f"installed {got}, wanted {want}"
print("engine venv:", got, "torch", version("torch"))
PY
# LMCache's CUDA extension loads against this torch with every symbol resolved, or the venv is not done.
"$DEST/bin/python" "$ROOT/images/serving/extension_check.py" >&2
secs=$(( $(date +%s) - start ))
size=$(du -sh "$DEST" | cut -f1)
printf 'install_seconds=%s\nlmcache_build_seconds=%s\nlmcache_from=%s\nsize=%s\n' "$secs" "$lmcache_build_seconds" "$LMCACHE_FROM" "$size" > "$DEST/.done"
echo "engine venv built in ${secs}s (LMCache built in ${lmcache_build_seconds}s), ${size}: $DEST" >&2
echo "$DEST"
