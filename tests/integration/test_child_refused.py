"""What a tenant may not make the operator write, on the real API server: nothing is retried silently, nothing
another owner holds is taken over, and no wakeQuery reads another namespace.

- A ResourceQuota that allows no Services: the API server refuses the rendered Service (403 Forbidden, "exceeded
  quota"), which no parser can foresee. The resource says so (ConfigValid=False, ApplyRefused, naming the Service and
  the quota), Stalled tells kstatus readers, and once the quota is gone the operator's retry converges by itself.
- Names collide: `foo` renders the headless Service `foo-pods`, which a resource named `foo-pods` renders as its
  own Service; with routing on, `foo-router` likewise. The second comer is refused (NameConflict, naming the object and
  its owner) before anything of it is written, and the first one's objects keep their owner. A Service a person made
  (no owner) is not taken over either.
"""

from __future__ import annotations

import copy

import pytest

from kvoffload.api import crd
from kvtest import OperatorProcess, condition

pytestmark = pytest.mark.cluster

SPEC = {"replicas": 0, "model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxModelLen": 4096},
        "offload": {"cpu": {"size": "1Gi"}}}


def kvs(name: str, spec: dict | None = None) -> dict:
    return {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": name},
            "spec": copy.deepcopy(spec or SPEC)}


def refused(cluster, namespace: str, name: str, reason: str) -> dict:
    def cond():
        c = condition(cluster.client.get("kvs", name, namespace), "ConfigValid")
        return c if c.get("reason") == reason else None
    return cluster.wait_until(cond, timeout=90, message=f"{name}: ConfigValid reason {reason}")


def owner_uid(obj: dict) -> str | None:
    refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")]
    return refs[0]["uid"] if refs else None


def test_a_refused_apply_says_why_and_converges_once_the_cause_is_gone(cluster, operator, namespace):
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-services"},
             "spec": {"hard": {"services": "0"}}}
    cluster.client.create(quota, namespace)
    # Quota admission refuses everything with "status unknown" until the quota controller has computed its usage.
    cluster.wait_until(lambda: (cluster.client.get("resourcequotas", "no-services", namespace).get("status") or {})
                       .get("hard"), timeout=60, message="the quota's status")
    cluster.client.create(kvs("svc"), namespace)
    c = refused(cluster, namespace, "svc", "ApplyRefused")
    assert c["status"] == "False" and "Service svc" in c["message"] and "403" in c["message"], c
    assert "exceeded quota" in c["message"] and "no-services" in c["message"], c
    obj = cluster.client.get("kvs", "svc", namespace)
    assert condition(obj, "Stalled")["status"] == "True" and condition(obj, "Stalled")["reason"] == "ApplyRefused"
    assert condition(obj, "Ready")["reason"] == "ApplyRefused"
    assert cluster.client.get_or_none("services", "svc", namespace) is None

    cluster.client.delete("resourcequotas", "no-services", namespace)
    # No event reaches the operator when a quota goes: its own backoff (at most 30 s) retries.
    cluster.wait_until(lambda: condition(cluster.client.get("kvs", "svc", namespace),
                                         "ConfigValid")["status"] == "True",
                       timeout=120, message="ConfigValid=True after the quota is gone")
    assert cluster.client.get_or_none("services", "svc", namespace) is not None


def test_colliding_names_never_take_over_another_owners_objects(cluster, operator, namespace):
    routed = {**copy.deepcopy(SPEC), "routing": {}}
    cluster.client.create(kvs("foo", routed), namespace)
    foo = cluster.wait_until(lambda: (o := cluster.client.get("kvs", "foo", namespace)) and
                             condition(o, "ConfigValid")["status"] == "True" and o, timeout=90, message="foo valid")
    uid = foo["metadata"]["uid"]
    held = {n: cluster.client.get("services", n, namespace) for n in ("foo", "foo-pods", "foo-router")}
    assert all(s is not None and owner_uid(s) == uid for s in held.values()), held

    for name in ("foo-pods", "foo-router"):
        cluster.client.create(kvs(name), namespace)
        c = refused(cluster, namespace, name, "NameConflict")
        assert (f"Service {namespace}/{name} already exists and is held by KVOffloadServe foo (uid {uid})"
                in c["message"]), c
        # Nothing of the loser was written: no StatefulSet, no ConfigMap; foo's Service is still foo's, unchanged.
        assert cluster.client.get_or_none("statefulsets", name, namespace) is None
        assert cluster.client.get_or_none("configmaps", f"{name}-lmcache", namespace) is None
        svc = cluster.client.get("services", name, namespace)
        assert owner_uid(svc) == uid and svc["spec"]["selector"] == held[name]["spec"]["selector"], svc
    assert condition(cluster.client.get("kvs", "foo", namespace), "ConfigValid")["status"] == "True"

    # A Service somebody made by hand, without an owner, is not taken over either.
    cluster.client.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "mine"},
                           "spec": {"ports": [{"port": 80}], "selector": {"app": "mine"}}}, namespace)
    cluster.client.create(kvs("mine"), namespace)
    c = refused(cluster, namespace, "mine", "NameConflict")
    assert "no owner" in c["message"], c
    assert cluster.client.get("services", "mine", namespace)["spec"]["selector"] == {"app": "mine"}


def test_a_wake_query_that_reads_another_namespace_is_refused(cluster, crd_installed, namespace):
    """spec.autoscaling.wakeQuery runs against the admin's Prometheus: only selectors of its own namespace pass
    (api/promql.py). The operator runs with autoscaler keda; KEDA itself is not needed to refuse."""
    op = OperatorProcess(cluster.env, [namespace], {"resyncSeconds": 20, "autoscaler": "keda",
                                                    "prometheusAddress": "http://127.0.0.1:9"})
    try:
        scaled = {**copy.deepcopy(SPEC), "autoscaling": {"minReplicas": 0, "maxReplicas": 2,
                                                        "targets": {"waitingRequestsPerReplica": 4}}}
        for name, query in (("peek", 'sum(vllm:num_requests_waiting{namespace="kube-system"})'),
                            ("regex", 'sum(vllm:num_requests_waiting{namespace=~".+"})'),
                            ("unscoped", f'sum(q{{namespace="{namespace}"}}) or sum(vllm:num_requests_waiting)')):
            scaled["autoscaling"]["wakeQuery"] = query
            cluster.client.create(kvs(name, scaled), namespace)
            c = refused(cluster, namespace, name, "InvalidSpec")
            assert c["message"].startswith("spec.autoscaling.wakeQuery: selector ") and \
                f'must select namespace="{namespace}"' in c["message"], c
            assert cluster.client.get_or_none("statefulsets", name, namespace) is None
    finally:
        op.stop()
        print(op.output()[-3000:])
