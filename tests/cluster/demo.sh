#!/usr/bin/env bash
# `make demo`: the local control plane with a real node (kubelet + containerd) beside the kwok GPU fleet,
# the operator image built here and loaded into the node, `helm install` of the chart: the operator runs
# in-cluster as the chart's Deployment on the real node (its ServiceAccount and RBAC, read-only root,
# liveness probe, leader-election Lease); the examples applied and each one's verdict awaited.
# `tests/cluster/demo.sh down` uninstalls nothing and stops the cluster (node included).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BIN=$ROOT/.venv/bin
STATE=${KVO_CLUSTER_DIR:-$ROOT/.cluster}
NS=kvoffload-demo
RELEASE_NS=kvoffload-system
export KUBECONFIG=$STATE/kubeconfig
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

if [ "${1:-}" = down ]; then
  exec "$BIN/python" -m kvtest down
fi
if [ "$(id -u)" != 0 ]; then
  echo "make demo starts a real kubelet and containerd (a bridge, cgroups, mounts): run it as root" >&2
  exit 1
fi

step "operator image (images/operator/Dockerfile, podman, offline)"
OPERATOR_IMAGE=$("$BIN/python" -m kvtest.images build operator | tail -1)
# The tag stays 0.1.0 when the code changes: the image id in a pod annotation rolls the Deployment.
IMAGE_ID=$("$BIN/python" -c 'from kvtest import images; print(images.image_id(images.OPERATOR)[:12])')
echo "$OPERATOR_IMAGE ($IMAGE_ID)"

step "local control plane on 127.0.0.1 + 198.18.0.1, the kwok fleet, the real node"
"$BIN/python" -m kvtest up --real-node
"$BIN/python" -m kvtest load-images operator
kubectl get nodes -L kvoffload.io/real-node,nvidia.com/gpu.product,kvoffload.io/nvme

step "helm install kvoffload (CRD, RBAC, the operator's Deployment on the real node)"
HELM=$("$BIN/python" -m kvtest bin-dir)/helm
"$HELM" upgrade --install kvoffload charts/kvoffload-operator --namespace "$RELEASE_NS" --create-namespace \
  --kubeconfig "$KUBECONFIG" -f tests/cluster/demo-values.yaml \
  --set image.repository="${OPERATOR_IMAGE%:*}" --set image.tag="${OPERATOR_IMAGE##*:}" \
  --set-string "operator.podAnnotations.kvoffload\.io/image-id=$IMAGE_ID" --wait --timeout 5m
kubectl wait --for=condition=Established crd/kvoffloadserves.kvoffload.io --timeout=60s
kubectl rollout status -n "$RELEASE_NS" deployment/kvoffload-kvoffload-operator --timeout=180s
kubectl get pods -n "$RELEASE_NS" -o wide
# The Lease names the pod that reconciles.
"$BIN/python" - "$RELEASE_NS" <<'PY'
import sys, kvtest
c, ns = kvtest.Cluster(), sys.argv[1]
def holder():
    return next((l["spec"].get("holderIdentity") for l in c.client.list("leases", ns) if l["spec"].get("holderIdentity")), None)
print("leader:", kvtest.wait_until(holder, timeout=120, message="the operator's leader-election Lease held"))
PY

step "examples/ applied"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
kubectl create secret generic hf-token -n "$NS" --from-literal=token=not-a-real-token --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f examples/

step "waiting for the operator's verdicts"
for f in examples/*.yaml; do
  name=$("$BIN/python" -c 'import sys,yaml; print(yaml.safe_load(open(sys.argv[1]))["metadata"]["name"])' "$f")
  if [[ $name == *as-seen-in-the-field* ]]; then
    kubectl wait -n "$NS" --for=condition=ConfigValid=false "kvs/$name" --timeout=180s
  else
    kubectl wait -n "$NS" --for=condition=Ready "kvs/$name" --timeout=300s
  fi
done

step "kubectl get kvs -A"
kubectl get kvs -A -o wide

step "children"
kubectl get statefulsets,services,configmaps,poddisruptionbudgets,pods -n "$NS" -l kvoffload.io/serve -o wide

step "computed budgets and conditions"
kubectl get kvs -n "$NS" -o json | "$BIN/python" tests/cluster/show_budgets.py
echo
echo "The operator runs in the cluster: kubectl logs -n $RELEASE_NS deploy/kvoffload-kvoffload-operator; KUBECONFIG=$KUBECONFIG."
echo "Stop everything with: make demo-down"
