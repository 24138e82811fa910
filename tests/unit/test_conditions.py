"""observe: conditions are a pure function of what was read; the clock is injected."""


import pytest

from kvoffload.api import crd
from kvoffload.api.conditions import TYPES
from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings
from kvoffload.controller import conditions, pipeline, reconcile
from kvoffload.controller.kube import ApiError
from kvoffload.controller.probe import Reading
from kvoffload.engine import images
from kvtest.specs import T0, T1, body, pod, ready_pod, spec, sts


def desired(**patch):
    return pipeline.desired("svc", "ns", "u", spec(**patch), Settings())


def by_type(status):
    return {c["type"]: c for c in status["conditions"]}


def test_all_ready():
    st = conditions.status(body(), desired(), None, conditions.Observed(sts(), [pod()]), T0)
    c = by_type(st)
    assert [x["type"] for x in st["conditions"]] == list(TYPES)
    assert (c["Ready"]["status"] == "True" and c["Scheduled"]["status"] == "True"
            and c["ConfigValid"]["status"] == "True")
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



@pytest.mark.parametrize("reason", ["ApplyRefused", "NameConflict"])
def test_a_child_that_cannot_be_written_stalls_with_its_own_reason(reason):
    child = {"kind": "Service", "metadata": {"name": "foo-pods"}}
    err = reconcile.Refused(reason, child, "held by KVOffloadServe foo (uid 1)")
    c = by_type(conditions.status(body(2), None, err, conditions.Observed(None, []), T0))
    assert c["ConfigValid"] == {**c["ConfigValid"], "status": "False", "reason": reason,
                                "message": "Service foo-pods: held by KVOffloadServe foo (uid 1)"}
    assert c["Stalled"]["status"] == "True" and c["Stalled"]["reason"] == reason  # kstatus: Failed, not InProgress
    assert c["Reconciling"]["status"] == "False" and c["Ready"]["reason"] == reason
    assert c["Scheduled"]["message"] == "not evaluated while a child cannot be written"


def test_an_invalid_pod_template_stays_invalid_spec_and_anything_else_is_apply_refused():
    child = {"kind": "StatefulSet", "metadata": {"name": "svc"}}
    invalid = reconcile._refused(child, ApiError(422, "Unprocessable Entity", '{"message": "spec.tolerations: bad"}'))
    assert type(invalid) is ConfigError and invalid.field == "spec" and "spec.tolerations: bad" in invalid.message
    for code in (403, 409, 500, 503):
        err = reconcile._refused(child, ApiError(code, "X", '{"message": "no"}'))
        assert isinstance(err, reconcile.Refused) and err.reason == "ApplyRefused", code
        assert str(err) == f"StatefulSet svc: the API server refused to apply it ({code} X): no"

def test_no_disk_tier():
    c = by_type(conditions.status(body(), desired(offload__disk=None), None, conditions.Observed(sts(), [pod()]), T0))
    assert c["DiskTierReady"]["reason"] == "NotConfigured"


def test_status_is_stable_for_the_same_inputs():
    a = conditions.status(body(), desired(), None, conditions.Observed(sts(), [pod()]), T0)
    b = conditions.status(body(status=a), desired(), None, conditions.Observed(sts(), [pod()]), T1)
    assert a == b  # so a no-op reconcile writes nothing


def offload(probes, **patch):
    obs = conditions.Observed(sts(), [ready_pod()], probes)
    return by_type(conditions.status(body(), desired(**patch), None, obs, T0))["OffloadActive"]


ON, OFF = Reading(1.0), Reading(0.0)


def test_offload_active_needs_proof_from_every_exporter():
    assert offload({"svc-0": ON})["status"] == "True"
    idle = offload({"svc-0": OFF})
    assert idle["status"] == "False" and idle["reason"] == "NoLMCacheActivity" and "svc-0" in idle["message"]
    assert "vllm:external_prefix_cache_queries_total" in idle["message"]
    gone = offload({"svc-0": "http://127.16.0.2:9400/metrics: connection refused"})
    assert gone["status"] == "Unknown" and "connection refused" in gone["message"]
    assert offload(None)["reason"] == "ProbesDisabled"
    assert offload({"svc-0": ON}, metrics={"enabled": False})["reason"] == "MetricsDisabled"


