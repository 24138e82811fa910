#!/usr/bin/env bash
# Build the real node's binaries: kubelet + kube-proxy (the control plane's module recipe), containerd,
# ctr and its runc shim, the CNI plugins, and the pause image's binary (Kubernetes' pause.c, gcc -static).
# The OCI runtime (crun/runc), nft and podman are Debian packages (make system-deps).
# Cached by version under $KVO_CACHE (default ~/.cache/kvoffload); one build at a time (flock);
# rebuilt only when missing. Prints the bin directory.
set -euo pipefail

# shellcheck source=tests/cluster/k8s-module.sh
source "$(dirname "$0")/k8s-module.sh"
# shellcheck source=tests/support/cached-build.sh
source "$(dirname "$0")/../support/cached-build.sh"
CONTAINERD_VERSION="${CONTAINERD_VERSION:-v2.4.2}"
CNI_VERSION="${CNI_VERSION:-v1.10.0}"
BIN="$CACHE/node-k8s-v$K8S_VERSION-containerd-$CONTAINERD_VERSION-cni-$CNI_VERSION"
WORK="$CACHE/src-node"
mkdir -p "$BIN" "$WORK"
cached_build_lock node

build_kubelet() {
  cached_built "$BIN/kubelet" "$BIN/kube-proxy" && return
  log "kubelet, kube-proxy v$K8S_VERSION"
  local cmds=(k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy)
  k8s_module "$WORK/k8s-$K8S_VERSION" "${cmds[@]}"
  k8s_build "$BIN" "${cmds[@]}"
}

build_containerd() {
  cached_built "$BIN/containerd" "$BIN/ctr" "$BIN/containerd-shim-runc-v2" && return
  log "containerd $CONTAINERD_VERSION"
  local d="$WORK/containerd-$CONTAINERD_VERSION" m=github.com/containerd/containerd/v2
  rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init example.invalid/containerdbin >/dev/null 2>&1
  go mod edit -go=1.26 -require="$m@$CONTAINERD_VERSION"
  printf '//go:build tools\npackage tools\nimport (\n\t_ "%s/cmd/containerd"\n\t_ "%s/cmd/ctr"\n\t_ "%s/cmd/containerd-shim-runc-v2"\n)\n' "$m" "$m" "$m" > tools.go
  go mod tidy
  # No btrfs/devmapper/zfs snapshotters (cgo); overlayfs and native stay.
  go build -p 2 -trimpath -tags "no_btrfs no_devmapper no_zfs" -o "$BIN/" -ldflags "-s -w \
    -X $m/version.Version=$CONTAINERD_VERSION" "$m/cmd/containerd" "$m/cmd/ctr" "$m/cmd/containerd-shim-runc-v2"
}

build_cni() {
  cached_built "$BIN"/cni/{bridge,host-local,loopback,portmap} && return
  log "CNI plugins $CNI_VERSION"
  local m=github.com/containernetworking/plugins
  mkdir -p "$BIN/cni"
  GOBIN="$BIN/cni" go install -trimpath -ldflags "-s -w" \
    "$m/plugins/main/bridge@$CNI_VERSION" "$m/plugins/ipam/host-local@$CNI_VERSION" \
    "$m/plugins/main/loopback@$CNI_VERSION" "$m/plugins/meta/portmap@$CNI_VERSION"
}

build_pause() {
  cached_built "$BIN/pause/pause" && return
  log "pause (k8s.io/kubernetes@v$K8S_VERSION build/pause/linux/pause.c)"
  local src
  src=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')
  mkdir -p "$BIN/pause"
  gcc -Os -Wall -Werror -static -DVERSION="v$K8S_VERSION-kvoffload" -o "$BIN/pause/pause" "$src/build/pause/linux/pause.c"
  strip "$BIN/pause/pause"
}

start=$(date +%s)
build_pause; build_cni; build_containerd; build_kubelet
log "done in $(( $(date +%s) - start ))s; $(du -sh "$BIN" | cut -f1) in $BIN"
echo "$BIN"
