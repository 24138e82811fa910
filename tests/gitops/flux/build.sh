#!/usr/bin/env bash
# Build Flux's source-controller and kustomize-controller from their Go modules, as released, and keep
# their CRDs (each module's config/crd/bases). Cached under
# $KVO_CACHE/flux-source-controller-<v>-kustomize-controller-<v>-<recipe hash>/ (rebuilt only when
# missing; its own work dir, under a flock so two runs never build into one place).
# Prints source-controller=PATH, kustomize-controller=PATH and flux-crds=DIR on stdout.
#
# Versions: v1.9.6 of both, the newest whose whole build graph the Go module proxy serves here.
# v1.10.x needs github.com/fluxcd/pkg/{apis/crypto,spiffe,masktoken v0.10,http/fetch v0.30} and
# pkg/artifact v0.27, which it refuses ("This module version is not available").
#
# How: each module's own source is the main module, so its own go.mod and go.sum (replace directives,
# pins) apply exactly as in Flux's Dockerfile build (`go build -trimpath main.go`), with two edits:
#  - the module zip leaves out the nested ./api module its go.mod replaces it with; the published
#    api module of the same tag (identical source) is used instead;
#  - source-controller v1.9.6 pins github.com/fluxcd/pkg/artifact v0.18.3, which the proxy refuses:
#    v0.18.0 is used (v0.18.0..v0.18.2 change only artifact's go.mod; every other pin stays).
set -euo pipefail

SOURCE_VERSION="${FLUX_SOURCE_CONTROLLER_VERSION:-v1.9.6}"
KUSTOMIZE_VERSION="${FLUX_KUSTOMIZE_CONTROLLER_VERSION:-v1.9.6}"
# shellcheck source=tests/support/cached-build.sh
source "$(dirname "$0")/../../support/cached-build.sh"
export GOFLAGS="${GOFLAGS:--buildvcs=false}" CGO_ENABLED=0 GOTOOLCHAIN=local
log() { echo "[flux $(date +%T)] $*" >&2; }

# The recipe's id: bump it when a build step changes (it was this script's sha256 until the lock and cache lines
# moved to cached-build.sh, which changed no step; a hash of the script rebuilt on every edit, comments included).
recipe=d2f058b24b
OUT="$CACHE/flux-source-controller-$SOURCE_VERSION-kustomize-controller-$KUSTOMIZE_VERSION-$recipe"

# build NAME VERSION [go mod edit args...]: the module's own main package, its CRDs into crds/.
build() {
  local name="$1" version="$2"; shift 2
  local mod="github.com/fluxcd/$name" src="$OUT.tmp/src/$name" dir
  dir=$(go mod download -json "$mod@$version" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  rm -rf "$src"; mkdir -p "$(dirname "$src")"; cp -r "$dir" "$src"; chmod -R u+w "$src"
  (cd "$src" && go mod edit -dropreplace="$mod/api" "$@" &&
     go build -mod=mod -trimpath -ldflags "-s -w" -o "$OUT.tmp/$name" .)
  cp "$src"/config/crd/bases/*.yaml "$OUT.tmp/crds/"
}

cached_build_lock flux
if ! cached_built "$OUT/source-controller" "$OUT/kustomize-controller"; then
  start=$(date +%s)
  log "source-controller $SOURCE_VERSION, kustomize-controller $KUSTOMIZE_VERSION"
  rm -rf "$OUT.tmp"; mkdir -p "$OUT.tmp/crds"
  build source-controller "$SOURCE_VERSION" -replace=github.com/fluxcd/pkg/artifact=github.com/fluxcd/pkg/artifact@v0.18.0
  build kustomize-controller "$KUSTOMIZE_VERSION"
  rm -rf "$OUT.tmp/src" "$OUT"; mv "$OUT.tmp" "$OUT"
  log "built in $(( $(date +%s) - start ))s; $(du -sh "$OUT" | cut -f1) in $OUT"
fi
echo "source-controller=$OUT/source-controller"
echo "kustomize-controller=$OUT/kustomize-controller"
echo "flux-crds=$OUT/crds"
