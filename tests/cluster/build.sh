#!/usr/bin/env bash
# Build the real Kubernetes control plane, etcd, kwok and helm from Go modules.
# Outputs are cached by version under $KVO_CACHE (default ~/.cache/kvoffload) and
# rebuilt only when missing. Safe to run repeatedly; prints the bin directory.
set -euo pipefail

# shellcheck source=tests/cluster/k8s-module.sh
source "$(dirname "$0")/k8s-module.sh"
# shellcheck source=tests/support/cached-build.sh
source "$(dirname "$0")/../support/cached-build.sh"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
HELM_VERSION="${HELM_VERSION:-v4.3.1}"
BIN="$CACHE/bin-k8s-v$K8S_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION"
WORK="$CACHE/src"
# One builder at a time: each binary's -x test below is its done-marker, and two builders (two checkouts on one
# machine) would otherwise build into one work dir and one binary path at once.
cached_build_lock cluster
mkdir -p "$BIN" "$WORK"

build_k8s() {
  [ -x "$BIN/kube-apiserver" ] && [ -x "$BIN/kube-controller-manager" ] && [ -x "$BIN/kube-scheduler" ] && return
  log "kube-apiserver/controller-manager/scheduler v$K8S_VERSION"
  local cmds=(k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler)
  k8s_module "$WORK/k8s-$K8S_VERSION" "${cmds[@]}"
  k8s_build "$BIN" "${cmds[@]}"
}

build_etcd() {
  [ -x "$BIN/etcd" ] && return
  # The etcd server version that matches the etcd client k8s pins.
  local kgomod ev
  kgomod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
  ev=$(sed -n 's|^[[:space:]]*go.etcd.io/etcd/client/v3 \(v[0-9.]*\).*|\1|p' "$kgomod" | head -1)
  log "etcd $ev"
  local d="$WORK/etcd-$ev"; rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init example.invalid/etcdbin >/dev/null 2>&1
  go mod edit -go=1.26 -require="go.etcd.io/etcd/server/v3@$ev"
  printf '//go:build tools\npackage tools\nimport _ "go.etcd.io/etcd/server/v3"\n' > tools.go
  go mod tidy
  go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
}

build_kwok() {
  [ -x "$BIN/kwok" ] && [ -f "$BIN/kwok-stages/node/fast/node-initialize.yaml" ] && return
  log "kwok $KWOK_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  # Keep kwok's own stage definitions next to the binary.
  local src; src=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage
  mkdir -p "$BIN/kwok-stages"; cp -r "$src"/. "$BIN/kwok-stages/"; chmod -R u+w "$BIN/kwok-stages"
}

build_helm() {
  [ -x "$BIN/helm" ] && return
  log "helm $HELM_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
}

start=$(date +%s)
build_etcd; build_kwok; build_helm; build_k8s
log "done in $(( $(date +%s) - start ))s; $(du -sh "$BIN" | cut -f1) in $BIN"
echo "$BIN"
