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
