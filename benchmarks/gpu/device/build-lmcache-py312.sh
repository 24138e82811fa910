#!/usr/bin/env bash
# LMCache compiled from its sdist for the GPU host's Python 3.12 against the torch carried there, in its own
# cached venv (images/serving/build-lmcache.sh, the serving image's build step; sm_90 only: the H200):
#   build-lmcache-py312.sh LMCACHE_VERSION TORCH_VERSION   -> prints the venv's path
# For carry.sh when the engine venv's LMCache is built for another Python (make test builds the engine venvs
# with this machine's python3, 3.11 here: its extension would not load on 3.12). PY312: a Python 3.12
# (default: python3.12 on PATH, else pyenv's). ~20 CPU-minutes the first time; cached by version after.
set -euo pipefail
LMCACHE=${1:?usage: build-lmcache-py312.sh LMCACHE_VERSION TORCH_VERSION}
TORCH=${2:?torch version}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
CACHE=${KVO_CACHE:-$HOME/.cache/kvoffload}
DEST=$CACHE/gpu-lmcache-$LMCACHE-torch-$TORCH-py312-sm90
[ -f "$DEST/.done" ] && { echo "$DEST"; exit 0; }
is312() { [ -x "$1" ] && "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; }
if [ -z "${PY312:-}" ]; then
  for c in "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.12*/bin/python3; do is312 "$c" && PY312=$c; done
fi
is312 "${PY312:-}" || { echo "build-lmcache-py312.sh: no Python 3.12 (set PY312)" >&2; exit 2; }
mkdir -p "$CACHE"
exec 9>"$DEST.lock"
flock 9
[ -f "$DEST/.done" ] && { echo "$DEST"; exit 0; }
rm -rf "$DEST"
start=$(date +%s)
"$PY312" -m venv "$DEST" >&2
"$DEST/bin/pip" install -q --no-cache-dir --disable-pip-version-check --upgrade pip >&2
"$DEST/bin/pip" install -q --no-cache-dir --disable-pip-version-check "torch==$TORCH" >&2
TORCH_CUDA_ARCH_LIST=9.0 "$ROOT/images/serving/build-lmcache.sh" "$DEST/bin/python" "$LMCACHE" >&2
printf 'seconds=%s\npython=%s\n' "$(( $(date +%s) - start ))" "$("$DEST/bin/python" -V)" > "$DEST/.done"
echo "$DEST"
