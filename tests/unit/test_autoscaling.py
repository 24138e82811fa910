"""spec.autoscaling: parse (field errors), render (HPA / KEDA ScaledObject, windows from the start-up budget) and
status.autoscaling from what the HorizontalPodAutoscaler reports. Pure; the real controllers are in
tests/integration/test_autoscaling.py."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from kvoffload.api import promql
from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings, from_dict, resolve_autoscaler
from kvoffload.controller import conditions, discovery, pipeline
from kvoffload.rendering import autoscaling
from kvtest import ROOT
from kvtest.specs import spec

EXAMPLE = yaml.safe_load((ROOT / "examples" / "autoscaling" / "llama31-8b.yaml").read_text())
KEDA = Settings(autoscaler="keda", prometheus_address="http://prometheus.monitoring.svc:9090")
WAKE = 'sum(gateway_queue{namespace="team-a",model="x"})'
SCALED = {"autoscaling__maxReplicas": 4, "autoscaling__targets__waitingRequestsPerReplica": 4}


def desired(s: dict, settings: Settings = Settings()) -> pipeline.Desired:
    return pipeline.desired("svc", "team-a", "uid-1", s, settings)


def child(d: pipeline.Desired, kind: str) -> dict:
    return next(c for c in d.children if c["kind"] == kind)


def test_example_renders_an_hpa_whose_windows_are_the_startup_budget():
    d = desired(EXAMPLE["spec"])
    startup = d.budget.weights.startup_seconds
    assert 300 < startup < 1800  # the example's download + load budget
    hpa = child(d, "HorizontalPodAutoscaler")
    assert hpa["metadata"]["name"] == "svc" and hpa["metadata"]["ownerReferences"][0]["kind"] == "KVOffloadServe"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe",
                                             "name": "svc"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    assert [(m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"]) for m in hpa["spec"]["metrics"]] == [
        ("vllm_num_requests_waiting", "4"), ("vllm_kv_cache_usage_perc", "850m"),
        ("vllm_request_queue_time_p90_milliseconds", "2000")]
    b = hpa["spec"]["behavior"]
    assert b["scaleUp"]["policies"] == [{"type": "Percent", "value": 100, "periodSeconds": startup}]
    assert b["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert b["scaleDown"]["stabilizationWindowSeconds"] == startup
    # The StatefulSet follows spec.replicas, which the autoscaler writes through the scale subresource.
    assert child(d, "StatefulSet")["spec"]["replicas"] == 1


@pytest.mark.parametrize("startup,up,down", [(60, 60, 300), (940, 940, 940), (5000, 1800, 3600)])
def test_windows_follow_the_startup_budget_within_bounds(startup, up, down):
    d = desired(spec(**SCALED))
    budget = dataclasses.replace(d.budget, weights=dataclasses.replace(d.budget.weights, startup_seconds=startup))
    assert autoscaling.windows(d.spec.autoscaling, budget) == (up, down)


def test_spec_windows_win():
    d = desired(spec(**SCALED, autoscaling__scaleUpPeriodSeconds=5, autoscaling__scaleDownWindowSeconds=20))
    assert autoscaling.windows(d.spec.autoscaling, d.budget) == (5, 20)


def test_keda_renders_a_scaled_object_with_prometheus_triggers():
    d = desired(spec(**SCALED, autoscaling__minReplicas=0, autoscaling__wakeQuery=WAKE,
                     autoscaling__targets__queueTimeP90Milliseconds=500), KEDA)
    assert not any(c["kind"] == "HorizontalPodAutoscaler" for c in d.children)
    so = child(d, "ScaledObject")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    s = so["spec"]
    assert (s["minReplicaCount"], s["maxReplicaCount"], s["cooldownPeriod"]) == (0, 4, d.budget.weights.startup_seconds)
    assert s["advanced"]["horizontalPodAutoscalerConfig"]["name"] == "keda-hpa-svc"
    sel = 'namespace="team-a",kvoffload_io_serve="svc"'
    assert [(t["metricType"], t["metadata"]) for t in s["triggers"]] == [
        ("AverageValue", {"serverAddress": KEDA.prometheus_address, "query": f"sum(vllm:num_requests_waiting{{{sel}}})",
                          "threshold": "4"}),
        ("Value", {"serverAddress": KEDA.prometheus_address, "threshold": "500", "query":
                   "(1000 * histogram_quantile(0.9, sum by (le) "
                   f"(rate(vllm:request_queue_time_seconds_bucket{{{sel}}}[2m]))) >= 0) or vector(0)"}),
        ("AverageValue", {"serverAddress": KEDA.prometheus_address, "query": WAKE,
                          "threshold": "4", "activationThreshold": "0"})]


@pytest.mark.parametrize("query,words", [
    ('sum(gateway_queue{model="x"})', 'gateway_queue{model="x"} must select namespace="team-a"'),
    ('sum(gateway_queue{namespace="team-b"})', 'must select namespace="team-a"'),
    ('sum(gateway_queue{namespace=~"team-.*"})', 'must select namespace="team-a"'),
    ('sum(gateway_queue{namespace!="team-b"})', 'must select namespace="team-a"'),
    ('sum(q{namespace="team-a"}) or on() sum(vllm:num_requests_waiting)', "vllm:num_requests_waiting must select"),
    ('{__name__=~".+"}', 'must select namespace="team-a"'),
    ('sum(rate(q{namespace="team-a"}[5m])) + sum_over_time(sum(r)[5m:1m])', "r must select"),
    ('q{namespace="team-a" or namespace="team-b"}', "uses `or` between matchers"),
    ('sum(q{namespace="team-a"', "is not valid PromQL"),
])
def test_wake_query_reads_only_its_own_namespace(query, words):
    with pytest.raises(ConfigError) as err:
        desired(spec(**SCALED, autoscaling__minReplicas=0, autoscaling__wakeQuery=query), KEDA)
    assert err.value.field == "spec.autoscaling.wakeQuery" and words in err.value.message, err.value


def test_every_rendered_query_is_scoped_to_the_namespace():
    """The operator's own triggers pass the check a tenant's wakeQuery must pass."""
    d = desired(spec(**SCALED, autoscaling__minReplicas=0, autoscaling__wakeQuery=WAKE,
                     autoscaling__targets__kvCacheUsagePercent=80,
                     autoscaling__targets__queueTimeP90Milliseconds=500), KEDA)
    triggers = child(d, "ScaledObject")["spec"]["triggers"]
    assert len(triggers) == 4
    for t in triggers:
        promql.check_scoped(t["metadata"]["query"], "team-a", "query")
        with pytest.raises(ConfigError):
            promql.check_scoped(t["metadata"]["query"], "team-b", "query")


@pytest.mark.parametrize("patch,field,words", [
    ({"autoscaling__minReplicas": 5}, "spec.autoscaling.minReplicas", "at most maxReplicas"),
    ({"autoscaling__targets__waitingRequestsPerReplica": None}, "spec.autoscaling.targets", "kvCacheUsagePercent"),
    ({"autoscaling__targets__kvCacheUsagePercent": 0}, "spec.autoscaling.targets.kvCacheUsagePercent", "[1, 100]"),
    ({"autoscaling__maxReplicas": 1001}, "spec.autoscaling.maxReplicas", "[1, 1000]"),
    ({"autoscaling__minReplicas": 0}, "spec.autoscaling.wakeQuery", "required with minReplicas 0"),
    ({"autoscaling__wakeQuery": "up"}, "spec.autoscaling.wakeQuery", "only then"),
    ({"autoscaling__minReplicas": 0, "autoscaling__wakeQuery": "up"}, "spec.autoscaling.minReplicas", "needs KEDA"),
    ({"autoscaling__targets__promptRecomputePercent": 50},
     "spec.autoscaling.targets.promptRecomputePercent", "does not fall as replicas are added"),
    ({"autoscaling__targets__waitingRequestsPerReplica": None, "autoscaling__targets__promptRecomputePercent": 50},
     "spec.autoscaling.targets.promptRecomputePercent", "Use queueTimeP90Milliseconds"),
    ({"autoscaling__scaleUpPeriodSeconds": 0}, "spec.autoscaling.scaleUpPeriodSeconds", "[1, 1800]"),
])
def test_bad_autoscaling_names_the_field(patch, field, words):
    with pytest.raises(ConfigError) as err:
        desired(spec(**{**SCALED, **patch}))
    assert err.value.field == field and words in err.value.message, err.value


@pytest.mark.parametrize("config,field", [({"autoscaler": "argo"}, "autoscaler"),
                                          ({"autoscaler": "keda"}, "prometheusAddress")])
def test_bad_autoscaler_settings_name_the_setting(config, field):
    with pytest.raises(ConfigError) as err:
        from_dict(config)
    assert field in err.value.field


# What kube-controller-manager's HPA controller wrote on KEDA's HPA in the integration test (shape as served).
KEDA_HPA_STATUS = {
    "currentReplicas": 2, "desiredReplicas": 4, "lastScaleTime": "2026-12-01T11:40:02Z",
    "currentMetrics": [{"type": "External", "external": {"metric": {"name": "s0-prometheus"},
                                                         "current": {"averageValue": "3500m"}}}],
    "conditions": [
        {"type": "AbleToScale", "status": "True", "reason": "ScaleDownStabilized",
         "message": "recent recommendations were higher"},
        {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound",
         "message": "the HPA was able to successfully calculate a replica count from external metric s0-prometheus"},
        {"type": "ScalingLimited", "status": "True", "reason": "ScaleUpLimit",
         "message": "the desired replica count is increasing faster than the maximum scale rate"}]}


def test_status_says_what_the_autoscaler_wants_and_why():
    d = desired(spec(**SCALED), KEDA)
    hpa = {"metadata": {"name": "keda-hpa-svc"}, "status": KEDA_HPA_STATUS}
    st = conditions.autoscaler_status(d, "svc", hpa)
    assert st["autoscaler"] == "keda" and st["horizontalPodAutoscaler"] == "keda-hpa-svc"
    assert (st["currentReplicas"], st["desiredReplicas"]) == (2, 4)
    assert st["metrics"] == [{"target": "waitingRequestsPerReplica", "current": "3.5", "want": "4"}]
    assert st["reason"] == "ScaleUpLimit"
    assert st["message"].startswith("wants 4 replicas (has 2): waitingRequestsPerReplica 3.5 (target 4); the desired")


def test_status_says_why_a_plain_hpa_cannot_scale():
    d = desired(spec(**SCALED))
    hpa = {"metadata": {"name": "svc"}, "status": {"currentReplicas": 1, "desiredReplicas": 0, "conditions": [
        {"type": "AbleToScale", "status": "True", "reason": "SucceededGetScale", "message": "ok"},
        {"type": "ScalingActive", "status": "False", "reason": "FailedGetPodsMetric",
         "message": "unable to get metric vllm_num_requests_waiting: no "
                    "custom metrics API (custom.metrics.k8s.io) registered"}]}}
    st = conditions.autoscaler_status(d, "svc", hpa)
    assert st["autoscaler"] == "hpa" and st["reason"] == "FailedGetPodsMetric"
    assert "ScalingActive=False: unable to get metric vllm_num_requests_waiting" in st["message"]
    assert conditions.autoscaler_status(d, "svc", None)["reason"] == "AutoscalerNotFound"


# AutoscalingReady: a pure function of what discovery read (controller/discovery.py reads it on the real API server,
# tests/integration/test_autoscaling.py).
ADAPTER_METRICS = frozenset({"pods/vllm_num_requests_waiting", "pods/vllm_kv_cache_usage_perc"})


def apis(custom=discovery.Api(discovery.NOT_REGISTERED), external=discovery.Api(discovery.NOT_REGISTERED),
         keda=discovery.Api(discovery.NOT_REGISTERED)) -> discovery.AutoscalingApis:
    return discovery.AutoscalingApis(custom, external, keda)


@pytest.mark.parametrize("settings,read,status,reason,words", [
    (Settings(), None, "Unknown", "DiscoveryPending", "not read"),
    (Settings(), apis(), "False", "NoCustomMetricsAdapter", "install a custom-metrics adapter"),
    (Settings(), apis(custom=discovery.Api(discovery.UNAVAILABLE, detail="service unavailable")), "False",
     "CustomMetricsUnavailable", "service unavailable"),
    (Settings(), apis(custom=discovery.Api(discovery.SERVED, frozenset({"pods/vllm_kv_cache_usage_perc"}))), "False",
     "MetricsNotServed", "vllm_num_requests_waiting"),
    (Settings(), apis(custom=discovery.Api(discovery.SERVED, ADAPTER_METRICS)), "True", "MetricsServed",
     "every metric"),
    (KEDA, apis(), "False", "KedaNotInstalled", "install KEDA"),
    (KEDA, apis(keda=discovery.Api(discovery.SERVED, frozenset({"scaledobjects"}))), "False", "KedaMetricsUnavailable",
     "keda-operator-metrics-apiserver"),
    (KEDA, apis(keda=discovery.Api(discovery.SERVED, frozenset({"scaledobjects"})),
                external=discovery.Api(discovery.SERVED)), "True", "KedaServed", "served"),
])
def test_autoscaling_ready_names_what_is_missing(settings, read, status, reason, words):
    c = conditions.autoscaling_ready(desired(spec(**SCALED), settings), read)
    assert (c.status, c.reason) == (status, reason) and words in c.message, c


def test_autoscaling_ready_without_autoscaling():
    assert conditions.autoscaling_ready(desired(spec()), apis()).reason == "NotConfigured"


@pytest.mark.parametrize("served,address,chosen", [(True, "http://p:9090", "keda"), (False, "http://p:9090", "hpa"),
                                                   (True, "", "hpa")])
def test_auto_picks_keda_where_it_is_served_and_has_a_prometheus(served, address, chosen):
    assert resolve_autoscaler(Settings(prometheus_address=address), served).autoscaler == chosen
    assert resolve_autoscaler(Settings(autoscaler="hpa", prometheus_address=address), served).autoscaler == "hpa"


def test_the_docs_print_the_adapter_rules_the_operator_renders():
    text = (ROOT / "docs" / "autoscaling.md").read_text()
    section = text.split("## `autoscaler: hpa`: the metrics adapter's rules", 1)[1]
    block = section.split("```yaml", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block)["rules"] == [t.adapter_rule() for t in autoscaling.TARGETS.values()]
