#!/usr/bin/env bash
# The wheel site one engine pair needs on the GPU host (no network there), cached by version:
#   carry.sh VLLM-LMCACHE   (e.g. 0.33.0-0.5.6)  -> prints the directory holding the parts and SHA256SUMS
# ~/.cache/kvoffload/gpu-carry-py312-vllm-V-lmcache-L/: <stem>.partaa.. (PART_MIB MiB each, default 50, so
# that a part plus the checkout stays under the device's 64 MiB a call), SHA256SUMS, manifest.txt
# (distribution==version of the site), removed.txt, .done. <stem> is `site` for the host's pair (gpu_pod.HOST_PAIR)
# (dev.sh's first protocol) and `site-V-L` for another. The parts are one xz stream of the wheels
# (requirements-h200[-vllm-V].txt, pip install --no-index --no-deps --target, for the host's Python 3.12
# on manylinux x86_64), then, for a pair whose LMCache the serving image compiles from source
# (engine/images.py lmcache_from), a second of LMCache as compiled for Python 3.12 against the carried
# torch (its RECORD's files; build-lmcache-py312.sh, or LMCACHE_VENV):
# dev.sh install reads them with `xz -dc | tar -x -i`. The wheels' stream is kept
# (base.tar.xz) while LMCache is still being compiled, so a rerun only adds its stream.
set -euo pipefail
PAIR=${1:?usage: carry.sh VLLM-LMCACHE, e.g. 0.33.0-0.5.6}
VLLM=${PAIR%%-*}
LMCACHE=${PAIR#*-}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
CACHE=${KVO_CACHE:-$HOME/.cache/kvoffload}
DEST=$CACHE/gpu-carry-py312-vllm-$VLLM-lmcache-$LMCACHE
PART_MIB=${PART_MIB:-50}
PY=${PY:-python3}
HOST_PAIR=$(sed -n 's/^HOST_PAIR = "\(.*\)"$/\1/p' "$ROOT/benchmarks/gpu/gpu_pod.py")  # the host's torch's pair
eval "$(PYTHONPATH=$ROOT/operator "$PY" - "$VLLM" "$LMCACHE" "$HOST_PAIR" <<'EOF'
import sys
from kvoffload.engine import images
vllm, lmcache, host_pair = sys.argv[1:]
pair = {(k.vllm, k.lmcache): (image, k) for image, k in images.serving_images().items()}
if (vllm, lmcache) not in pair:
    sys.exit(f"carry.sh: {vllm}-{lmcache} is no serving image's pair (engine/images.py): "
             f"{', '.join(f'{v}-{l}' for v, l in pair)}")
image, k = pair[(vllm, lmcache)]
print(f"LMCACHE_FROM={k.lmcache_from}; STEM={'site' if f'{vllm}-{lmcache}' == host_pair else f'site-{vllm}-{lmcache}'}")
EOF
)"
REQ=$HERE/requirements-h200-vllm-$VLLM.txt
[ -f "$REQ" ] || REQ=$HERE/requirements-h200.txt  # the host pair's list
grep -q "^vllm==$VLLM\b" "$REQ" || { echo "carry.sh: $REQ does not pin vllm==$VLLM" >&2; exit 2; }
[ -f "$DEST/.done" ] && { echo "$DEST"; exit 0; }
mkdir -p "$DEST"
exec 9>"$DEST/lock"
flock 9
[ -f "$DEST/.done" ] && { echo "$DEST"; exit 0; }
W=$DEST/work
TAGS=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none --only-binary=:all:)
for n in 17 18 24 26 27 28 31 34 35; do TAGS+=(--platform "manylinux_2_${n}_x86_64"); done
TAGS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
start=$(date +%s)

