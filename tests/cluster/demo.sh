#!/usr/bin/env bash
# `make demo`: the local control plane, the chart installed, the operator running as a local
# process (kwok nodes run no containers, so an in-cluster operator pod would never start),
# the examples applied and reconciled, their status and budgets shown.
# `tests/cluster/demo.sh down` stops the operator and the cluster.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BIN=$ROOT/.venv/bin
STATE=$ROOT/.cluster
NS=kvoffload-demo
PIDFILE=$STATE/demo-operator.pid
export KUBECONFIG=$STATE/kubeconfig
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

stop_operator() {
  if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    kill "$(cat "$PIDFILE")"; wait "$(cat "$PIDFILE")" 2>/dev/null || true
  fi
  rm -f "$PIDFILE"
}

if [ "${1:-}" = down ]; then
  stop_operator
  "$BIN/python" -m kvtest down
  exit 0
fi

step "local control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok) on 127.0.0.1"
"$BIN/python" -m kvtest up
HELM=$("$BIN/python" -m kvtest bin-dir)/helm
kubectl get nodes -L nvidia.com/gpu.product,kvoffload.io/nvme

step "helm install kvoffload (CRDs, RBAC, operator settings)"
"$HELM" upgrade --install kvoffload charts/kvoffload-operator --namespace kvoffload-system --create-namespace \
  --kubeconfig "$KUBECONFIG"
kubectl wait --for=condition=Established crd/kvoffloadserves.kvoffload.io --timeout=60s

step "operator: kvoffload run (local process, same settings as the chart), log in .cluster/logs/demo-operator.log"
stop_operator
kubectl get configmap -n kvoffload-system -l app.kubernetes.io/component=operator -o jsonpath='{.items[0].data.config\.yaml}' \
  > "$STATE/demo-operator.yaml" 2>/dev/null || echo "{}" > "$STATE/demo-operator.yaml"
mkdir -p "$STATE/logs"
nohup "$BIN/kvoffload" run --all-namespaces --operator-config "$STATE/demo-operator.yaml" \
  --liveness http://127.0.0.1:18080/healthz > "$STATE/logs/demo-operator.log" 2>&1 &
echo $! > "$PIDFILE"

step "examples/ applied"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
kubectl create secret generic hf-token -n "$NS" --from-literal=token=not-a-real-token --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f examples/

step "waiting for the operator's verdicts"
for f in examples/*.yaml; do
  name=$("$BIN/python" -c 'import sys,yaml; print(yaml.safe_load(open(sys.argv[1]))["metadata"]["name"])' "$f")
  if [[ $name == *as-seen-in-the-field* ]]; then
    kubectl wait -n "$NS" --for=condition=ConfigValid=false "kvs/$name" --timeout=120s
  else
    kubectl wait -n "$NS" --for=condition=Ready "kvs/$name" --timeout=180s
  fi
done

step "kubectl get kvs -A"
kubectl get kvs -A
kubectl get kvs -A -o wide

step "children"
kubectl get statefulsets,services,configmaps,poddisruptionbudgets,pods -n "$NS" -l kvoffload.io/serve -o wide

step "computed budgets and conditions"
kubectl get kvs -n "$NS" -o json | "$BIN/python" tests/cluster/show_budgets.py
echo
echo "The operator keeps running (pid $(cat "$PIDFILE")); KUBECONFIG=$KUBECONFIG. Stop everything with: make demo-down"