def test_offload_active_is_false_when_vllm_counts_hits_lmcache_never_loaded():
    """What the exporter reports for the H200 reference page (vLLM 0.26.0's V2 runner): 64,028 external
    hits, 0 LMCache retrieves. Worse than idle, so it wins over NoLMCacheActivity and LMCacheActive."""
    skipped = Reading(0.0, None, 64028.0)
    c = offload({"svc-0": skipped})
    assert (c["status"], c["reason"]) == ("False", "ExternalHitsNotLoaded")
    for words in ("svc-0: vLLM counted 64,028 prompt tokens as loaded from LMCache",
                  "vllm:external_prefix_cache_hits_total",
                  "lmcache:num_retrieve_requests_total 0", "answers for those prompts are wrong",
                  f"Rendered for vLLM {images.DEFAULT_PAIR.vllm} + LMCache {images.DEFAULT_PAIR.lmcache}",
                  "VLLM_USE_V2_MODEL_RUNNER=0", "EngineVerified"):
        assert words in c["message"], words
    obs = conditions.Observed(sts(replicas=2, ready=2, updated=2), [ready_pod(), ready_pod("svc-1")],
                              {"svc-0": ON, "svc-1": skipped})
    c = by_type(conditions.status(body(), desired(replicas=2), None, obs, T0))["OffloadActive"]
    assert c["reason"] == "ExternalHitsNotLoaded" and c["message"].startswith("1/2 pods") and "svc-1:" in c["message"]


def test_offload_active_counts_only_ready_pods():
    obs = conditions.Observed(sts(replicas=2, ready=2, updated=2), [ready_pod(), ready_pod("svc-1")],
                              {"svc-0": ON, "svc-1": "refused"})
    c = by_type(conditions.status(body(), desired(replicas=2), None, obs, T0))["OffloadActive"]
    assert c["reason"] == "LMCacheActive" and "1/2 pods" in c["message"] and "1 exporters unreachable" in c["message"]
    # A running, not-ready pod's exporter answers too (for its versions), but proves no offload.
    obs = conditions.Observed(sts(), [ready_pod(), pod("svc-9")], {"svc-0": ON, "svc-9": OFF})
    assert by_type(conditions.status(body(), desired(), None, obs, T0))["OffloadActive"]["status"] == "True"


# --- EngineVerified: the pair the pods really run vs the pair rendered for --------------------------

def running(vllm, lmcache, torch="2.11.0+cu130", active=1.0):
    return Reading(active, {"vllm": vllm, "lmcache": lmcache, "torch": torch})


def engine(probes, **patch):
    st = conditions.status(body(), desired(**patch), None, conditions.Observed(sts(), [ready_pod()], probes), T0)
    return by_type(st)["EngineVerified"], st["versions"]


# The offered pair that is not the default, named in full (a known image's versions cannot be contradicted).
PINNED = {"engine__image": "ghcr.io/kvoffload/vllm-lmcache:0.26.0-0.5.3", "engine__vllmVersion": "0.26.0",
          "engine__lmcacheVersion": "0.5.3"}


