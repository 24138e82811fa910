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
  # Exactly the files pip would install here (its dry-run report), then the sdist the compile builds.
  mkdir -p "$DOWNLOAD"
  "${PIP[@]}" --dry-run --report "$work/report.json" "${TOOLCHAIN[@]}"
  mapfile -t urls < <("$PY" -c 'import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(item["download_info"]["url"])' "$work/report.json")
  DL=("$PY" -m pip download -q --no-cache-dir --disable-pip-version-check --no-deps -d "$DOWNLOAD")
  [ "${#urls[@]}" = 0 ] || "${DL[@]}" "${urls[@]}"
  "${DL[@]}" --no-binary lmcache "lmcache==$VERSION"
  echo "build-lmcache.sh --download: ${#urls[@]} toolchain files and lmcache $VERSION's sdist in $DOWNLOAD" >&2
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
CUDA_HOME=$cuda_home PATH="$cuda_home/bin:$(dirname "$PY"):$PATH" BUILD_WITH_CUDA=1 LMCACHE_CUDA_MAJOR=${toolkit%%.*} \
  MAX_JOBS=${MAX_JOBS:-2} NVCC_THREADS=${NVCC_THREADS:-1} \
  "${PIP[@]}" --no-build-isolation --no-binary lmcache "lmcache==$VERSION"
echo "LMCache $VERSION compiled in $(( $(date +%s) - start )) s for TORCH_CUDA_ARCH_LIST='$TORCH_CUDA_ARCH_LIST' (CUDA $toolkit)" >&2

# The build-only packages go again: what this script added that no installed package requires.
"$PY" -m pip list --format=freeze > "$work/after.txt"
build_only=$("$PY" - "$work/before.txt" "$work/after.txt" <<'PYEOF'
import re, sys
from importlib.metadata import distributions
names = lambda path: {re.split("[=@ ]", l)[0].lower().replace("_", "-") for l in open(path) if l.strip()}
key = lambda name: name.lower().replace("_", "-")
added = names(sys.argv[2]) - names(sys.argv[1]) - {"lmcache"}
needs = {key(d.metadata["Name"]): {key(re.split(r"[\s\[<>=!~;(]", r, maxsplit=1)[0])
                                   for r in d.requires or [] if "extra ==" not in r} for d in distributions()}
gone = set(added)
while True:  # what nothing that stays requires (nvcc's own nvvm and crt go with it)
    kept = set().union(*(reqs for name, reqs in needs.items() if name not in gone))
    if not gone & kept:
        break
    gone -= kept
print(" ".join(sorted(gone)))
PYEOF
)
if [ -n "$build_only" ]; then
  # shellcheck disable=SC2086  # one package name per word
  "$PY" -m pip uninstall -q -y $build_only
fi
# The extension loads against this torch with every symbol bound, without the compiler.
"$PY" "$HERE/extension_check.py"
