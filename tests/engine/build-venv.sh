#!/usr/bin/env bash
# The pinned engine (vLLM + LMCache from PyPI) in a cached venv, for the fidelity tests only:
# vLLM's real `vllm serve` parser and create_engine_config(), LMCache's real config loader.
# Never a dependency of the operator package. Built once per pair under ~/.cache/kvoffload;
# a finished venv has .done (with the install time); a broken half-install is rebuilt.
#   tests/engine/build-venv.sh [VLLM_VERSION LMCACHE_VERSION]   -> prints the venv's path
set -euo pipefail
VLLM_VERSION=${1:-0.26.0}
LMCACHE_VERSION=${2:-0.5.3}
PY=${PY:-python3}
CACHE=${KVO_CACHE:-$HOME/.cache/kvoffload}
DEST=$CACHE/engine-vllm-$VLLM_VERSION-lmcache-$LMCACHE_VERSION
if [ -f "$DEST/.done" ]; then echo "$DEST"; exit 0; fi

mkdir -p "$CACHE"
exec 9>"$DEST.lock"
flock 9                          # a second caller waits for the first build instead of racing it
if [ -f "$DEST/.done" ]; then echo "$DEST"; exit 0; fi

start=$(date +%s)
rm -rf "$DEST"
"$PY" -m venv "$DEST" >&2
"$DEST/bin/pip" install -q --upgrade pip >&2
# Both from PyPI with their declared deps: the same wheels the serving image installs.
"$DEST/bin/pip" install -q --disable-pip-version-check \
  "vllm==$VLLM_VERSION" "lmcache==$LMCACHE_VERSION" >&2
"$DEST/bin/python" - "$VLLM_VERSION" "$LMCACHE_VERSION" >&2 <<'PY'
import sys
from importlib.metadata import version
want = {"vllm": sys.argv[1], "lmcache": sys.argv[2]}
got = {name: version(name) for name in want}
assert got == want, f"installed {got}, wanted {want}"
print("engine venv:", got, "torch", version("torch"))
PY
secs=$(( $(date +%s) - start ))
size=$(du -sh "$DEST" | cut -f1)
printf 'install_seconds=%s\nsize=%s\n' "$secs" "$size" > "$DEST/.done"
echo "engine venv built in ${secs}s, ${size}: $DEST" >&2
echo "$DEST"