@pytest.mark.parametrize("probes, patch, status, reason, words", [
    ({"svc-0": running("0.26.0", "0.5.3")}, PINNED, "True", "EngineVersionsMatch",
     "1/1 pods run vLLM 0.26.0 + LMCache 0.5.3"),
    ({"svc-0": running("0.26.0+cu130", "0.5.3")}, PINNED, "True", "EngineVersionsMatch", "1/1 pods"),
    ({"svc-0": running("0.27.1", "0.5.4")}, PINNED, "False", "EngineVersionMismatch",
     "rendered for vLLM 0.26.0 + LMCache 0.5.3, pod svc-0 runs vLLM 0.27.1 + LMCache 0.5.4"),
    ({"svc-0": running("0.26.0", "none")}, PINNED, "False", "EngineVersionMismatch",
     "pod svc-0 runs vLLM 0.26.0 + LMCache none"),
    ({"svc-0": running("0.26.0", "0.5.3"), "svc-1": running("0.26.0", "0.5.4"), "svc-2": running("0.29.0", "0.5.3")},
     PINNED, "False", "EngineVersionMismatch", "pod svc-1 runs vLLM 0.26.0 + LMCache 0.5.4 (1 more pods differ)"),
    ({"svc-0": Reading(1.0)}, PINNED, "Unknown", "VersionsNotReported", "no pod's exporter reported its versions yet"),
    ({"svc-0": "http://127.16.0.2:9400/metrics: connection refused"}, PINNED, "Unknown", "VersionsNotReported",
     "svc-0: http://127.16.0.2:9400/metrics: connection refused"),
    ({}, PINNED, "Unknown", "VersionsNotReported", "rendered for vLLM 0.26.0 + LMCache 0.5.3"),
    (None, PINNED, "Unknown", "ProbesDisabled", "kvoffload_engine_info"),
    ({"svc-0": running("0.27.1", "0.5.4")}, {**PINNED, "metrics": {"enabled": False}}, "Unknown", "MetricsDisabled",
     "rendered for vLLM 0.26.0 + LMCache 0.5.3"),
])
def test_engine_verified(probes, patch, status, reason, words):
    c, _ = engine(probes, **patch)
    assert (c["status"], c["reason"]) == (status, reason), c["message"]
    assert words in c["message"]


def test_engine_verified_does_not_wait_for_ready():
    """A pod whose vLLM cannot start (not Ready) still reports its versions: the mismatch shows."""
    obs = conditions.Observed(sts(ready=0), [pod()], {"svc-0": running("0.27.1", "0.5.4", active=0.0)})
    c = by_type(conditions.status(body(), desired(**PINNED), None, obs, T0))
    assert c["Ready"]["status"] == "False" and c["EngineVerified"]["reason"] == "EngineVersionMismatch"


def test_status_versions_show_what_runs_and_what_was_rendered_for():
    probes = {f"svc-{i}": running("0.26.0", "0.5.3") for i in range(12)}
    probes["svc-12"] = running("0.27.1", "0.5.4", torch="2.13.0")
    probes["svc-13"] = "refused"
    _, versions = engine(probes, **PINNED)
    assert versions["renderedFor"] == {"vllm": "0.26.0", "lmcache": "0.5.3"}
    assert versions["image"] == desired(**PINNED).spec.engine.image
    first, second = versions["running"]
    assert first == {"vllm": "0.26.0", "lmcache": "0.5.3", "torch": "2.11.0+cu130", "podCount": 12,
                     "pods": sorted(f"svc-{i}" for i in range(12))[:crd.MAX_VERSION_PODS]}
    assert second == {"vllm": "0.27.1", "lmcache": "0.5.4", "torch": "2.13.0", "podCount": 1, "pods": ["svc-12"]}
    assert engine(None, **PINNED)[1]["running"] == []


def test_invalid_spec_leaves_engine_verified_unknown():
    st = conditions.status(body(), None, ConfigError("spec.engine.image", "bad"), conditions.Observed(None, []), T0)
    assert by_type(st)["EngineVerified"]["status"] == "Unknown"
    assert offload({"svc-0": 1.0}, metrics={"enabled": False})["reason"] == "MetricsDisabled"


# --- kstatus' pair: Reconciling and Stalled, derived from Ready and ConfigValid ------------------

def kstatus_pair(st):
    c = by_type(st)
    return (c["Reconciling"]["status"], c["Reconciling"]["reason"]), (c["Stalled"]["status"], c["Stalled"]["reason"])


def failing_pod(reason="CrashLoopBackOff"):
    p = pod()
    p["status"]["containerStatuses"] = [{"name": "vllm",
                                         "state": {"waiting": {"reason": reason, "message": "back-off 5m0s"}}}]
    return p


