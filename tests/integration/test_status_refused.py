"""Nothing swallowed: a status write the API server refuses (422 Invalid) is an error in the log, a
Warning Event on the resource and a metric, and the operator writes the status once it is accepted.

The refusal is the real API server's: the test adds a CEL rule to the installed CRD's status schema
(as a CRD upgrade or downgrade that no longer matches the operator would), runs the real operator,
then takes the rule out again.

While every status write is refused, the resource holds exactly the CRD's status default, `{observedGeneration: 0}`,
on every read path (the create answer, GET, LIST, a watch from the start): with no first-sight write, that default
is all that makes kstatus (Helm --wait, Flux) and Argo CD read it as in progress (tests/unit/test_first_status.py).
"""

from __future__ import annotations

import copy
import urllib.request

import pytest

from kvoffload.api import crd
from kvtest import OperatorProcess, condition
from kvtest.procs import free_ports

pytestmark = pytest.mark.cluster

SPEC = {"replicas": 0, "model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxModelLen": 4096},
        "offload": {"cpu": {"size": "1Gi"}}}
RULE = {"rule": "!has(self.summary)", "message": "status.summary is refused by this test's CRD"}
STATUS_RULES = "/spec/versions/0/schema/openAPIV3Schema/properties/status/x-kubernetes-validations"
DEFAULT_STATUS = {"observedGeneration": 0}  # the CRD's status default (api/crd.status_schema), written out


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


def test_a_refused_status_is_an_error_an_event_and_a_metric(cluster, crd_installed, namespace):
    crd_name = f"{crd.PLURAL}.{crd.GROUP}"
    (port,) = free_ports(1)
    cluster.client.patch("crd", crd_name, [{"op": "add", "path": STATUS_RULES, "value": [RULE]}], type="json")
    op = OperatorProcess(cluster.env, [namespace], extra_args=["--metrics-listen", f"127.0.0.1:{port}"])
    try:
        # The rule is live once a status with a summary is refused straight from the API server.
        created = cluster.client.create({"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND,
                                         "metadata": {"name": "svc"}, "spec": copy.deepcopy(SPEC)}, namespace)
        assert created.get("status") == DEFAULT_STATUS, created.get("status")  # the create answer is defaulted too

        def refused_event():
            uid = cluster.client.get("kvs", "svc", namespace)["metadata"]["uid"]
            return [e for e in cluster.client.list("events", namespace)
                    if e["involvedObject"].get("uid") == uid and e["reason"] == "StatusRefused"]

        (event, *_) = cluster.wait_until(refused_event, timeout=90, message="a StatusRefused Event")
        assert event["type"] == "Warning" and RULE["message"] in event["message"], event
        assert event["source"]["component"] == "kvoffload-operator"
        log = op.output()
        assert f" ERROR kvoffload.reconcile: status of {namespace}/svc refused by the API server" in log, log[-3000:]
        assert RULE["message"] in log
        assert metric(port, "kvoffload_operator_status_writes_refused_total") >= 1
        assert metric(port, 'kvoffload_operator_reconciles_total{outcome="status-refused"}') >= 1
        # Nothing the operator wrote is stored: every read path shows the CRD's default and only that.
        (listed,) = cluster.client.list("kvs", namespace)
        (watched,) = [o for t, o in cluster.client.watch("kvs", namespace, resource_version="0", timeout=1)
                      if t == "ADDED"]
        reads = {"GET": cluster.client.get("kvs", "svc", namespace), "LIST": listed, "WATCH": watched}
        assert {k: o.get("status") for k, o in reads.items()} == dict.fromkeys(reads, DEFAULT_STATUS), reads
    finally:
        cluster.client.patch("crd", crd_name, [{"op": "remove", "path": STATUS_RULES}], type="json")
    try:
        # Accepted again: the retry (backoff) writes the full status.
        obj = cluster.wait_until(
            lambda: (o := cluster.client.get("kvs", "svc", namespace)).get("status", {}).get("summary") and o,
            timeout=90, message="the full status once the CRD accepts it")
        assert obj["status"]["observedGeneration"] == 1 and condition(obj, "ConfigValid")["status"] == "True"
    finally:
        op.stop()
        print(op.output()[-3000:])
