"""The status conditions, declared once: each type, what it says, and every reason it can carry.

The CRD's descriptions (api/crd.py), the chart's NOTES (cli/generate.py) and docs/api.md are generated
from this table, and controller/conditions.py refuses to write a reason that is not declared here.
"""

from __future__ import annotations

from dataclasses import dataclass

# Reasons every condition but Reconciling can carry.
# The spec is refused: ConfigValid=False, and every other condition says why it is not evaluated.
INVALID_SPEC = "InvalidSpec"
# A valid spec whose children cannot be written: ConfigValid=False with one of these, the rest as for InvalidSpec.
APPLY_REFUSED = "ApplyRefused"  # the API server refused a rendered child (quota, admission, RBAC, a 5xx)
NAME_CONFLICT = "NameConflict"  # a child's name is held by an object another owner controls


@dataclass(frozen=True)
class ConditionType:
    type: str
    description: str
    reasons: dict[str, str]  # reason -> when it is set


_COMMON = {INVALID_SPEC: "the spec is refused (ConfigValid says which field and why): nothing is created or changed",
           APPLY_REFUSED: "the API server refused a rendered child (ConfigValid names it and the API server's cause); "
                          "nothing after it is written, and the operator retries with backoff",
           NAME_CONFLICT: "a child's name is held by an object that is not this resource's (ConfigValid names it and "
                          "its owner): the operator never takes it over, writes nothing, and retries with backoff"}
_PROBES = {"MetricsDisabled": "spec.metrics.enabled is false: no exporter to ask",
           "ProbesDisabled": "the operator does not probe exporters (operator setting probeExporters: false)"}

