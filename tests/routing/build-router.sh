#!/usr/bin/env bash
# vLLM's router (`vllm-router` on PyPI: a Rust core in a Python wheel) in its own cached venv, for the
# routing tests and the routing benchmark only (never an operator dependency). Built once per version
# under ~/.cache/kvoffload; a finished venv has .done; a broken half-install is rebuilt.
#   tests/routing/build-router.sh [VERSION]   -> prints the venv's path
set -euo pipefail
VERSION=${1:-0.1.17}
PY=${PY:-python3}
. "$(dirname "$0")/../support/cached-venv.sh"
DEST=$CACHE/vllm-router-$VERSION
cached_venv_begin "$DEST"

start=$(date +%s)
"$PY" -m venv "$DEST" >&2
"$DEST/bin/pip" install -q --disable-pip-version-check --no-cache-dir "vllm-router==$VERSION" >&2
"$DEST/bin/python" -c "from importlib.metadata import version; v = version('vllm-router'); assert v == '$VERSION', v" >&2
test -x "$DEST/bin/vllm-router"
secs=$(( $(date +%s) - start ))
printf 'install_seconds=%s\nsize=%s\n' "$secs" "$(du -sh "$DEST" | cut -f1)" > "$DEST/.done"
echo "vllm-router $VERSION built in ${secs}s: $DEST" >&2
echo "$DEST"