PAIRS = [  # (what was read, Ready, (Reconciling), (Stalled))
    ("ready", lambda: conditions.status(body(), desired(), None, conditions.Observed(sts(), [pod()]), T0),
     ("True", "AllReplicasReady"), ("False", "Converged"), ("False", "SpecAccepted")),
    ("invalid", lambda: conditions.status(body(3), None, ConfigError("spec.offload.disk.path", "'/etc' is outside"),
                                          conditions.Observed(None, []), T0),
     ("False", "InvalidSpec"), ("False", "Stalled"), ("True", "InvalidSpec")),
    ("rolling out", lambda: conditions.status(body(2), desired(), None,
                                              conditions.Observed(sts(gen=2, observed=2, updated=0, update="r2"),
                                                                  [pod()]), T0),
     ("False", "RollingOut"), ("True", "RollingOut"), ("False", "SpecAccepted")),
    ("no StatefulSet yet", lambda: conditions.status(body(), desired(), None, conditions.Observed(None, []), T0),
     ("False", "ReplicasNotReady"), ("True", "ReplicasNotReady"), ("False", "SpecAccepted")),
    ("unschedulable", lambda: conditions.status(body(), desired(), None,
                                                conditions.Observed(sts(ready=0),
                                                                    [pod(scheduled=False, message="0/4 nodes")]), T0),
     ("False", "Unschedulable"), ("True", "Unschedulable"), ("False", "SpecAccepted")),
    ("crash loop", lambda: conditions.status(body(), desired(), None,
                                             conditions.Observed(sts(ready=0), [failing_pod()]), T0),
     ("False", "PodsFailing"), ("True", "PodsFailing"), ("False", "SpecAccepted")),
    ("image pull", lambda: conditions.status(body(), desired(), None,
                                             conditions.Observed(sts(ready=0), [failing_pod("ImagePullBackOff")]), T0),
     ("False", "PodsFailing"), ("True", "PodsFailing"), ("False", "SpecAccepted")),
    ("zero replicas", lambda: conditions.status(body(), desired(replicas=0), None,
                                                conditions.Observed(sts(replicas=0, ready=0, updated=0), []), T0),
     ("True", "AllReplicasReady"), ("False", "Converged"), ("False", "SpecAccepted")),
]


@pytest.mark.parametrize("case,make,ready,reconciling,stalled", PAIRS, ids=[p[0] for p in PAIRS])
def test_reconciling_and_stalled_follow_ready_and_config_valid(case, make, ready, reconciling, stalled):
    st = make()
    c = by_type(st)
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ready
    assert kstatus_pair(st) == (reconciling, stalled)
    # Exactly one verdict for kstatus: converged, converging, or stuck on the spec.
    assert [c["Ready"]["status"] == "True", c["Reconciling"]["status"] == "True",
            c["Stalled"]["status"] == "True"].count(True) == 1
    if stalled[0] == "True":  # the reason and message come from ConfigValid
        assert c["Stalled"]["message"] == c["ConfigValid"]["message"] and c["ConfigValid"]["status"] == "False"
        assert st["observedGeneration"] == 3  # the verdict is about this generation: kstatus reads Failed
    if reconciling[0] == "True":
        assert c["Reconciling"]["message"] == c["Ready"]["message"]


def test_crash_loop_names_the_pod_and_the_container_state():
    c = by_type(conditions.status(body(), desired(), None, conditions.Observed(sts(ready=0), [failing_pod()]), T0))
    assert c["Ready"]["message"] == "1 pod(s) failing; svc-0: container vllm: CrashLoopBackOff (back-off 5m0s)"


def test_a_crash_loop_after_an_oom_kill_names_the_kill():
    p = failing_pod()
    p["status"]["containerStatuses"][0]["lastState"] = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
    c = by_type(conditions.status(body(), desired(), None, conditions.Observed(sts(ready=0), [p]), T0))
    assert c["Ready"]["message"] == ("1 pod(s) failing; svc-0: container vllm: CrashLoopBackOff after OOMKilled (exit "
                                     "code 137) (back-off 5m0s)")


