"""observe: conditions are a pure function of what was read; the clock is injected."""

from datetime import datetime, timezone

from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings
from kvoffload.controller import conditions, pipeline

from .helpers import spec

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
T1 = datetime(2026, 1, 2, tzinfo=timezone.utc)


def body(generation=1, status=None):
    return {"metadata": {"name": "svc", "namespace": "ns", "generation": generation}, "status": status or {}}


def desired(**patch):
    return pipeline.desired("svc", "ns", "u", spec(**patch), Settings())


def sts(replicas=1, ready=1, updated=1, gen=1, observed=1, current="r1", update="r1"):
    return {"metadata": {"generation": gen}, "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
                                                        "observedGeneration": observed, "currentRevision": current,
                                                        "updateRevision": update}}


def pod(name="svc-0", node="gpu-node-0", scheduled=True, message="", initialized=True):
    conds = [{"type": "PodScheduled", "status": "True" if scheduled else "False",
              **({} if scheduled else {"reason": "Unschedulable", "message": message})},
             {"type": "Initialized", "status": "True" if initialized else "False"}]
    return {"metadata": {"name": name}, "spec": {"nodeName": node} if scheduled else {}, "status": {"conditions": conds}}


def by_type(status):
    return {c["type"]: c for c in status["conditions"]}


def test_all_ready():
    st = conditions.status(body(), desired(), None, conditions.Observed(sts(), [pod()]), T0)
    c = by_type(st)
    assert [x["type"] for x in st["conditions"]] == list(conditions.TYPES)
    assert c["Ready"]["status"] == "True" and c["Scheduled"]["status"] == "True" and c["ConfigValid"]["status"] == "True"
    assert c["DiskTierReady"]["status"] == "True" and "/mnt/nvme/lmcache" in c["DiskTierReady"]["message"]
    assert st["observedGeneration"] == 1 and st["readyReplicas"] == 1
    assert st["selector"] == "kvoffload.io/serve=svc"
    assert st["summary"]["memory"] and st["budget"]["kvBytesPerToken"] == 131072
    assert all(x["observedGeneration"] == 1 and x["reason"] for x in st["conditions"])


def test_unschedulable_carries_the_schedulers_message():
    msg = "0/4 nodes are available: 4 Insufficient memory."
    st = conditions.status(body(), desired(), None,
                           conditions.Observed(sts(ready=0, updated=1), [pod(scheduled=False, message=msg)]), T0)
    c = by_type(st)
    assert c["Scheduled"]["status"] == "False" and c["Scheduled"]["reason"] == "Unschedulable"
    assert msg in c["Scheduled"]["message"]
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "Unschedulable"
    assert st["observedGeneration"] == 0  # never rolled out


def test_last_transition_time_moves_only_with_status():
    first = conditions.status(body(), desired(), None, conditions.Observed(sts(ready=0), [pod()]), T0)
    same = conditions.status(body(status=first), desired(), None, conditions.Observed(sts(ready=0), [pod()]), T1)
    assert by_type(same)["Ready"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    flipped = conditions.status(body(status=same), desired(), None, conditions.Observed(sts(), [pod()]), T1)
    assert by_type(flipped)["Ready"]["lastTransitionTime"] == "2026-01-02T00:00:00Z"
    assert by_type(flipped)["ConfigValid"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"


def test_observed_generation_lags_until_rolled_out():
    done = conditions.status(body(1), desired(), None, conditions.Observed(sts(), [pod()]), T0)
    rolling = conditions.status(body(2, done), desired(), None,
                                conditions.Observed(sts(gen=2, observed=2, updated=0, update="r2"), [pod()]), T1)
    assert rolling["observedGeneration"] == 1
    assert by_type(rolling)["Ready"]["reason"] == "RollingOut"
    assert by_type(rolling)["Ready"]["observedGeneration"] == 2
    rolled = conditions.status(body(2, rolling), desired(), None,
                               conditions.Observed(sts(gen=2, observed=2, current="r2", update="r2"), [pod()]), T1)
    assert rolled["observedGeneration"] == 2


def test_invalid_spec():
    err = ConfigError("spec.offload.disk.path", "'/etc' is outside the allowed roots")
    st = conditions.status(body(3), None, err, conditions.Observed(None, []), T0)
    c = by_type(st)
    assert c["ConfigValid"]["status"] == "False" and c["ConfigValid"]["reason"] == "InvalidSpec"
    assert "spec.offload.disk.path" in c["ConfigValid"]["message"] and c["Ready"]["status"] == "False"
    assert st["observedGeneration"] == 3


def test_no_disk_tier():
    c = by_type(conditions.status(body(), desired(offload__disk=None), None, conditions.Observed(sts(), [pod()]), T0))
    assert c["DiskTierReady"]["reason"] == "NotConfigured"


def test_status_is_stable_for_the_same_inputs():
    a = conditions.status(body(), desired(), None, conditions.Observed(sts(), [pod()]), T0)
    b = conditions.status(body(status=a), desired(), None, conditions.Observed(sts(), [pod()]), T1)
    assert a == b  # so a no-op reconcile writes nothing


def ready_pod():
    p = pod()
    p["status"]["conditions"].append({"type": "Ready", "status": "True"})
    return p


def offload(probes, **patch):
    obs = conditions.Observed(sts(), [ready_pod()], probes)
    return by_type(conditions.status(body(), desired(**patch), None, obs, T0))["OffloadActive"]


def test_offload_active_needs_proof_from_every_exporter():
    assert offload({"svc-0": 1.0})["status"] == "True"
    assert offload({"svc-0": 1.0, "svc-1": "refused"})["reason"] == "LMCacheActive"
    idle = offload({"svc-0": 0.0, "svc-1": 1.0})
    assert idle["status"] == "False" and idle["reason"] == "NoLMCacheActivity" and "svc-0" in idle["message"]
    gone = offload({"svc-0": "http://127.16.0.2:9400/metrics: connection refused"})
    assert gone["status"] == "Unknown" and "connection refused" in gone["message"]
    assert offload(None)["reason"] == "ProbesDisabled"
    assert offload({"svc-0": 1.0}, metrics={"enabled": False})["reason"] == "MetricsDisabled"
