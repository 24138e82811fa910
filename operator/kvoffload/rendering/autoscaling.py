"""spec.autoscaling -> the autoscaler child: a HorizontalPodAutoscaler (autoscaling/v2) or a KEDA ScaledObject,
both on the KVOffloadServe's scale subresource, so the autoscaler writes spec.replicas and the operator follows it.

Pure. The windows come from the engine's start-up budget (Budget.weights.startup_seconds, the startupProbe's):
a replica removed too early costs a whole start-up to get back, and load that queues while new engines start
must not add still more replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..api import crd, promql
from ..api.settings import Settings
from ..api.spec import AutoscalingSpec, Spec
from ..planning.sizing import Budget

HPA = ("autoscaling/v2", "HorizontalPodAutoscaler")
SCALED_OBJECT = ("keda.sh/v1alpha1", "ScaledObject")
KEDA_POLLING_SECONDS = 15  # KEDA's default; it only decides 0 <-> 1 (the HPA decides the rest every sync period)
# queueTimeP90Milliseconds is a quantile of the requests queued over this window: long enough to hold a few
# requests at low load, short against the scale-up period (the windows come from the start-up budget).
RATE_WINDOW = "2m"
# The series labels the queries select a resource's pods by: what the chart's PodMonitor / ServiceMonitor
# give (namespace, and the pod label kvoffload.io/serve as a target label).
SERVE_LABEL = "kvoffload_io_serve"
QUEUE_TIME = "vllm:request_queue_time_seconds_bucket"  # vLLM's histogram (0.26 and 0.33: tests/fixtures)


def _p90_ms(buckets: str, by: str) -> str:
    """The 90th percentile of vLLM's queue time in ms. With no request in the window every bucket's rate is 0 and
    histogram_quantile gives NaN, which no autoscaler can compare: `>= 0` drops NaN and `or` reads it as 0 ms."""
    return f"1000 * histogram_quantile(0.9, sum by ({by}) (rate({buckets}[{RATE_WINDOW}])))"


@dataclass(frozen=True)
class Target:
    """One spec.autoscaling.targets field: what the HPA (through a metrics adapter) and KEDA (through PromQL) read.
    Each falls as replicas are added at the same load (docs/autoscaling.md says why for each)."""
    field: str
    adapter_metric: str  # the Pods metric a custom-metrics adapter must serve (adapter_rule)
    unit_scale: int  # spec value / unit_scale = the adapter metric's own value (percent -> ratio)
    per_replica: bool  # KEDA: AverageValue (the sum over pods / replicas) or Value (one figure for the service)
    what: str  # for status and `kubectl kvs why`

    def query(self, sel: str) -> str:
        """KEDA's trigger query: in the target's unit, for the whole service (`sel` selects its pods)."""
        return {"waitingRequestsPerReplica": f"sum(vllm:num_requests_waiting{{{sel}}})",
                "kvCacheUsagePercent": f"100 * sum(vllm:kv_cache_usage_perc{{{sel}}})",
                "queueTimeP90Milliseconds": f"({_p90_ms(f'{QUEUE_TIME}{{{sel}}}', 'le')} >= 0) or vector(0)",
                }[self.field]

    def adapter_rule(self) -> dict[str, Any]:
        """The prometheus-adapter rule that serves `adapter_metric` per pod (docs/autoscaling.md prints these)."""
        series, query = {
            "waitingRequestsPerReplica": ("vllm:num_requests_waiting",
                                          "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"),
            "kvCacheUsagePercent": ("vllm:kv_cache_usage_perc",
                                    "max(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"),
            # Per pod; an idle pod's NaN is dropped (no sample: the HPA averages over the pods that have one).
            "queueTimeP90Milliseconds": (QUEUE_TIME, _p90_ms("<<.Series>>{<<.LabelMatchers>>}", "le, <<.GroupBy>>")
                                         + " >= 0"),
        }[self.field]
        return {"seriesQuery": f'{series}{{namespace!="",pod!=""}}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
                "name": {"as": self.adapter_metric}, "metricsQuery": query}


TARGETS = {t.field: t for t in (
    Target("waitingRequestsPerReplica", "vllm_num_requests_waiting", 1, True, "waiting requests per replica"),
    Target("kvCacheUsagePercent", "vllm_kv_cache_usage_perc", 100, True, "GPU KV-cache usage % per replica"),
    Target("queueTimeP90Milliseconds", "vllm_request_queue_time_p90_milliseconds", 1, False,
           "90th percentile of the time requests wait in vLLM's queue, ms"),
)}
assert list(TARGETS) == [t for t in crd.schema_at("autoscaling.targets")["properties"]
                         if t not in crd.REMOVED_TARGETS], "one Target per CRD field"


def name(owner_name: str, settings: Settings) -> str:
    """The HorizontalPodAutoscaler that decides: ours, or the one KEDA makes for our ScaledObject."""
    return f"keda-hpa-{owner_name}" if settings.autoscaler == "keda" else owner_name


def windows(a: AutoscalingSpec, budget: Budget) -> tuple[int, int]:
    """(scale-up period, scale-down window) in seconds: the spec's, else from the start-up budget."""
    startup = budget.weights.startup_seconds
    up = a.scale_up_period if a.scale_up_period is not None else max(1, min(1800, startup))
    down = a.scale_down_window if a.scale_down_window is not None else min(3600, max(300, startup))
    return up, down


