#!/usr/bin/env bash
# Build the GitOps test tools from Go modules (pinned in each go.mod/go.sum):
#   argocd-health  Argo CD's Lua health runner on gopher-lua (the interpreter Argo CD embeds)
#   kstatus-check  kstatus verdicts (github.com/fluxcd/cli-utils, the version Helm v4.3.1 waits with)
#   Flux           source-controller and kustomize-controller, and their CRDs (tests/gitops/flux/build.sh)
# Cached under $KVO_CACHE (default ~/.cache/kvoffload)/<tool>-<pinned lib>-<source hash>/, rebuilt
# only when missing. Prints `name=path` per tool on stdout. --without-flux: the first two only (`make test` builds
# Flux in the background: Makefile background-builds).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${KVO_CACHE:-$HOME/.cache/kvoffload}"
export GOFLAGS="${GOFLAGS:--buildvcs=false}" CGO_ENABLED=0
log() { echo "[gitops-tools $(date +%T)] $*" >&2; }

# build NAME PINNED-MODULE: the directory's module, tagged with the pinned library's version.
build() {
  local name="$1" pin="$2" src="$HERE/$1" version hash out
  version=$(sed -n "s|^[[:space:]]*$pin \(v[^ ]*\).*|\1|p" "$src/go.mod" | head -1)
  hash=$(cat "$src/go.mod" "$src/go.sum" "$src"/*.go | sha256sum | cut -c1-10)
  out="$CACHE/$name-${pin##*/}-$version-$hash"
  if [ ! -x "$out/$name" ]; then
    log "$name ($pin $version)"
    local start; start=$(date +%s)
    mkdir -p "$out.tmp"
    (cd "$src" && go build -mod=readonly -trimpath -ldflags "-s -w" -o "$out.tmp/$name" .)
    rm -rf "$out"; mv "$out.tmp" "$out"
    log "$name built in $(( $(date +%s) - start ))s"
  fi
  echo "$name=$out/$name"
}

build argocd-health github.com/yuin/gopher-lua
build kstatus-check github.com/fluxcd/cli-utils
[ "${1:-}" = --without-flux ] || "$HERE/flux/build.sh"
