"""`kubectl kvs why`: plain words from the status the operator writes (pure, no cluster)."""

from datetime import datetime, timezone

import pytest

from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings
from kvoffload.cli import kubectl, why
from kvoffload.controller import conditions, pipeline
from kvtest.specs import T0, body, pod, spec, sts

NOW = datetime(2026, 1, 1, 0, 5, tzinfo=timezone.utc)


def named_sts(**kw):
    s = sts(**kw)
    s["metadata"]["name"] = "svc"
    s["spec"] = {"replicas": 1}
    return s


def obj(status, generation=1, **meta):
    b = body(generation, status)
    b["metadata"].update(meta)
    return b


def live(generation=1, error=None, observed=None, previous=None):
    desired = None if error else pipeline.desired("svc", "ns", "u", spec(), Settings())
    return obj(conditions.status(body(generation, previous), desired, error, observed
                                 or conditions.Observed(sts(), [pod()]), T0),
               generation)


def test_ready():
    text = why.explain(live(), named_sts(), [pod()], [], NOW)
    assert "Ready: 1/1 replicas ready and up to date." in text
    assert "Helm --wait / Flux (kstatus) read: Current" in text
    assert "cpu 327,680 tokens" in text and "Pod memory request = limit:" in text
    assert "(since 5m ago)" in text


def test_refused_names_the_field_and_what_to_do():
    err = ConfigError("spec.offload.disk.path", "'/etc' is outside the allowed roots /mnt/nvme")
    text = why.explain(live(3, err), None, [], [
        {"type": "Warning", "reason": "SpecRefused", "message": str(err), "lastTimestamp": "2026-01-01T00:04:00Z",
         "involvedObject": {"kind": "KVOffloadServe", "name": "svc"}}], NOW)
    assert "Refused: the operator cannot act on this spec." in text and "spec.offload.disk.path" in text
    assert "Fix the field named above and apply again" in text  # the hint for InvalidSpec, written out
    assert "read: Failed (InvalidSpec)" in text and "No StatefulSet" in text
    assert "60s ago  Warning  SpecRefused: KVOffloadServe svc:" in text


def test_unschedulable_and_rolling_out_say_what_next():
    stuck = live(observed=conditions.Observed(sts(ready=0), [pod(scheduled=False, message="0/4 nodes: "
                                                                                          "Insufficient memory")]))
    text = why.explain(stuck, named_sts(ready=0), [pod(scheduled=False, message="0/4 nodes: Insufficient memory")], [],
                       NOW)
    assert "Not ready yet (Unschedulable)" in text and "read: InProgress" in text
    assert "No node can take the pod: add nodes with that capacity" in text
    assert "unschedulable: 0/4 nodes: Insufficient memory" in text


@pytest.mark.parametrize("o,expected", [
    (obj({}), "No status from the operator yet"),
    (obj({"observedGeneration": 0}), "No status from the operator yet"),
    (obj({"observedGeneration": 1, "conditions": [{"type": "Ready", "status": "True", "observedGeneration": 1}]}, 2),
     "has not looked at generation 2 yet"),
    (obj({}, deletionTimestamp="2026-01-01T00:00:00Z", finalizers=["example.com/hold"]),
     "finalizers holding it: example.com/hold"),
])
def test_gaps(o, expected):
    assert expected in why.explain(o, None, [], [], NOW)


@pytest.mark.parametrize("o,ks", [
    (obj({}), "Current"),  # what kstatus says for no status at all: why the CRD defaults observedGeneration to 0
    (obj({"observedGeneration": 0}), "InProgress"),
    (obj({}, deletionTimestamp="2026-01-01T00:00:00Z"), "Terminating"),
])
def test_kstatus_rules(o, ks):
    assert why.kstatus(o)[0] == ks


def test_plugin_refuses_unknown_commands(capsys):
    assert kubectl.main(["bogus"]) == 2
    assert "allowed: plan, render, why" in capsys.readouterr().err


def test_per_node_says_the_servers_what_they_hold_and_who_hits():
    """spec.offload.server PerNode: each node's server, ready or not, idle ones, nodes still without one, the L1 and
    L2 sizes from the Budget, and that a prefix there is a hit for every replica on that node."""
    from kvoffload.rendering import render, shared_cache

    s = spec(offload__backend="lmcache-server", offload__server="PerNode",
             offload__disk={"path": "/mnt/nvme/lmcache", "size": "200Gi"})
    settings = Settings(shared_memory_root="/run/kvoffload-shm", allowed_disk_roots=("/mnt/nvme",))
    desired = pipeline.desired("svc", "ns", "u", s, settings, nodes=(shared_cache.Node("gpu-node-0"),))
    o = obj(conditions.status(body(1), desired, None, conditions.Observed(sts(), [pod()]), T0))
    o["spec"] = {"offload": {"backend": "lmcache-server", "server": "PerNode"}}
    server = next(c for c in desired.children if c["kind"] == "Deployment" and c["metadata"]["name"] != "svc-router")
    ready = {**server, "status": {"readyReplicas": 1}}
    idle = {"metadata": {"name": "svc-cache-1", "annotations": {
        shared_cache.NODE_ANNOTATION: "gpu-node-1", shared_cache.IDLE_ANNOTATION: "2026-01-01T00:01:00Z"}}}
    pods = [pod("svc-0", "gpu-node-0"), pod("svc-1", "gpu-node-0"), pod("svc-2", "gpu-node-2")]
    text = why.explain(o, named_sts(), pods, [], NOW, [ready, idle])
    assert "Shared cache (spec.offload.server PerNode):" in text
    assert "L1 (memory) 40Gi (327,680 tokens); L2 (the node's disk) 200Gi (1,638,400 tokens), once per node" in text
    assert "a prefix in a node's server is a hit for every replica on that node" in text
    assert f"node gpu-node-0: server {render.names('svc')['statefulset']}-cache-" in text
    assert "ready; replicas there: svc-0, svc-1" in text
    assert "node gpu-node-1: server svc-cache-1 NOT ready; replicas there: none; no replica since " \
           "2026-01-01T00:01:00Z, kept for the grace period" in text
    assert "nodes with replicas and no server yet: gpu-node-2" in text
    assert "Shared cache" not in why.explain(live(), named_sts(), [pod()], [], NOW)  # Sidecar: nothing to say
