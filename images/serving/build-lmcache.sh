#!/usr/bin/env bash
# LMCache compiled from its PyPI sdist against the torch already installed beside vLLM, as LMCache's own
# docker/Dockerfile builds it (setup.py, BUILD_WITH_CUDA=1, without build isolation so that the extension
# is compiled against this torch and not the one LMCache's pyproject pins). For a vLLM whose torch no
# LMCache wheel was built against (vLLM 0.33.0's torch 2.14.0: LMCache 0.5.6's wheel lacks
# c10_cuda_check_implementation there). No GPU is needed: nvcc and the CUDA headers come from PyPI's
# cuda-toolkit wheels of the version torch itself requires, and are removed again after the build.
# The serving image (images/serving/Dockerfile, LMCACHE_FROM=source) and the engine venvs
# (tests/engine/build-venv.sh) both run this file.
#   build-lmcache.sh PYTHON LMCACHE_VERSION      (TORCH_CUDA_ARCH_LIST: the GPU architectures, e.g. "9.0")
#   build-lmcache.sh --download DIR PYTHON LMCACHE_VERSION
# LMCACHE_WHEEL_DIR (optional): compile a wheel, install it, and keep it in that directory once the extension
# check passed (with .done); when the directory already holds one, install it and compile nothing. The caller
# names the directory by vLLM (its torch), LMCache and TORCH_CUDA_ARCH_LIST, so one compile serves every
# environment of that torch: `make test` compiles once in the engine venv (tests/engine/build-venv.sh) and
# its serving image build installs the same wheel (tests/support/kvtest/images.py).
# --download compiles nothing: it puts into DIR what the build would fetch from the index into PYTHON's
# environment (the toolchain below as pip resolves it there, and LMCache's sdist), for an offline build
# (PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR) in an environment holding the same packages as PYTHON's but LMCache:
# tests/support/kvtest/images.py runs it in the pair's engine venv for the serving image's local build.
set -euo pipefail
DOWNLOAD=
if [ "${1:-}" = --download ]; then DOWNLOAD=$2; shift 2; fi
PY=$1
VERSION=$2
[ -n "$DOWNLOAD" ] || : "${TORCH_CUDA_ARCH_LIST:?set the GPU architectures to compile for, e.g. 9.0}"
HERE=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# torch, vLLM and torch's CUDA toolkit stay exactly as installed.
"$PY" -m pip list --format=freeze > "$work/before.txt"
grep -E '^(torch|vllm|cuda-toolkit)==' "$work/before.txt" > "$work/constraints.txt"
toolkit=$(sed -n 's/^cuda-toolkit==//p' "$work/constraints.txt")
# A torch without the cuda-toolkit meta-package (older wheels): the toolkit of its CUDA release.
[ -n "$toolkit" ] || toolkit="$("$PY" -c 'import torch; print(torch.version.cuda)').*"
PIP=("$PY" -m pip install -q --no-cache-dir --disable-pip-version-check -c "$work/constraints.txt")
# The compiler and headers, and LMCache's build requirements (its requirements/build.txt, torch aside).
TOOLCHAIN=("cuda-toolkit[nvcc,cccl,crt,cudart]==$toolkit"
  ninja 'packaging>=24.2' 'setuptools>=77.0.3,<81.0.0' 'setuptools_scm>=8' 'grpcio-tools==1.78.0' wheel)
if [ -n "$DOWNLOAD" ]; then
  # Exactly the files pip would install here (dry-run reports): the toolchain; what LMCache's own install needs
  # that this environment lacks, resolved with every installed package pinned (an engine venv cleaned up by this
  # script before it followed extras lacks grpcio-status, which google-api-core[grpc] needs); then the sdist.
  mkdir -p "$DOWNLOAD"
  "${PIP[@]}" --dry-run --report "$work/toolchain.json" "${TOOLCHAIN[@]}"
  "$PY" -m pip list --format=freeze --exclude lmcache | grep '==' > "$work/installed.txt"
  "$PY" -m pip install -q --no-cache-dir --disable-pip-version-check --dry-run --ignore-installed \
    -c "$work/installed.txt" --report "$work/lmcache.json" "lmcache==$VERSION"
  mapfile -t urls < <("$PY" - "$work/installed.txt" "$work/toolchain.json" "$work/lmcache.json" <<'PYEOF'
import json, sys
from packaging.utils import canonicalize_name as key
installed = {(key(n), v) for n, v in (line.strip().split("==", 1) for line in open(sys.argv[1]) if "==" in line)}
urls = []
for report in sys.argv[2:]:
    for item in json.load(open(report))["install"]:
        meta = item["metadata"]
        if key(meta["name"]) != "lmcache" and (key(meta["name"]), meta["version"]) not in installed:
            urls.append(item["download_info"]["url"])
print("\n".join(dict.fromkeys(urls)))
PYEOF
)
  DL=("$PY" -m pip download -q --no-cache-dir --disable-pip-version-check --no-deps -d "$DOWNLOAD")
  [ "${#urls[@]}" = 0 ] || "${DL[@]}" "${urls[@]}"
  "${DL[@]}" --no-binary lmcache "lmcache==$VERSION"
  echo "build-lmcache.sh --download: ${#urls[@]} files and lmcache $VERSION's sdist in $DOWNLOAD: $(ls "$DOWNLOAD" | tr '\n' ' ')" >&2
  exit 0
