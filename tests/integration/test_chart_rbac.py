"""The operator runs under exactly the chart's RBAC, and nothing more.

The chart's ServiceAccount + (Cluster)Role + binding are rendered with `helm template` into a
test namespace; the operator runs as a local subprocess (`python -m kvoffload.cli run`) with a
kubeconfig holding only that ServiceAccount's token (a TokenRequest), and its settings
file is the chart's own operator ConfigMap. It must bring examples/cpu-tier-qwen25-7b.yaml to
ConfigValid=True with a StatefulSet, without one 403, and let the resource be deleted.
"""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import yaml

from kvoffload.api import crd
from kvtest import OperatorProcess, condition

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvoffload-operator"
EXAMPLE = ROOT / "examples" / "cpu-tier-qwen25-7b.yaml"
# The operator must be serving well within this (it reconciles in about a second once it runs).
START_BUDGET_S = 30
# kopf observes CRDs (and, given namespaces, lists them) unless `settings.scanning.disabled` is set;
# without cluster-wide list/watch on both it retries each 403 for about a minute before it falls
# back, and in namespaced mode serves nothing until then. The chart grants neither (least
# privilege, and no ClusterRole at all in namespaced mode): the operator has to turn scanning off.
SCANNING_HINT = ("kopf's CRD/namespace observation was refused: set `settings.scanning.disabled = True` "
                 "in the operator's kopf start-up (the chart passes exact namespaces and installs the CRD first)")


@pytest.mark.parametrize("mode", ["cluster-role", "namespaced-role"])
def test_operator_runs_under_exactly_the_charts_rbac(cluster, namespace, crd_installed, tmp_path, mode):
    release = f"rbac-{uuid.uuid4().hex[:6]}"
    sa = f"{release}-kvoffload-operator"
    values = ["--set", "crds.enabled=false"]
    if mode == "namespaced-role":
        values += ["--set", f"watchNamespaces={{{namespace}}}"]
    rendered = cluster.helm("template", release, CHART, "--namespace", namespace, *values,
                            "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml",
                            "--show-only", "templates/configmap.yaml").stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == (["ClusterRole", "ClusterRoleBinding", "ConfigMap", "ServiceAccount"] if mode == "cluster-role"
                     else ["ConfigMap", "Role", "RoleBinding", "ServiceAccount"])
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    rbac = [d for d in docs if d["kind"] != "ConfigMap"]
    client = cluster.client

    op = None
    log_path = tmp_path / "operator.log"
    cr_name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    try:
        for d in rbac:
            client.apply(d)
        token = client.create_token(sa, namespace, seconds=3600)  # what `kubectl create token --duration=1h` asks for
        kubeconfig = cluster.token_kubeconfig(tmp_path / "operator.kubeconfig", token, namespace, "operator")
        # The token is the chart's identity: what the operator needs, and no Secrets.
        as_sa = client.as_token(token)
        assert as_sa.can_i("patch", "statefulsets.apps", namespace)
        assert as_sa.can_i("patch", f"{crd.PLURAL}.{crd.GROUP}", namespace, subresource="status")
        assert not as_sa.can_i("get", "secrets", namespace)
        # Its caches: list + watch of everything a reconcile reads, and no GET of a KVOffloadServe (it reads the cache).
        for resource in (f"{crd.PLURAL}.{crd.GROUP}", "pods", "configmaps", "services", "statefulsets.apps",
                         "poddisruptionbudgets.policy", "networkpolicies.networking.k8s.io"):
            assert as_sa.can_i("list", resource, namespace), resource
            assert as_sa.can_i("watch", resource, namespace), resource
        assert not as_sa.can_i("get", f"{crd.PLURAL}.{crd.GROUP}", namespace)
        assert not as_sa.can_i("patch", f"{crd.PLURAL}.{crd.GROUP}", namespace)
        assert not as_sa.can_i("create", "pods", namespace)
        if mode == "namespaced-role":
            assert not as_sa.can_i("list", "configmaps", "default")

        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(kubeconfig)
        # The chart's own settings file; run outside the repository, as in the chart's pod.
        op = OperatorProcess(env, [namespace], cm["data"]["config.yaml"], log_path=log_path, cwd=tmp_path)

        serve = yaml.safe_load(EXAMPLE.read_text())
        serve["metadata"]["namespace"] = namespace
        client.apply(serve)
        started = time.monotonic()

        def reconciled():
            assert op.proc.poll() is None, f"operator exited {op.proc.returncode}:\n{op.output()[-4000:]}"
            obj = client.get(f"{crd.PLURAL}.{crd.GROUP}", cr_name, namespace)
            ok = (condition(obj, "ConfigValid") or {}).get("status") == "True"
            sts = client.exists("statefulset", cr_name, namespace)
            return obj if ok and sts else None

        try:
            obj = cluster.wait_until(reconciled, timeout=90, message="ConfigValid=True and the StatefulSet")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n--- operator log ---\n{log_path.read_text()[-6000:]}") from None
        took = time.monotonic() - started
        assert obj["status"].get("observedGeneration") == obj["metadata"]["generation"] or \
            condition(obj, "ConfigValid").get("observedGeneration") == obj["metadata"]["generation"]
        # Its other children exist too (applied under the same identity).
        for kind, name in (("configmap", f"{cr_name}-lmcache"), ("service", cr_name), ("poddisruptionbudget", cr_name)):
            assert client.exists(kind, name, namespace), f"{kind}/{name}"

        # A user can delete it while the operator runs: no finalizer of ours holds it.
        client.delete(f"{crd.PLURAL}.{crd.GROUP}", cr_name, namespace, wait=True, timeout=60)

        log = log_path.read_text()
        denied = [line[:400] for line in log.splitlines() if "403" in line or "orbidden" in line]
        hint = (SCANNING_HINT if any("customresourcedefinitions" in d or "/api/v1/namespaces " in d for d in denied)
                else "")
        assert not denied, (f"the operator was denied what the chart's RBAC does not grant. {hint}\n"
                            + "\n".join(denied[:6]))
        assert took < START_BUDGET_S, f"ConfigValid took {took:.0f}s under the chart's RBAC"
    finally:
        if op is not None:
            op.stop()
        client.delete(f"{crd.PLURAL}.{crd.GROUP}", cr_name, namespace, missing_ok=True)
        for d in rbac:
            client.delete(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace"), missing_ok=True)