if [ ! -f "$DEST/base.tar.xz.done" ]; then
  rm -rf "$W" "$DEST/base.tar.xz"
  mkdir -p "$W/wheels"
  "$PY" -m pip download -q --no-deps --no-cache-dir "${TAGS[@]}" -d "$W/wheels" -r "$REQ" >&2
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "${TAGS[@]}" --target "$W/site" "$W"/wheels/*.whl >&2
  rm -rf "$W/wheels"
  # What the serving path does not load: the requirements file's `# remove: PATH` lines, listed with their size.
  : > "$DEST/removed.txt"
  for rel in $(sed -n 's/^# remove: \([^ ]*\).*/\1/p' "$REQ"); do
    [ -e "$W/site/$rel" ] || { echo "carry.sh: $REQ removes $rel, which no wheel installed" >&2; exit 2; }
    echo "$rel $(du -sb "$W/site/$rel" | cut -f1)" >> "$DEST/removed.txt"
    rm -rf "${W:?}/site/$rel"
  done
  tar -C "$W/site" --sort=name --owner=0 --group=0 -cf - . | xz -6 -T0 > "$DEST/base.tar.xz"
  (cd "$W/site" && ls -d ./*.dist-info | sed 's#^\./##; s#\.dist-info$##' | sort) > "$DEST/manifest.txt"
  du -sb "$W/site" | cut -f1 > "$DEST/base.unpacked-bytes"
  rm -rf "$W/site"
  touch "$DEST/base.tar.xz.done"
  echo "wheels' site: $(stat -c %s "$DEST/base.tar.xz") bytes xz in $(( $(date +%s) - start )) s" >&2
fi

streams=("$DEST/base.tar.xz")
if [ "$LMCACHE_FROM" = source ]; then
  # LMCache as compiled for the host's Python 3.12 against the carried torch: the engine venv's when it is a
  # 3.12 one (tests/engine/build-venv.sh ... source), else build-lmcache-py312.sh's (its own cached venv: make
  # test builds the engine venvs with this machine's python3). LMCACHE_VENV: another such venv.
  ENGINE=${LMCACHE_VENV:-$CACHE/engine-vllm-$VLLM-lmcache-$LMCACHE}
  if [ -z "${LMCACHE_VENV:-}" ] && ! { [ -f "$ENGINE/.done" ] && [ -x "$ENGINE/bin/python3.12" ]; }; then
    ENGINE=$(bash "$HERE/build-lmcache-py312.sh" "$LMCACHE" "$(sed -n 's/^torch==\([^ ]*\).*/\1/p' "$REQ")")
  fi
  rm -rf "$W" && mkdir -p "$W/site"
  "$ENGINE/bin/python" - "$W/site" "$VLLM" "$DEST/manifest.txt" "$DEST/venv-diff.txt" <<'EOF' >&2
"""LMCache's installed files into the carried site, and the engine venv's versions against the carried ones."""
import importlib.metadata as md, pathlib, re, shutil, sys
site, vllm, manifest, diff = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
assert sys.version_info[:2] == (3, 12), f"{sys.prefix} is Python {sys.version.split()[0]}: the GPU host runs 3.12"
dist = md.distribution("lmcache")
n = 0
for f in dist.files:
    src = pathlib.Path(f.locate()).resolve()
    if ".." in f.parts or "__pycache__" in f.parts or not src.is_file():
        continue  # console scripts (../../bin) and byte code: dev.sh writes its own
    dst = site / f
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)
    n += 1
key = lambda s: re.sub(r"[-_.]+", "-", s).lower()
venv = {key(d.metadata["Name"]): d.version for d in md.distributions()}
carried = dict(line.strip().rsplit("-", 1) for line in open(manifest) if line.strip())
carried = {key(k): v for k, v in carried.items()}
lines = [f"{name}: carried {v}, engine venv {venv.get(name, 'absent')}" for name, v in sorted(carried.items())
         if venv.get(name) != v]
open(diff, "w").write("".join(l + "\n" for l in lines))
print(f"lmcache {dist.version}: {n} files; {len(lines)} carried versions differ from the engine venv's ({diff})")
if venv.get("torch") != carried.get("torch"):  # the extension's ABI is its torch's
    sys.exit(f"torch: carried {carried.get('torch')}, {sys.prefix}'s {venv.get('torch')}: LMCache's extension is built for that")
EOF
  tar -C "$W/site" --sort=name --owner=0 --group=0 -cf - . | xz -6 -T0 > "$DEST/lmcache.tar.xz"
  echo "lmcache-$LMCACHE" >> "$DEST/manifest.txt"
  rm -rf "$W"
  streams+=("$DEST/lmcache.tar.xz")
fi

cd "$DEST"
rm -f "$STEM".part*
cat "${streams[@]}" | split -b "${PART_MIB}M" -a 2 - "$STEM.part"
sha256sum "$STEM".part* > SHA256SUMS
total=$(cat "$STEM".part* | wc -c)
rm -f base.tar.xz lmcache.tar.xz base.tar.xz.done
printf 'pair=%s\nparts=%s\nxz_bytes=%s\nunpacked_bytes=%s\npart_mib=%s\nseconds=%s\n' "$PAIR" "$(ls "$STEM".part* | wc -l)" \
  "$total" "$(cat base.unpacked-bytes)" "$PART_MIB" "$(( $(date +%s) - start ))" > .done
echo "$DEST"