fi
WHEEL_DIR=${LMCACHE_WHEEL_DIR:-}
if [ -n "$WHEEL_DIR" ] && [ -f "$WHEEL_DIR/.done" ]; then
  # Only into the torch it was compiled against (its extension binds that torch's symbols).
  built_for=$(sed -n 's/^torch=//p' "$WHEEL_DIR/.done")
  here=$("$PY" -c 'import torch; print(torch.__version__)')
  if [ "$built_for" != "$here" ]; then
    echo "$WHEEL_DIR holds LMCache compiled against torch $built_for; $PY has torch $here" >&2
    exit 1
  fi
  "${PIP[@]}" "$WHEEL_DIR"/lmcache-"$VERSION"-*.whl
  "$PY" "$HERE/extension_check.py"
  echo "LMCache $VERSION installed from $WHEEL_DIR (compiled before: $(tr '\n' ' ' < "$WHEEL_DIR/.done"))" >&2
  exit 0
fi
"${PIP[@]}" "${TOOLCHAIN[@]}"
purelib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
nvcc=$(find "$purelib/nvidia" -path '*/bin/nvcc' -type f | head -1)
[ -n "$nvcc" ] || { echo "no nvcc under $purelib/nvidia after installing cuda-toolkit[nvcc]==$toolkit" >&2; exit 1; }
cuda_home=$(dirname "$(dirname "$nvcc")")
# The linker wants libcudart.so; the runtime wheel may ship only libcudart.so.<major>.
if [ ! -e "$cuda_home/lib/libcudart.so" ]; then
  ln -s "$(basename "$(ls "$cuda_home"/lib/libcudart.so.* | head -1)")" "$cuda_home/lib/libcudart.so"
fi

start=$(date +%s)
BUILD_ENV=(env CUDA_HOME="$cuda_home" PATH="$cuda_home/bin:$(dirname "$PY"):$PATH" BUILD_WITH_CUDA=1
  LMCACHE_CUDA_MAJOR="${toolkit%%.*}" MAX_JOBS="${MAX_JOBS:-2}" NVCC_THREADS="${NVCC_THREADS:-1}")
if [ -n "$WHEEL_DIR" ]; then
  "${BUILD_ENV[@]}" "$PY" -m pip wheel -q --no-cache-dir --disable-pip-version-check --no-deps --no-build-isolation \
    --no-binary lmcache -w "$work/wheel" "lmcache==$VERSION"
  "${PIP[@]}" "$work/wheel"/lmcache-"$VERSION"-*.whl
else
  "${BUILD_ENV[@]}" "${PIP[@]}" --no-build-isolation --no-binary lmcache "lmcache==$VERSION"
fi
seconds=$(( $(date +%s) - start ))
echo "LMCache $VERSION compiled in $seconds s for TORCH_CUDA_ARCH_LIST='$TORCH_CUDA_ARCH_LIST' (CUDA $toolkit)" >&2

# The build-only packages go again: what this script added that no installed package requires.
"$PY" -m pip list --format=freeze > "$work/after.txt"
build_only=$("$PY" - "$work/before.txt" "$work/after.txt" <<'PYEOF'
import re, sys
from importlib.metadata import distributions
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name as key
names = lambda path: {key(re.split("[=@ ]", l)[0]) for l in open(path) if l.strip()}
added = names(sys.argv[2]) - names(sys.argv[1]) - {"lmcache"}
dists = {key(d.metadata["Name"]): d for d in distributions()}
# Everything that stays and what it requires, extras followed (`google-api-core[grpc]` needs google-api-core's
# `extra == "grpc"` requirements: grpcio-status) and markers evaluated here. What the build added that none of
# it needs goes (nvcc's own nvvm and crt go with it).
seen, stack = set(), [(n, frozenset()) for n in dists if n not in added]
while stack:
    name, extras = stack.pop()
    if (name, extras) in seen or name not in dists:
        continue
    seen.add((name, extras))
    for r in dists[name].requires or []:
        try:
            req = Requirement(r)
        except InvalidRequirement:  # kept, unread
            stack.append((key(re.split(r"[\s\[<>=!~;(]", r, maxsplit=1)[0]), frozenset()))
            continue
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
            stack.append((key(req.name), frozenset(req.extras)))
print(" ".join(sorted(added - {name for name, _ in seen})))
PYEOF
)
if [ -n "$build_only" ]; then
  # shellcheck disable=SC2086  # one package name per word
  "$PY" -m pip uninstall -q -y $build_only
fi
# The extension loads against this torch with every symbol bound, without the compiler.
"$PY" "$HERE/extension_check.py"
if [ -n "$WHEEL_DIR" ]; then
  # Kept only now that its extension loaded: a failed build leaves no wheel to reuse.
  mkdir -p "$WHEEL_DIR"
  cp "$work/wheel"/lmcache-"$VERSION"-*.whl "$WHEEL_DIR/"
  printf 'torch=%s\ntorch_cuda_arch_list=%s\ncuda=%s\ncompile_seconds=%s\n' \
    "$("$PY" -c 'import torch; print(torch.__version__)')" "$TORCH_CUDA_ARCH_LIST" "$toolkit" "$seconds" \
    > "$WHEEL_DIR/.done"
fi
