# Sourced by build.sh (control plane) and build-node.sh (kubelet, kube-proxy): their shared settings and
# one recipe for a Go module that builds k8s.io/kubernetes commands at $K8S_VERSION.
K8S_VERSION="${K8S_VERSION:-1.37.2}"
CACHE="${KVO_CACHE:-$HOME/.cache/kvoffload}"
export GOFLAGS="${GOFLAGS:--buildvcs=false}" CGO_ENABLED=0
log() { echo "[$(basename "$0" .sh) $(date +%T)] $*" >&2; }

# k8s_module DIR PKG...: a module in DIR requiring k8s.io/kubernetes with its staging modules
# pinned, tidied, with a tools.go importing PKG... (k8s.io/kubernetes/cmd/...).
k8s_module() {
  local d=$1; shift
  rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init example.invalid/k8sbin >/dev/null 2>&1
  go mod edit -go=1.26 -require="k8s.io/kubernetes@v$K8S_VERSION"
  local kgomod
  kgomod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
  # Every staging module k8s.io/<m> => ./staging/... becomes k8s.io/<m>@v0.<minor>.<patch>.
  sed -n 's|^[[:space:]]*\(k8s\.io/[^ ]*\) => \./staging/src/.*|\1|p' "$kgomod" |
    while read -r m; do go mod edit -replace="$m=$m@v0.${K8S_VERSION#1.}"; done
  grep -E '^godebug' "$kgomod" >> go.mod || true
  { printf '//go:build tools\npackage tools\nimport (\n'; printf '\t_ "%s"\n' "$@"; printf ')\n'; } > tools.go
  go mod tidy
}

# k8s_build OUTDIR PKG...: build the commands with the version stamped in (what `kubectl version` shows).
k8s_build() {
  local out=$1; shift
  local minor; minor=$(echo "$K8S_VERSION" | cut -d. -f2)
  go build -p 2 -trimpath -o "$out/" -ldflags "-s -w \
    -X k8s.io/component-base/version.gitVersion=v$K8S_VERSION \
    -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor \
    -X k8s.io/component-base/version.gitTreeState=clean \
    -X k8s.io/client-go/pkg/version.gitVersion=v$K8S_VERSION" "$@"
}
