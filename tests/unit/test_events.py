"""Events: derived from condition transitions (pure), capped by one token bucket per operator."""

from datetime import datetime, timezone

from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings
from kvoffload.controller import conditions, events, pipeline
from kvtest.specs import T0, T1, body, pod, ready_pod, spec, sts

OWNER = {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe",
         "metadata": {"name": "svc", "namespace": "ns", "uid": "u-1", "resourceVersion": "7"}}


def status(previous=None, generation=1, error=None, obs=None, **patch):
    desired = None if error else pipeline.desired("svc", "ns", "u", spec(**patch), Settings())
    obs = obs or conditions.Observed(sts(), [ready_pod()], {"svc-0": 1.0})
    return conditions.status(body(generation, previous), desired, error, obs, T0)


def reasons(evs):
    return [(e.type, e.reason) for e in evs]


def test_a_no_op_reconcile_emits_nothing():
    st = status()
    assert events.transitions(st["conditions"], status(st)["conditions"]) == []


def test_spec_refused_once_then_accepted():
    err = ConfigError("spec.offload.disk.path", "'/etc' is outside the allowed roots /mnt/nvme")
    first = {"observedGeneration": 0}  # as created: the CRD's status default, no conditions
    bad = status(first, error=err)
    evs = events.transitions(first.get("conditions"), bad["conditions"])
    assert reasons(evs) == [("Warning", "SpecRefused")]
    assert "spec.offload.disk.path" in evs[0].message and "/mnt/nvme" in evs[0].message
    assert events.transitions(bad["conditions"], status(bad, error=err)["conditions"]) == []  # still refused: told once
    other = ConfigError("spec.engine.maxModelLen", "must be at most 131072")
    assert (reasons(events.transitions(bad["conditions"], status(bad, error=other)["conditions"]))
            == [("Warning", "SpecRefused")])
    good = status(bad, generation=2)
    assert reasons(events.transitions(bad["conditions"], good["conditions"], ["StatefulSet svc"])) == [
        ("Normal", "SpecAccepted"), ("Normal", "Applied"), ("Normal", "Scheduled"), ("Normal", "Ready"),
        ("Normal", "OffloadProven")]


def test_first_rollout_story():
    first = {"observedGeneration": 0}  # as created: the CRD's status default, no conditions
    pending = status(first, obs=conditions.Observed(sts(ready=0), [pod()]))
    evs = events.transitions(first.get("conditions"), pending["conditions"],
                             ["ConfigMap svc-lmcache", "StatefulSet svc"])
    assert reasons(evs) == [("Normal", "Applied"), ("Normal", "Scheduled")]
    assert evs[0].message == "applied ConfigMap svc-lmcache, StatefulSet svc"
    stuck = status(first, obs=conditions.Observed(sts(ready=0), [pod(scheduled=False, message="0/4 nodes: "
                                                                                              "Insufficient memory")]))
    evs = events.transitions(first.get("conditions"), stuck["conditions"])
    assert reasons(evs) == [("Warning", "Unschedulable")] and "Insufficient memory" in evs[0].message


def test_engine_version_mismatch_event():
    before = [{"type": "EngineVerified", "status": "True", "reason": "EngineVersionsMatch"}]
    after = [{"type": "EngineVerified", "status": "False", "reason": "EngineVersionMismatch",
              "message": "image runs vLLM 0.26"}]
    assert reasons(events.transitions(before, after)) == [("Warning", "EngineVersionMismatch")]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_token_bucket_caps_a_thousand_resources():
    clock = Clock()
    posted = []
    rec = events.Recorder(lambda ns, b: posted.append(b), events.TokenBucket(rate=5, burst=50, clock=clock),
                          clock=lambda: datetime(2026, 1, 1, tzinfo=timezone.utc))
    for i in range(1000):  # 1,000 resources refused at once, 10 s of wall time
        clock.t = i / 100
        rec.record(OWNER, [events.Event("Warning", "SpecRefused", "x")])
    assert len(posted) == rec.sent <= 50 + 5 * 10 + 1
    assert rec.sent + rec.dropped == 1000 and rec.dropped >= 900
    clock.t += 2  # the bucket refills
    rec.record(OWNER, [events.Event("Normal", "Ready", "y")] * 20)
    assert rec.sent - len(posted) == 0 and posted[-1]["reason"] == "Ready"
    assert 10 <= sum(1 for b in posted if b["reason"] == "Ready") <= 11


def test_event_body_is_a_core_v1_event_on_the_resource():
    b = events.event_body(OWNER, events.Event("Warning", "SpecRefused", "m" * 5000), T1)
    assert b["apiVersion"] == "v1" and b["kind"] == "Event" and b["metadata"]["generateName"] == "svc."
    assert b["involvedObject"] == {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe", "name": "svc",
                                   "namespace": "ns", "uid": "u-1", "resourceVersion": "7"}
    assert len(b["message"]) == events.MAX_MESSAGE and b["firstTimestamp"] == "2026-01-02T00:00:00Z"


def test_a_failed_post_never_fails_the_reconcile():
    def refuse(ns, b):
        raise RuntimeError("403 forbidden")
    rec = events.Recorder(refuse)
    rec.record(OWNER, [events.Event("Normal", "Ready", "")])
    assert rec.sent == 0


def test_the_event_rate_is_the_admins_setting():
    """eventsPerSecond / eventBurst shape the operator's one bucket; 0 per second turns Events off."""
    from kvoffload.api.settings import Settings

    posted: list[dict] = []
    quiet = events.recorder(Settings(events_per_second=0), lambda ns, b: posted.append(b))
    quiet.record(OWNER, [events.Event("Normal", "Ready", "y")] * 10)
    assert posted == [] and quiet.dropped == 10
    small = events.recorder(Settings(events_per_second=0.001, event_burst=3), lambda ns, b: posted.append(b))
    small.record(OWNER, [events.Event("Normal", "Ready", "y")] * 10)
    assert len(posted) == small.sent == 3 and small.dropped == 7


def test_event_settings_are_checked_with_the_key_named():
    import pytest

    from kvoffload.api import settings
    from kvoffload.api.errors import ConfigError

    assert settings.from_dict({"eventsPerSecond": 0.5, "eventBurst": 5}).events_per_second == 0.5
    for bad in ({"eventsPerSecond": -1}, {"eventsPerSecond": "fast"}, {"eventsPerSecond": True}, {"eventBurst": 0},
                {"eventBurst": 2.5}):
        with pytest.raises(ConfigError) as exc:
            settings.from_dict(bad)
        assert next(iter(bad)) in str(exc.value) and ">=" in str(exc.value)
