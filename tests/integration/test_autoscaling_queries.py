"""Every autoscaling signal's PromQL, exactly as the operator renders it (KEDA's trigger queries and the
prometheus-adapter rules docs/autoscaling.md prints), evaluated by a REAL Prometheus (/usr/bin/prometheus) on
127.0.0.1 scraping pages replayed from real vLLM captures (kvtest.vllm_replay, a stand-in: the h200 vLLM 0.26.0
run and the vLLM 0.33.0 sample), whose load the test sets.

Load model of the stand-in (stated, not measured): a replica starts MU requests/s; a service holding QUEUED
requests over N replicas queues QUEUED/N per replica, each waiting (QUEUED/N)/MU s; a replica's GPU KV usage is
0.2 + 0.05 x (its queue), at most 0.99. Each signal must rise with load, fall as the same load is split over more
replicas, and cross its threshold where that model (through the histogram's buckets) puts it. `kvoffload plan`
predicts no queue time or queue length (it sizes tiers, not traffic), so the crossing is checked against the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.rendering import autoscaling
from kvtest.keda import hpa_replicas
from kvtest.prometheus import PROMETHEUS, PromAPI, Prometheus
from kvtest.vllm_replay import VllmReplay

pytestmark = pytest.mark.skipif(not PROMETHEUS.exists(), reason="/usr/bin/prometheus is absent (make system-deps)")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CAPTURES = {"vllm-0.26.0-h200": FIXTURES / "h200-vllm-0.26.0-lmcache-0.5.3" / "vllm-metrics-with-lmcache.txt",
            "vllm-0.33.0": FIXTURES / "vllm-0.33.0-metrics-sample" / "exposition.txt"}
NS, MU = "team-a", 4.0
# serve name -> (queued requests in the whole service, replicas)
LOADS = {"light": (2, 1), "heavy1": (16, 1), "heavy2": (16, 2), "heavy4": (16, 4), "idle": (0, 1)}
TARGETS = {"waitingRequestsPerReplica": 4, "kvCacheUsagePercent": 85, "queueTimeP90Milliseconds": 2000}


def kv_usage(per_replica_queue: float) -> float:
    return min(0.99, 0.2 + 0.05 * per_replica_queue)


def p90_ms(bounds: list[float], wait: float) -> float:
    """histogram_quantile(0.9) of observations that all waited `wait` s: Prometheus interpolates linearly inside
    the bucket that holds them (lower bound = the previous boundary)."""
    i = next(i for i, le in enumerate(bounds) if wait <= le)
    lo = bounds[i - 1] if i else 0.0
    return 1000 * (lo + 0.9 * (bounds[i] - lo))


@pytest.fixture(scope="module", params=list(CAPTURES))
def prom(request, tmp_path_factory) -> Iterator[tuple[PromAPI, list[float]]]:
    replicas: list[VllmReplay] = []
    scrape = []
    for serve, (queued, n) in LOADS.items():
        for i in range(n):
            r = VllmReplay(CAPTURES[request.param])
            r.waiting, r.kv_usage = queued / n, kv_usage(queued / n) if queued else 0.0
            r.queue_seconds, r.starts_per_second = queued / n / MU, MU if queued else 0.0
            replicas.append(r)
            scrape.append({"targets": [r.target], "labels": {
                "namespace": NS, autoscaling.SERVE_LABEL: serve, "pod": f"{serve}-{i}"}})
    prometheus = Prometheus(tmp_path_factory.mktemp("prom"), [{"job_name": "vllm", "static_configs": scrape}])
    try:
        # rate() over the rendered 2m window needs two samples of every replica: wait for the last ones.
        prometheus.api.wait_for(f"count(count_over_time(vllm:num_requests_waiting[2m]) >= 3) == {len(replicas)}")
        yield prometheus.api, replicas[0].bounds
    finally:
        prometheus.stop()
        for r in replicas:
            r.close()


def keda_value(api: PromAPI, field: str, serve: str) -> float:
    sel = f'namespace="{NS}",{autoscaling.SERVE_LABEL}="{serve}"'
    return api.scalar(autoscaling.TARGETS[field].query(sel))


def hpa_desired(field: str, value: float, replicas: int) -> int:
    """The HPA's replica count for one KEDA trigger at this test's target for `field`."""
    return hpa_replicas(autoscaling.TARGETS[field].per_replica, value, replicas, TARGETS[field])


def test_keda_queries_rise_with_load_and_fall_as_replicas_are_added(prom):
    api, bounds = prom
    for field in TARGETS:
        v = {serve: keda_value(api, field, serve) for serve in LOADS}
        per = {s: v[s] / LOADS[s][1] if autoscaling.TARGETS[field].per_replica else v[s] for s in v}
        assert per["idle"] == 0 < per["light"] < per["heavy1"], (field, v)  # rises with load; idle reads 0, not NaN
        assert per["heavy1"] > per["heavy2"] > per["heavy4"], (field, v)  # the same load over more replicas: falls
    waiting = {s: keda_value(api, "waitingRequestsPerReplica", s) for s in LOADS}
    assert waiting == {s: float(q) for s, (q, _) in LOADS.items()}
    kv = keda_value(api, "kvCacheUsagePercent", "heavy2")
    assert kv == pytest.approx(100 * 2 * kv_usage(8))
    for serve, (queued, n) in LOADS.items():
        if queued:
            assert keda_value(api, "queueTimeP90Milliseconds", serve) == pytest.approx(p90_ms(bounds, queued / n / MU))


def test_keda_thresholds_cross_where_the_load_model_puts_them(prom):
    api, _ = prom
    # 16 queued, 4 per replica: 4 replicas, and once at 4 no more (the signal has fallen to its target).
    assert [hpa_desired("waitingRequestsPerReplica", keda_value(api, "waitingRequestsPerReplica", s), LOADS[s][1])
            for s in ("light", "heavy1", "heavy2", "heavy4")] == [1, 4, 4, 4]
    # KV usage 99 % on one replica -> 2; split over 2 (60 %) or 4 (40 %) it asks for no more than 2.
    assert [hpa_desired("kvCacheUsagePercent", keda_value(api, "kvCacheUsagePercent", s), LOADS[s][1])
            for s in ("light", "heavy1", "heavy2")] == [1, 2, 2]
    assert hpa_desired("kvCacheUsagePercent", keda_value(api, "kvCacheUsagePercent", "heavy4"), 4) < 4
    # Queue time: 4 s waits on one replica (p90 4.75 s) -> 3 replicas; at 2 replicas (2 s: p90 1.95 s) it is
    # within tolerance of the 2 s target, so the HPA holds; at 4 replicas (1 s) it would scale down.
    q = {s: keda_value(api, "queueTimeP90Milliseconds", s) for s in LOADS}
    assert q["heavy1"] > TARGETS["queueTimeP90Milliseconds"] >= q["heavy2"] > q["heavy4"]
    assert [hpa_desired("queueTimeP90Milliseconds", q[s], LOADS[s][1]) for s in ("heavy1", "heavy2", "heavy4")] \
        == [3, 2, 2]


def adapter_query(field: str, serve: str) -> str:
    """The rule's metricsQuery as prometheus-adapter expands it for the HPA's Pods metric over one serve's pods."""
    rule = autoscaling.TARGETS[field].adapter_rule()
    pods = "|".join(f"{serve}-{i}" for i in range(LOADS[serve][1]))
    return (rule["metricsQuery"].replace("<<.Series>>", rule["seriesQuery"].split("{", 1)[0])
            .replace("<<.LabelMatchers>>", f'namespace="{NS}",pod=~"{pods}"').replace("<<.GroupBy>>", "pod"))


def test_adapter_rules_serve_per_pod_values_that_fall_as_replicas_are_added(prom):
    api, bounds = prom
    for field in TARGETS:
        scale = autoscaling.TARGETS[field].unit_scale
        # The HPA averages the Pods metric over the pods and compares with the target in the metric's unit.
        avg = {s: sum(v := list(api.by(adapter_query(field, s), "pod").values())) / max(len(v), 1) * scale
               for s in LOADS if s != "idle"}
        assert avg["light"] < avg["heavy1"] and avg["heavy1"] > avg["heavy2"] > avg["heavy4"], (field, avg)
    assert api.by(adapter_query("waitingRequestsPerReplica", "heavy4"), "pod") == {f"heavy4-{i}": 4.0 for i in range(4)}
    assert api.by(adapter_query("queueTimeP90Milliseconds", "heavy2"), "pod") == pytest.approx(
        {f"heavy2-{i}": p90_ms(bounds, 2.0) for i in range(2)})
    assert api.query(adapter_query("queueTimeP90Milliseconds", "idle")) == []  # idle pod: no sample, not NaN
