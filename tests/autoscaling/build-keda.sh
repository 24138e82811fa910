#!/usr/bin/env bash
# Build KEDA's operator and metrics API server (keda-adapter) from github.com/kedacore/keda/v2.
# `go install ...@v2.21.0` refuses (its go.mod has a replace directive), so a wrapper module requires
# it and copies that one replace. One local change: upstream's adapter serves its own /metrics on ":<port>"
# (every interface, no flag to change it); ours binds 127.0.0.1 (the network rule), from a copy of
# cmd/adapter/main.go with that one line changed. Cached by version under $KVO_CACHE (default
# ~/.cache/kvoffload)/keda-<v>-<patch>/, rebuilt only when missing, under a flock so two builders never share
# the work dir. Prints the bin dir (keda, keda-adapter, crds/). `--check`: print it and exit 0 if built, else
# exit 1 without building (the tests ask so: a build is `make keda`'s, not a test's).
set -euo pipefail

KEDA_VERSION="${KEDA_VERSION:-v2.21.0}"
PATCH=loopback1  # bump when the adapter patch changes
# shellcheck source=tests/support/cached-build.sh
source "$(dirname "$0")/../support/cached-build.sh"
OUT="$CACHE/keda-$KEDA_VERSION-$PATCH"
WORK="$CACHE/src/keda-$KEDA_VERSION"
export GOFLAGS="${GOFLAGS:--buildvcs=false}" CGO_ENABLED=0
log() { echo "[keda $(date +%T)] $*" >&2; }
if [ "${1:-}" = --check ]; then
  cached_built "$OUT/keda" "$OUT/keda-adapter" && echo "$OUT"
  exit
fi
cached_build_lock keda
if ! cached_built "$OUT/keda" "$OUT/keda-adapter"; then
  start=$(date +%s)
  log "building KEDA $KEDA_VERSION (go mod tidy + go build, several minutes)"
  if ! grep -qs "github.com/kedacore/keda/v2 $KEDA_VERSION" "$WORK/go.mod" || [ ! -s "$WORK/go.sum" ]; then
    rm -rf "$WORK"; mkdir -p "$WORK"; cd "$WORK"
    go mod init example.invalid/kedabin >/dev/null 2>&1
    go mod edit -go=1.26 -require="github.com/kedacore/keda/v2@$KEDA_VERSION"
    gomod=$(go mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
    # Copy upstream's replace directives (one in v2.21.0): a dependency's replaces do not apply to us.
    # "replace A vX => B vY" -> -replace=A@vX=B@vY (single-line replaces only: v2.21.0 has no replace block)
    sed -n 's|^replace \([^ ]*\) \([^ ]*\) => \([^ ]*\) \([^ ]*\)$|\1@\2=\3@\4|p' "$gomod" |
      while read -r r; do go mod edit -replace="$r"; done
    ! grep -q '^replace (' "$gomod" || { log "upstream go.mod has a replace block: extend this script"; exit 1; }
    grep -E '^godebug' "$gomod" >> go.mod || true
    cat > tools.go <<'GO'
//go:build tools
package tools
import (
	_ "github.com/kedacore/keda/v2/cmd/adapter"
	_ "github.com/kedacore/keda/v2/cmd/operator"
)
GO
    go mod tidy
  fi
  cd "$WORK"
  tidy=$(( $(date +%s) - start ))
  src=$(go list -m -f '{{.Dir}}' github.com/kedacore/keda/v2)
  mkdir -p adapter
  sed 's|metricsBindAddress := fmt.Sprintf(":%v", metricsAPIServerPort)|metricsBindAddress := fmt.Sprintf("127.0.0.1:%v", metricsAPIServerPort)|' \
    "$src/cmd/adapter/main.go" > adapter/main.go
  grep -q '"127.0.0.1:%v"' adapter/main.go || { log "the adapter patch no longer applies"; exit 1; }
  rm -rf "$OUT.tmp"; mkdir -p "$OUT.tmp"
  ldflags="-s -w -X github.com/kedacore/keda/v2/version.Version=$KEDA_VERSION"
  go build -p 2 -trimpath -ldflags "$ldflags" -o "$OUT.tmp/keda" github.com/kedacore/keda/v2/cmd/operator
  go build -p 2 -trimpath -ldflags "$ldflags" -o "$OUT.tmp/keda-adapter" ./adapter
  # KEDA's CRDs (ScaledObject, TriggerAuthentication, ...) from the same module.
  mkdir -p "$OUT.tmp/crds"; cp "$src"/config/crd/bases/*.yaml "$OUT.tmp/crds/"; chmod -R u+w "$OUT.tmp"
  rm -rf "$OUT"; mv "$OUT.tmp" "$OUT"
  log "built in $(( $(date +%s) - start ))s (go mod tidy ${tidy}s); $(du -sh "$OUT" | cut -f1) in $OUT"
fi
echo "$OUT"