def test_first_status_over_the_crd_default():
    # A new resource as the API server serves it: the CRD's status default only (no first-sight write before this:
    # test_first_status.py shows kstatus and Argo CD read it as in progress already).
    st = conditions.status(body(4, {"observedGeneration": 0}), desired(), None, conditions.Observed(None, []), T0)
    c = by_type(st)
    assert [x["type"] for x in st["conditions"]] == list(TYPES)
    assert c["Reconciling"]["status"] == "True" and c["Ready"]["status"] == "False"
    assert all(x["observedGeneration"] == 4 and x["lastTransitionTime"] == "2026-01-01T00:00:00Z"
               for x in st["conditions"])
    assert st["observedGeneration"] == 0  # nothing rolled out yet: kstatus reads InProgress
    # The next status keeps lastTransitionTime of conditions whose status stayed.
    nxt = conditions.status(body(4, st), desired(), None, conditions.Observed(sts(ready=0), [pod()]), T1)
    assert by_type(nxt)["Reconciling"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"  # True -> True


def test_rollout_before_the_statefulset_controller_saw_the_template():
    # Its counts still describe the old template: say so instead of "1/1 updated".
    st = conditions.status(body(2), desired(), None, conditions.Observed(sts(gen=2, observed=1), [pod()]), T0)
    c = by_type(st)
    assert (c["Ready"]["reason"] == "RollingOut"
            and "not yet picked up by the StatefulSet controller" in c["Ready"]["message"])
    assert c["Reconciling"]["status"] == "True" and st["observedGeneration"] == 0
def test_pods_not_created_point_at_the_statefulset_events():
    from kvoffload.controller import conditions as c

    cond = c._scheduled(2, [])
    assert (cond.status, cond.reason) == ("Unknown", "PodsPending")
    assert "2 pod(s) not created yet" in cond.message and "violates PodSecurity" in cond.message
    created = {"metadata": {"name": "svc-0"}, "spec": {}, "status": {}}
    assert "not created" not in c._scheduled(1, [created]).message


def test_every_condition_and_reason_is_declared_once():
    """Types and reasons come from kvoffload.api.conditions (the CRD text and the chart's NOTES read it); a reason that
    is not declared there cannot be written, and a refused spec says InvalidSpec on every condition that names one."""
    from kvoffload.api import conditions as declared
    from kvoffload.api import crd
    from kvoffload.cli import generate

    with pytest.raises(ValueError, match="not declared"):
        conditions.Cond("Ready", "False", "ConfigInvalid", "x")
    st = conditions.status(body(3), None, ConfigError("spec.offload.disk.path", "'/etc' is outside"),
                           conditions.Observed(None, []), T0)
    assert {c["reason"] for c in st["conditions"] if c["type"] not in ("Reconciling",)} == {"InvalidSpec"}
    assert crd.status_schema()["properties"]["conditions"]["description"] == declared.summary()
    assert all(f"{c.type}: {c.description}" in generate.conditions_tpl() for c in declared.CONDITIONS)


def test_the_declared_conditions_written_out_by_hand():
    """The test above checks the CRD text and the chart's template against the declarations they are generated from,
    so a wrong or missing declaration would pass it. The types, a few key reasons and one generated line, literally."""
    from kvoffload.api import conditions as declared
    from kvoffload.cli import generate

    assert declared.TYPES == ("Ready", "ConfigValid", "Scheduled", "OffloadActive", "EngineVerified", "DiskTierReady",
                              "SharedCacheReady", "RouterReady", "AutoscalingReady", "Reconciling", "Stalled")
    reasons = {c.type: set(c.reasons) for c in declared.CONDITIONS}
    assert {"AllReplicasReady", "Unschedulable", "PodsFailing", "RollingOut", "ReplicasNotReady", "RouterNotReady",
            "InvalidSpec", "ApplyRefused", "NameConflict"} <= reasons["Ready"]
    assert {"Valid", "InvalidSpec"} <= reasons["ConfigValid"]
    assert {"ExternalHitsNotLoaded", "MetricsDisabled", "ProbesDisabled"} <= reasons["OffloadActive"]
    assert {"EngineVersionMismatch", "EngineVersionsMatch"} <= reasons["EngineVerified"]
    assert reasons["Reconciling"] == {"Converged", "Stalled"}
    assert "Ready: Every replica runs the newest pod template and is ready." in generate.conditions_tpl()