CONDITIONS: tuple[ConditionType, ...] = (
    ConditionType("Ready", "Every replica runs the newest pod template and is ready.", {
        **_COMMON,
        "AllReplicasReady": "every replica is ready and up to date",
        "Unschedulable": "a pod cannot be placed on any node",
        "PodsFailing": "a pod failed, or a container waits in a state that does "
                       "not heal (CrashLoopBackOff, ImagePullBackOff, ...)",
        "RollingOut": "the StatefulSet is rolling the new pod template out",
        "ReplicasNotReady": "replicas are starting (weights download, engine start-up)",
        "RouterNotReady": "every replica is ready but the router in front "
                          "of them (spec.routing) is not available yet"}),
    ConditionType("ConfigValid", "The spec was accepted (parsed, planned and rendered); "
                                 "its message carries the planner's warnings.", {
        "Valid": "the spec is valid (warnings, if any, in the message)",
        INVALID_SPEC: "the spec is refused: the message names the field and what is allowed",
        APPLY_REFUSED: _COMMON[APPLY_REFUSED], NAME_CONFLICT: _COMMON[NAME_CONFLICT]}),
    ConditionType("Scheduled", "Every pod is bound to a node.", {
        **_COMMON,
        "AllPodsScheduled": "every pod is on a node",
        "NoReplicas": "spec.replicas is 0",
        "Unschedulable": "kube-scheduler cannot place a pod (its message says why)",
        "PodsPending": "pods wait for a node, or are not created yet"}),
    # Each backend adds its own proven / idle reasons (backends/, Backend.reasons; docs/backends.md).
    ConditionType("OffloadActive", "The pods' exporters prove the offload backend serves prompt tokens "
                                   "(kvoffload_offload_active).", {
        **_COMMON, **_PROBES,
        "EngineNotReady": "the engine is not ready yet",
        "ExporterUnreachable": "no exporter answered",
        "ExternalHitsNotLoaded": "vLLM skipped prefill for KV that LMCache never loaded: answers are wrong"}),
    ConditionType("EngineVerified", "The pods run the vLLM / LMCache pair the "
                                    "operator rendered for (kvoffload_engine_info).", {
        **_COMMON, **_PROBES,
        "EngineVersionsMatch": "every reporting pod runs the rendered pair",
        "EngineVersionMismatch": "a pod runs another pair than the one rendered for",
        "VersionsNotReported": "no pod's exporter reported its versions yet"}),
    ConditionType("DiskTierReady", "The disk tier's per-pod directories are prepared on their nodes: emptied, or "
                                   "kept where the engine reads them again and the disk fingerprint is unchanged.", {
        **_COMMON,
        "NotConfigured": "spec.offload.disk is not set: CPU tier only",
        "DirectoriesPrepared": "every pod's directory is prepared, each emptied (the message says why)",
        "DirectoriesKept": "every pod's directory is prepared, and at least one kept the files of the pod before it "
                           "(the same resource and disk fingerprint): that replica starts warm",
        "Preparing": "pod directories are being prepared"}),
    ConditionType("SharedCacheReady", "spec.offload.server PerNode: every node that runs replicas of this resource "
                                      "has its shared LMCache server ready (one server pod per node, shared by the "
                                      "replicas there).", {
        **_COMMON,
        "NotConfigured": "spec.offload.server is not PerNode: each replica keeps its own tiers",
        "NoReplicasPlaced": "no replica is bound to a node yet: no server is needed",
        "ServersReady": "every node with a replica has its server ready (the message lists them, and the servers kept "
                        "without replicas until their grace period ends)",
        "ServersNotReady": "a node with a replica has no ready server (being created, starting, or gone): a replica "
                           "starting there waits for it; one running serves without the shared tier (requests "
                           "answered, nothing reused) until it is back"}),
    ConditionType("RouterReady",
                  "The router in front of the replicas (spec.routing) is available and routes to them.", {
        **_COMMON,
        "NotConfigured": "spec.routing is not set (or enabled is false): clients call the serving Service",
        "RouterAvailable": "every router pod is ready and runs the newest template",
        "RouterNotReady": "router pods are starting, rolling out, or wait for a ready serving pod (/readiness)"}),
    ConditionType("AutoscalingReady", "The autoscaler spec.autoscaling renders can read its metrics: the API server "
                                      "serves what it needs (discovery, read at start and on every resync).", {
        **_COMMON,
        "NotConfigured": "spec.autoscaling is not set: spec.replicas is yours",
        "MetricsServed": "autoscaler hpa: the custom metrics API is served "
                         "and lists every Pods metric the targets read",
        "NoCustomMetricsAdapter": "autoscaler hpa: no APIService serves "
                                  "custom.metrics.k8s.io, so the HPA sits at <unknown>",
        "CustomMetricsUnavailable": "autoscaler hpa: the custom metrics APIService "
                                    "is registered but its server is not Available",
        "MetricsNotServed": "autoscaler hpa: the metrics adapter serves no "
                            "Pods metric of that name (its rules lack one)",
        "KedaServed": "autoscaler keda: ScaledObjects and the external metrics API (KEDA's metrics server) are served",
        "KedaNotInstalled": "autoscaler keda: the API server serves no keda.sh/v1alpha1 ScaledObject",
        "KedaMetricsUnavailable": "autoscaler keda: the external metrics API that KEDA's HPA reads is not served",
        "DiscoveryPending": "the operator has not read the API server's discovery yet"}),
    ConditionType("Reconciling", "True while a valid spec is not yet Ready (kstatus, read by Helm --wait and Flux); "
                                 "its reason is Ready's.", {
        "Converged": "Ready is True",
        "Stalled": "the spec is refused: nothing to converge to until it changes"}),
    ConditionType("Stalled", "True while the spec cannot be acted on (kstatus); its reason is ConfigValid's.", {
        "SpecAccepted": "the spec can be acted on",
        **_COMMON}),
)
BY_TYPE = {c.type: c for c in CONDITIONS}
TYPES = tuple(BY_TYPE)


def reasons(type_: str) -> set[str]:
    """Every reason `type_` may carry; Reconciling also carries Ready's (it mirrors Ready while converging)."""
    own = set(BY_TYPE[type_].reasons)
    return own | set(BY_TYPE["Ready"].reasons) if type_ == "Reconciling" else own


def summary() -> str:
    """One line per condition, for the CRD's description of status.conditions and the chart's NOTES."""
    return "; ".join(f"{c.type}: {c.description}" for c in CONDITIONS)