def behavior(a: AutoscalingSpec, budget: Budget) -> dict[str, Any]:
    up, down = windows(a, budget)
    return {"scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max",
                        "policies": [{"type": "Percent", "value": 100, "periodSeconds": up}]},
            "scaleDown": {"stabilizationWindowSeconds": down, "selectPolicy": "Max",
                          "policies": [{"type": "Percent", "value": 100, "periodSeconds": 15}]}}


def _ref(owner_name: str) -> dict[str, str]:
    return {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "name": owner_name}


def _quantity(value: int, scale: int) -> str:
    return str(value) if scale == 1 else f"{value * 1000 // scale}m"


def hpa(meta: dict[str, Any], owner_name: str, a: AutoscalingSpec, budget: Budget) -> dict[str, Any]:
    metrics = [{"type": "Pods", "pods": {"metric": {"name": TARGETS[f].adapter_metric},
                                         "target": {"type": "AverageValue",
                                                    "averageValue": _quantity(v, TARGETS[f].unit_scale)}}}
               for f, v in a.targets.items()]
    return {"apiVersion": HPA[0], "kind": HPA[1], "metadata": meta,
            "spec": {"scaleTargetRef": _ref(owner_name), "minReplicas": a.min_replicas, "maxReplicas": a.max_replicas,
                     "metrics": metrics, "behavior": behavior(a, budget)}}


def _trigger(query: str, threshold: int, per_replica: bool, activation: int | None = None) -> dict[str, Any]:
    md = {"serverAddress": "", "query": query, "threshold": str(threshold)}
    if activation is not None:
        md["activationThreshold"] = str(activation)
    return {"type": "prometheus", "metricType": "AverageValue" if per_replica else "Value", "metadata": md}


def keda_triggers(sel: str, a: AutoscalingSpec) -> list[tuple[str, dict[str, Any]]]:
    """(target field, trigger) in order: KEDA names trigger i's external metric s<i>-prometheus."""
    out = [(f, _trigger(TARGETS[f].query(sel), v, TARGETS[f].per_replica)) for f, v in a.targets.items()]
    if a.wake_query:
        # Demand seen while no pod runs: above 0 it activates; then it counts like waiting requests per replica.
        out.append(("wakeQuery", _trigger(a.wake_query, a.targets.get("waitingRequestsPerReplica", 1), True,
                                          activation=0)))
    return out


def scaled_object(meta: dict[str, Any], owner_name: str, namespace: str, a: AutoscalingSpec, budget: Budget,
                  settings: Settings) -> dict[str, Any]:
    sel = f'{promql.NAMESPACE_LABEL}="{namespace}",{SERVE_LABEL}="{owner_name}"'
    if a.wake_query:  # the tenant's PromQL reads the admin's Prometheus: its own namespace only
        promql.check_scoped(a.wake_query, namespace, "spec.autoscaling.wakeQuery")
    triggers = [t for _, t in keda_triggers(sel, a)]
    for t in triggers:
        t["metadata"]["serverAddress"] = settings.prometheus_address
    _, down = windows(a, budget)
    return {"apiVersion": SCALED_OBJECT[0], "kind": SCALED_OBJECT[1], "metadata": meta,
            "spec": {"scaleTargetRef": _ref(owner_name), "minReplicaCount": a.min_replicas,
                     "maxReplicaCount": a.max_replicas,
                     "pollingInterval": KEDA_POLLING_SECONDS, "cooldownPeriod": down,
                     "advanced": {"horizontalPodAutoscalerConfig": {"name": name(owner_name, settings),
                                                                    "behavior": behavior(a, budget)}},
                     "triggers": triggers}}


def autoscaler(meta: dict[str, Any], owner_name: str, namespace: str, spec: Spec, budget: Budget,
               settings: Settings) -> dict[str, Any] | None:
    a = spec.autoscaling
    if a is None:
        return None
    if settings.autoscaler == "keda":
        return scaled_object(meta, owner_name, namespace, a, budget, settings)
    return hpa(meta, owner_name, a, budget)
