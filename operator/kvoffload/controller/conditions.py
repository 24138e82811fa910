"""observe: conditions and status as a pure function of what was read from the cluster.

Kubernetes API conventions: type/status/reason/message/lastTransitionTime/observedGeneration;
lastTransitionTime only moves when status changes; the full list is always written.

Reconciling and Stalled are the two conditions kstatus reads (Helm v4 `--wait`, Flux, Config Sync),
derived from the others so they can never disagree: Stalled=True exactly when the spec cannot be
acted on (ConfigValid=False, with its reason), Reconciling=True while a valid spec is not yet Ready.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from .. import backends
from ..api import crd, pod_status
from ..api.conditions import INVALID_SPEC, reasons
from ..api.errors import ConfigError
from ..api.quantity import format_bytes
from ..engine import versions as engine_versions
from ..planning import routing as plan_routing
from ..rendering import autoscaling, disk_tier, render, shared_cache
from ..rendering import routing as render_routing
from .discovery import NOT_REGISTERED, SERVED, AutoscalingApis
from .pipeline import Desired
from .probe import Probes, Reading

# Container states that do not heal by waiting: the pod needs a new image, config or node.
FAILING = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
           "CreateContainerError", "RunContainerError")


_BACKEND_REASONS = {"OffloadActive": {r for b in backends.REGISTRY.values()
                                      for r in (b.reasons.active, b.reasons.idle)}}


@dataclass(frozen=True)
class Cond:
    type: str
    status: str  # True | False | Unknown
    reason: str
    message: str

    def __post_init__(self) -> None:
        # Every type and reason is declared once: in api/conditions.py (the CRD text and the chart's NOTES read it),
        # and each backend's OffloadActive reasons in its module.
        if self.reason not in reasons(self.type) | _BACKEND_REASONS.get(self.type, set()):
            raise ValueError(f"condition {self.type} reason {self.reason!r} "
                             "is not declared in kvoffload.api.conditions")


@dataclass(frozen=True)
class Observed:
    """What the reconciler read after applying: the StatefulSet and its pods (None/[] if absent)."""
    statefulset: dict[str, Any] | None
    pods: list[dict[str, Any]]
    probes: Probes | None = None  # running pod -> its exporter's answer, or an error; None: not probed
    # The HorizontalPodAutoscaler that decides (ours or KEDA's), with spec.autoscaling.
    hpa: dict[str, Any] | None = None
    router: dict[str, Any] | None = None  # the router's Deployment, with spec.routing
    apis: AutoscalingApis | None = None  # what the API server serves for autoscaling (discovery.py); None: not read yet
    servers: tuple[dict[str, Any], ...] = ()  # PerNode: the shared servers' Deployments, as read


def now_iso(clock: datetime | None = None) -> str:
    return (clock or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unschedulable(pods: list[dict[str, Any]]) -> list[tuple[str, str]]:
    out = []
    for pod in pods:
        c = pod_status.condition(pod, "PodScheduled")
        if c and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            out.append((pod["metadata"]["name"], c.get("message", "")))
    return out


def _failing(pods: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(pod, why) for pods that failed or whose containers wait in a state that does not heal by itself."""
    out = []
    for pod in pods:
        st = pod.get("status", {}) or {}
        if st.get("phase") == "Failed":
            why = f"pod failed: {st.get('reason') or ''} {st.get('message') or ''}".strip()
            out.append((pod["metadata"]["name"], why))
            continue
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in FAILING:
                # Why the last run ended (OOMKilled, Error) is what a crash loop's reader needs first.
                last = (cs.get("lastState") or {}).get("terminated") or {}
                ended = f" after {last.get('reason') or 'exit'} (exit code {last.get('exitCode')})" if last else ""
                out.append((pod["metadata"]["name"], f"container {cs.get('name')}: {waiting['reason']}{ended}"
                            + (f" ({waiting['message']})" if waiting.get("message") else "")))
                break
    return out


def rolled_out(sts: dict[str, Any] | None, replicas: int) -> bool:
    """The StatefulSet controller has seen the newest template and every pod runs it and is ready."""
    if not sts:
        return False
    st = sts.get("status", {}) or {}
    return (st.get("observedGeneration", 0) >= sts["metadata"].get("generation", 1)
            and st.get("updateRevision", "") == st.get("currentRevision", st.get("updateRevision", ""))
            and (st.get("updatedReplicas") or 0) == replicas
            and (st.get("readyReplicas") or 0) == replicas
            and (st.get("replicas") or 0) == replicas)


def _scheduled(replicas: int, pods: list[dict[str, Any]]) -> Cond:
    stuck = _unschedulable(pods)
    if stuck:
        name, msg = stuck[0]
        return Cond("Scheduled", "False", "Unschedulable", f"{len(stuck)} pod(s) cannot be placed; {name}: {msg}")
    bound = sum(1 for p in pods if p.get("spec", {}).get("nodeName"))
    if replicas == 0:
        return Cond("Scheduled", "True", "NoReplicas", "spec.replicas is 0")
    if bound >= replicas:
        nodes = sorted({p["spec"]["nodeName"] for p in pods if p.get("spec", {}).get("nodeName")})
        return Cond("Scheduled", "True", "AllPodsScheduled", f"{bound}/{replicas} pods on nodes {', '.join(nodes)}")
    missing = replicas - len(pods)
    hint = (f"; {missing} pod(s) not created yet: the StatefulSet's events say why "
            "(a hostPath disk tier in a namespace at Pod Security baseline or restricted is refused: "
            "FailedCreate ... violates PodSecurity)") if missing > 0 else ""
    return Cond("Scheduled", "Unknown", "PodsPending", f"{bound}/{replicas} pods bound to a node{hint}")


def _ready(replicas: int, obs: Observed, scheduled: Cond) -> Cond:
    st = (obs.statefulset or {}).get("status", {}) or {}
    ready = st.get("readyReplicas") or 0
    if rolled_out(obs.statefulset, replicas):
        return Cond("Ready", "True", "AllReplicasReady", f"{ready}/{replicas} replicas ready and up to date")
    if scheduled.status == "False":
        return Cond("Ready", "False", "Unschedulable", scheduled.message)
    failing = _failing(obs.pods)
    if failing:
        return Cond("Ready", "False", "PodsFailing", f"{len(failing)} pod(s) failing; {failing[0][0]}: {failing[0][1]}")
    updated = st.get("updatedReplicas") or 0
    if obs.statefulset and st.get("observedGeneration", 0) < obs.statefulset["metadata"].get("generation", 1):
        # Its replica counts are about the old template until the StatefulSet controller has seen the new one.
        return Cond("Ready", "False", "RollingOut", f"new pod template applied, not yet picked up by the StatefulSet "
                                                    f"controller; {ready}/{replicas} replicas ready")
    if obs.statefulset and updated < replicas:
        return Cond("Ready", "False", "RollingOut", f"{updated}/{replicas} replicas updated, {ready} ready")
    return Cond("Ready", "False", "ReplicasNotReady", f"{ready}/{replicas} replicas ready")


def router_available(deployment: dict[str, Any] | None, replicas: int) -> bool:
    """The Deployment controller has seen the newest template and every router pod runs it and is ready."""
    if not deployment:
        return False
    st = deployment.get("status", {}) or {}
    return (st.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 1)
            and (st.get("updatedReplicas") or 0) == replicas and (st.get("availableReplicas") or 0) >= replicas
            and (st.get("replicas") or 0) == replicas)


def _router(desired: Desired, obs: Observed) -> Cond:
    routing = desired.spec.routing
    if routing is None:
        return Cond("RouterReady", "False", "NotConfigured",
                    "spec.routing is not set: clients call the serving Service, "
                    "which spreads requests over the replicas at random")
    what = f"vllm-router, policy {routing.policy}" + (" (auto)" if routing.requested == "auto" else "")
    if routing.policy == "kv_aware":
        what += f", KV events of {len(desired.workers)}/{desired.spec.replicas} replicas indexed"
    st = (obs.router or {}).get("status", {}) or {}
    ready = st.get("readyReplicas") or 0
    if router_available(obs.router, routing.replicas):
        return Cond("RouterReady", "True", "RouterAvailable", f"{ready}/{routing.replicas} router pods ready ({what})")
    why = next((c.get("message", "") for c in st.get("conditions") or [] if c.get("status") != "True"), "")
    waits = ("; its /readiness answers 503 until a serving pod is healthy"
             if desired.spec.replicas == 0 or ready == 0 else "")
    return Cond("RouterReady", "False", "RouterNotReady",
                f"{ready}/{routing.replicas} router pods ready ({what}){waits}" + (f"; {why}" if why else ""))


def ready_servers(servers: tuple[dict[str, Any], ...]) -> set[str]:
    """The nodes whose shared server (a Deployment of one pod) has its pod ready."""
    out = set()
    for d in servers:
        node = ((d.get("metadata") or {}).get("annotations") or {}).get(shared_cache.NODE_ANNOTATION)
        if node and ((d.get("status") or {}).get("readyReplicas") or 0) >= 1:
            out.add(node)
    return out


def _shared(desired: Desired, servers: tuple[dict[str, Any], ...]) -> Cond:
    t = "SharedCacheReady"
    if not desired.spec.offload.shared:
        return Cond(t, "False", "NotConfigured", "spec.offload.server is not PerNode: each replica keeps its own tiers")
    b = desired.budget
    active = sorted(n.name for n in desired.nodes if not n.idle_since)
    idle = [f"{n.name} (no replica since {n.idle_since})" for n in desired.nodes if n.idle_since]
    what = (f"one LMCache server per node ({format_bytes(b.tier('cpu').bytes)} L1"
            + (f", {format_bytes(b.tier('disk').bytes)} L2" if b.tier("disk").bytes else "")
            + f", request = limit {format_bytes(b.server_memory)}), reached at {desired.spec.offload.shared_address}")
    kept = f"; kept until their grace period ends: {', '.join(idle)}" if idle else ""
    if not active:
        return Cond(t, "False", "NoReplicasPlaced", f"no replica is bound to a node yet: {what}{kept}")
    up = ready_servers(servers)
    missing = [n for n in active if n not in up]
    said = f"{len(active) - len(missing)}/{len(active)} node(s) with replicas have their server ready: {what}{kept}"
    if missing:
        return Cond(t, "False", "ServersNotReady",
                    f"{said}; not ready on {', '.join(missing)}: replicas starting there wait for it, running ones "
                    "serve without the shared tier (requests answered, nothing reused) until it is back")
    return Cond(t, "True", "ServersReady", f"{said} ({', '.join(active)})")


def _disk(desired: Desired, pods: list[dict[str, Any]], servers: tuple[dict[str, Any], ...] = ()) -> Cond:
    disk = desired.spec.offload.disk
    if not disk:
        return Cond("DiskTierReady", "False", "NotConfigured", "spec.offload.disk is not set: CPU tier only")
    if desired.spec.offload.shared:
        # The L2 is each node's shared server's; its init step keeps or empties it by the disk fingerprint.
        where = f"hostPath {disk.path}/<namespace>/<name>/{shared_cache.server_dir('<name>')} on each node"
        active = {n.name for n in desired.nodes if not n.idle_since}
        up = ready_servers(servers) & active
        if active and up == active:
            return Cond("DiskTierReady", "True", "DirectoriesPrepared",
                        f"{format_bytes(desired.budget.tier('disk').bytes)} per node on {where} (the shared server's "
                        f"L2, kept or emptied at server start by the disk fingerprint); {len(up)} prepared")
        return Cond("DiskTierReady", "False", "Preparing",
                    f"{len(up)}/{len(active)} shared servers' directories prepared on {where}")
    where = (f"hostPath {disk.path}/<namespace>/<name>/<pod>" if disk.path
             else f"ephemeral volume ({disk.storage_class})")
    keeps = disk_tier.reusable(desired.spec, desired.budget, backends.get(desired.spec.offload.backend)) is not None
    start = "kept or emptied at pod start by the disk fingerprint" if keeps else "emptied at every pod start"
    cleanup = (f"{start}; node directories are left in place when the resource is deleted "
               "(remove them with the node cleaner, see docs)" if disk.reclaim_policy == "Delete"
               else "reclaimPolicy Retain: kept")
    initialized = [p for p in pods if (pod_status.condition(p, "Initialized") or {}).get("status") == "True"]
    replicas = desired.spec.replicas
    if replicas and len(initialized) >= replicas:
        reports = {p["metadata"]["name"]: disk_report(p) for p in initialized}
        kept = sorted(n for n, r in reports.items() if r.get("disk") == "kept")
        return Cond("DiskTierReady", "True", "DirectoriesKept" if kept else "DirectoriesPrepared",
                    f"{format_bytes(desired.budget.tier('disk').bytes)} per replica on {where}; "
                    f"{len(initialized)}/{replicas} pod directories {cleanup}" + _kept_or_emptied(reports))
    return Cond("DiskTierReady", "False", "Preparing",
                f"{len(initialized)}/{replicas} pod directories prepared on {where}")


def disk_report(pod: dict[str, Any]) -> dict[str, Any]:
    """What the disk-tier init container reported (kept or emptied, and why: node/disk_prepare.py), from the
    termination message kubelet copied into the pod's status; {} when there is none (an older operator's pod)."""
    for st in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if st.get("name") == render.DISK_INIT:
            done = (st.get("state") or {}).get("terminated") or (st.get("lastState") or {}).get("terminated") or {}
            try:
                body = json.loads(done.get("message") or "")
            except ValueError:
                return {}
            return body if isinstance(body, dict) else {}
    return {}


def _kept_or_emptied(reports: dict[str, dict[str, Any]]) -> str:
    said = [f"{pod} {r['disk']}" + (f" ({format_bytes(int(r.get('keptBytes') or 0))})" if r["disk"] == "kept" else "")
            + f": {str(r.get('why', '')).partition(': ')[2] or r.get('why', '')}"
            for pod, r in sorted(reports.items()) if r.get("disk") in ("kept", "emptied")]
    return ("; " + "; ".join(said)) if said else ""


def _offload(desired: Desired, ready: Cond, pods: list[dict[str, Any]], probes: Probes | None) -> Cond:
    b = desired.budget
    r = backends.get(desired.spec.offload.backend).reasons
    connector, active_reason, idle_reason, proof, missing = r.connector, r.active, r.idle, r.proof, r.missing
    tiers = f"CPU {format_bytes(b.tier('cpu').bytes)}" + (
        f", disk {format_bytes(b.tier('disk').bytes)}" if desired.spec.offload.disk else "")
    configured = f"{connector} configured ({tiers})"
    if not desired.spec.metrics_enabled:
        return Cond("OffloadActive", "Unknown", "MetricsDisabled", f"{configured}; enable spec.metrics for proof")
    if ready.status != "True":
        return Cond("OffloadActive", "Unknown", "EngineNotReady", f"{configured}; engine not ready yet")
    if probes is None:
        return Cond("OffloadActive", "Unknown", "ProbesDisabled",
                    f"{configured}; the operator does not probe exporters (probeExporters: false): "
                    "read kvoffload_offload_active")
    ready_pods = {p["metadata"]["name"] for p in pods if pod_status.ready(p)}
    probes = {pod: v for pod, v in probes.items() if pod in ready_pods}
    failed = sorted((pod, v) for pod, v in probes.items() if isinstance(v, str))
    idle = sorted(pod for pod, v in probes.items() if isinstance(v, Reading) and v.active < 1)
    unloaded = sorted((pod, v.unloaded) for pod, v in probes.items() if isinstance(v, Reading) and v.unloaded > 0)
    if not probes or len(failed) == len(probes):
        detail = f"; {failed[0][0]}: {failed[0][1]}" if failed else ""
        return Cond("OffloadActive", "Unknown", "ExporterUnreachable", f"{configured}; no exporter answered{detail}")
    if unloaded:
        pod, tokens = unloaded[0]
        engine = desired.spec.engine
        return Cond("OffloadActive", "False", "ExternalHitsNotLoaded",
                    f"{len(unloaded)}/{len(probes)} pods skip prefill for KV that LMCache never loaded "
                    f"({pod}: vLLM counted {tokens:,.0f} prompt tokens as loaded from LMCache, "
                    "vllm:external_prefix_cache_hits_total, "
                    "while LMCache retrieved nothing, lmcache:num_retrieve_requests_total 0): "
                    "answers for those prompts are wrong. "
                    f"Rendered for vLLM {engine.vllm_version} + LMCache {engine.lmcache_version}; "
                    "vLLM 0.26.0's V2 model runner does this "
                    "(the operator renders VLLM_USE_V2_MODEL_RUNNER=0 for the pairs it knows need it). "
                    "Check that the image holds the rendered pair (EngineVerified) "
                    "and the vllm container's environment; "
                    "for an image the operator does not know, report the pair (docs/compatibility.md)")
    if idle:
        return Cond("OffloadActive", "False", idle_reason,
                    f"{len(idle)}/{len(probes)} pods show no offload activity ({', '.join(idle[:3])}): {missing}; "
                    "normal before the first requests, "
                    "while vLLM serves traffic it means offloading is not wired (see troubleshooting)")
    active = len(probes) - len(failed)
    return Cond("OffloadActive", "True", active_reason,
                f"{configured}; {proof} on {active}/{len(probes)} pods" +
                (f" ({len(failed)} exporters unreachable)" if failed else ""))


def _pair(vllm: str, lmcache: str) -> str:
    return f"vLLM {vllm} + LMCache {lmcache}" if lmcache else f"vLLM {vllm} (no LMCache)"


def _engine(desired: Desired, probes: Probes | None) -> Cond:
    """Do the pods run the vLLM / LMCache pair the operator rendered for? From each pod's exporter
    (kvoffload_engine_info, written by the serving image's init container)."""
    e = desired.spec.engine
    rendered = f"rendered for {_pair(e.vllm_version, e.lmcache_version)}"
    if not desired.spec.metrics_enabled:
        return Cond("EngineVerified", "Unknown", "MetricsDisabled",
                    f"{rendered}; enable spec.metrics to see what the pods run")
    if probes is None:
        return Cond("EngineVerified", "Unknown", "ProbesDisabled",
                    f"{rendered}; the operator does not probe exporters (probeExporters: false): "
                    "read kvoffload_engine_info")
    reported = {pod: v.engine for pod, v in sorted(probes.items()) if isinstance(v, Reading) and v.engine}
    def runs_rendered(found: dict[str, str]) -> bool:
        if not engine_versions.matches(e.vllm_version, found.get("vllm", engine_versions.NOT_INSTALLED)):
            return False
        # vllm-native with a plain vLLM image: no LMCache to compare
        return not e.lmcache_version or engine_versions.matches(
            e.lmcache_version, found.get("lmcache", engine_versions.NOT_INSTALLED))

    wrong = [(pod, found) for pod, found in reported.items() if not runs_rendered(found)]
    if wrong:
        pod, found = wrong[0]
        more = f" ({len(wrong) - 1} more pods differ)" if len(wrong) > 1 else ""
        return Cond("EngineVerified", "False", "EngineVersionMismatch",
                    f"{rendered}, pod {pod} runs {_pair(found.get('vllm', '?'), found.get('lmcache', '?'))}{more}; "
                    "set spec.engine.vllmVersion/lmcacheVersion to what the image holds, "
                    "or use an image with the rendered pair")
    if not reported:
        failed = sorted((pod, v) for pod, v in probes.items() if isinstance(v, str))
        detail = f"; {failed[0][0]}: {failed[0][1]}" if failed else ""
        return Cond("EngineVerified", "Unknown", "VersionsNotReported",
                    f"{rendered}; no pod's exporter reported its versions yet{detail}")
    return Cond("EngineVerified", "True", "EngineVersionsMatch",
                f"{len(reported)}/{len(probes)} pods run {_pair(e.vllm_version, e.lmcache_version)}, "
                "the pair the operator rendered for")


def running_versions(probes: Probes | None) -> list[dict[str, Any]]:
    """status.versions.running: each distinct (vllm, lmcache, torch) the pods reported, with its pods."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for pod, v in sorted((probes or {}).items()):
        if isinstance(v, Reading) and v.engine:
            key = tuple(v.engine.get(name, "") for name in engine_versions.PACKAGES)
            groups.setdefault(key, []).append(pod)  # type: ignore[arg-type]
    return [{**dict(zip(engine_versions.PACKAGES, key)), "podCount": len(pods), "pods": pods[:crd.MAX_VERSION_PODS]}
            for key, pods in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]


def progress(ready: Cond, valid: Cond) -> list[Cond]:
    """Reconciling and Stalled (kstatus' abnormal-true pair) from Ready and ConfigValid."""
    if valid.status == "False":
        return [Cond("Reconciling", "False", "Stalled", "nothing to converge to until the spec changes"),
                Cond("Stalled", "True", valid.reason, valid.message)]
    stalled = Cond("Stalled", "False", "SpecAccepted", "the spec can be acted on")
    if ready.status == "True":
        return [Cond("Reconciling", "False", "Converged", ready.message), stalled]
    return [Cond("Reconciling", "True", ready.reason, ready.message), stalled]


def evaluate(desired: Desired | None, error: ConfigError | None, obs: Observed) -> list[Cond]:
    if error is not None or desired is None:
        msg = str(error) if error else "not evaluated"
        why = getattr(error, "reason", INVALID_SPEC)  # reconcile.Refused: a valid spec whose children cannot be written
        ready, valid = Cond("Ready", "False", why, msg), Cond("ConfigValid", "False", why, msg)
        return [ready, valid,
                Cond("Scheduled", "Unknown", why, "no children created or changed while the spec is invalid"
                     if why == INVALID_SPEC else "not evaluated while a child cannot be written"),
                *(Cond(t, "Unknown", why, msg)
                  for t in ("OffloadActive", "EngineVerified", "DiskTierReady", "SharedCacheReady", "RouterReady",
                            "AutoscalingReady")),
                *progress(ready, valid)]
    replicas = desired.spec.replicas
    scheduled = _scheduled(replicas, obs.pods)
    ready, router = _ready(replicas, obs, scheduled), _router(desired, obs)
    # Clients call the router: Ready waits for it.
    if ready.status == "True" and router.reason == "RouterNotReady" and replicas:
        ready = Cond("Ready", "False", "RouterNotReady", f"{ready.message}; router: {router.message}")
    warnings = "; ".join(desired.budget.warnings)
    valid = Cond("ConfigValid", "True", "Valid", "spec is valid" + (f"; warnings: {warnings}" if warnings else ""))
    return [ready, valid, scheduled, _offload(desired, ready, obs.pods, obs.probes), _engine(desired, obs.probes),
            _disk(desired, obs.pods, obs.servers), _shared(desired, obs.servers), router,
            autoscaling_ready(desired, obs.apis), *progress(ready, valid)]


_ADAPTER_FIX = ("install a custom-metrics adapter with the rules in docs/autoscaling.md (prometheus-adapter), or "
                "install KEDA and set the operator's autoscaler to auto or keda (then restart the operator)")


def autoscaling_ready(desired: Desired, apis: AutoscalingApis | None) -> Cond:
    """AutoscalingReady: can the autoscaler that desired.autoscaler names read its metrics (pure, from discovery)."""
    t = "AutoscalingReady"
    a = desired.spec.autoscaling
    if a is None:
        return Cond(t, "True", "NotConfigured", "spec.autoscaling is not set")
    if apis is None:
        return Cond(t, "Unknown", "DiscoveryPending", "the operator has not read the API server's discovery yet")
    if desired.autoscaler == "keda":
        if apis.keda.state != SERVED or "scaledobjects" not in apis.keda.resources:
            return Cond(t, "False", "KedaNotInstalled",
                        "the operator's autoscaler is keda but the API server serves no keda.sh/v1alpha1 ScaledObject: "
                        "install KEDA (its CRDs and operator) and restart the operator")
        em = apis.external_metrics
        if em.state != SERVED:
            why = em.state + (f" ({em.detail})" if em.detail else "")
            return Cond(t, "False", "KedaMetricsUnavailable",
                        f"KEDA's HorizontalPodAutoscaler reads external.metrics.k8s.io, which is {why}: "
                        "is KEDA's metrics server (keda-operator-metrics-apiserver) running "
                        "and its APIService v1beta1.external.metrics.k8s.io Available?")
        return Cond(t, "True", "KedaServed", "KEDA's ScaledObject and the external metrics API are served")
    cm = apis.custom_metrics
    if cm.state == NOT_REGISTERED:
        return Cond(t, "False", "NoCustomMetricsAdapter",
                    "the operator's autoscaler is hpa but no APIService serves custom.metrics.k8s.io/v1beta1, "
                    f"so the HorizontalPodAutoscaler cannot read its Pods metrics: {_ADAPTER_FIX}")
    if cm.state != SERVED:
        return Cond(t, "False", "CustomMetricsUnavailable",
                    "the APIService v1beta1.custom.metrics.k8s.io is registered "
                    f"but not Available ({cm.detail or cm.state}): check the adapter's pods and Service")
    missing = [m for m in (autoscaling.TARGETS[f].adapter_metric for f in a.targets) if f"pods/{m}" not in cm.resources]
    if missing:
        return Cond(t, "False", "MetricsNotServed",
                    f"the custom metrics adapter serves no Pods metric {', '.join(missing)}: "
                    "add its rule (docs/autoscaling.md, autoscaler hpa) and make Prometheus scrape vLLM's /metrics")
    return Cond(t, "True", "MetricsServed", "the custom metrics API serves every metric the targets read")


def merge(previous: list[dict[str, Any]] | None, new: list[Cond], generation: int,
          clock: datetime | None = None) -> list[dict[str, Any]]:
    """Conditions as API objects; keep lastTransitionTime where status did not change."""
    before = {c.get("type"): c for c in previous or []}
    out = []
    for c in new:
        old = before.get(c.type)
        since = (old["lastTransitionTime"] if old and old.get("status") == c.status and old.get("lastTransitionTime")
                 else now_iso(clock))
        out.append({"type": c.type, "status": c.status, "reason": c.reason, "message": c.message[:32768],
                    "lastTransitionTime": since, "observedGeneration": generation})
    return out


def status(body: dict[str, Any], desired: Desired | None, error: ConfigError | None, obs: Observed,
           clock: datetime | None = None) -> dict[str, Any]:
    """The whole status for `body`, derived only from its inputs."""
    meta, previous = body["metadata"], body.get("status") or {}
    generation = meta.get("generation", 1)
    conds = evaluate(desired, error, obs)
    out: dict[str, Any] = {"conditions": merge(previous.get("conditions"), conds, generation, clock)}
    sts_status = (obs.statefulset or {}).get("status", {}) or {}
    out["replicas"] = sts_status.get("replicas") or 0
    out["readyReplicas"] = sts_status.get("readyReplicas") or 0
    out["selector"] = f"{render.OWNER_LABEL}={meta['name']}"
    if desired is None:
        out["observedGeneration"] = generation  # nothing to roll out: the verdict is about this generation
        for key in ("endpoint", "versions", "summary", "budget", "routing"):
            if key in previous:
                out[key] = previous[key]
        return out
    rolled = desired.spec.replicas == 0 or rolled_out(obs.statefulset, desired.spec.replicas)
    # observedGeneration lags until the generation's children are applied and rolled out.
    out["observedGeneration"] = generation if rolled else previous.get("observedGeneration", 0)
    b = desired.budget
    out["endpoint"] = render.endpoint(render.Owner(meta["name"], meta["namespace"]), desired.spec)
    engine = desired.spec.engine
    out["versions"] = {"image": engine.image,
                       "renderedFor": {"vllm": engine.vllm_version, "lmcache": engine.lmcache_version},
                       "running": running_versions(obs.probes)}
    out["summary"] = {"gpuTokens": b.tier("gpu").tokens, "cpuTokens": b.tier("cpu").tokens,
                      "diskTokens": b.tier("disk").tokens, "memory": format_bytes(b.memory_limit)}
    if b.server_memory:
        out["summary"]["serverMemory"] = format_bytes(b.server_memory)
        out["summary"]["serverMemoryLimit"] = format_bytes(b.server_memory_limit)
    out["budget"] = b.to_dict()
    if desired.spec.autoscaling is not None:
        out["autoscaling"] = autoscaler_status(desired, meta["name"], obs.hpa)
    if desired.spec.routing is not None:
        out["routing"] = routing_status(desired, meta["name"], obs.router)
    return out


def routing_status(desired: Desired, name: str, deployment: dict[str, Any] | None) -> dict[str, Any]:
    """status.routing: the policy the router runs and the figures it was given (docs/routing.md)."""
    routing = desired.spec.routing
    assert routing is not None
    out: dict[str, Any] = {"policy": routing.policy, "deployment": render_routing.name(name),
                           "readyReplicas": ((deployment or {}).get("status") or {}).get("readyReplicas") or 0,
                           "credits": plan_routing.credits(desired.budget)}
    if desired.max_tree_size is not None:  # cache_aware: the tree budget the router was rendered with
        out["maxTreeSize"] = desired.max_tree_size
    if routing.policy == "kv_aware":
        out["eventTiers"] = list(backends.get(desired.spec.offload.backend).event_tiers)
        out["workers"] = len(desired.workers)
    if desired.unseen_tiers:
        out["unseenTiers"] = list(desired.unseen_tiers)
    return out


# The HPA's conditions, most telling first: the first one that is not True says why it does not (or cannot) act;
# else ScalingLimited=True says it is held at a bound; else ScalingActive says what it computed from.
_HPA_CONDITIONS = ("AbleToScale", "ScalingActive")


def autoscaler_status(desired: Desired, name: str, hpa: dict[str, Any] | None) -> dict[str, Any]:
    """status.autoscaling: what the HorizontalPodAutoscaler wants and why, from its status (pure)."""
    a = desired.spec.autoscaling
    assert a is not None
    keda = desired.autoscaler == "keda"
    targets = list(a.targets) + (["wakeQuery"] if a.wake_query else [])
    out: dict[str, Any] = {"autoscaler": "keda" if keda else "hpa"}
    if hpa is None:
        return {**out, "reason": "AutoscalerNotFound", "message": "no HorizontalPodAutoscaler yet"
                + (" (KEDA makes keda-hpa-" + name + " from the ScaledObject: is the KEDA operator running?)"
                   if out["autoscaler"] == "keda" else "")}
    st = hpa.get("status") or {}
    out["horizontalPodAutoscaler"] = hpa["metadata"]["name"]
    out["currentReplicas"] = st.get("currentReplicas") or 0
    out["desiredReplicas"] = st.get("desiredReplicas") or 0
    if st.get("lastScaleTime"):
        out["lastScaleTime"] = st["lastScaleTime"]
    metrics = []
    for i, m in enumerate(st.get("currentMetrics") or []):
        if i >= len(targets):
            break
        value = ((m.get(m.get("type", "").lower() or "external") or {}).get("current") or {})
        current = value.get("averageValue") or value.get("value")
        spec_value = a.targets.get(targets[i], a.targets.get("waitingRequestsPerReplica", 1))
        # KEDA's queries give the target's unit; an adapter's Pods metric gives the metric's own (a ratio for percents).
        scale = 1 if keda or targets[i] == "wakeQuery" else autoscaling.TARGETS[targets[i]].unit_scale
        metrics.append({"target": targets[i], "current": _in_unit(current, scale), "want": str(spec_value)})
    out["metrics"] = metrics
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    wants = f"wants {out['desiredReplicas']} replicas (has {out['currentReplicas']})"
    if metrics:
        wants += ": " + ", ".join(f"{m['target']} {m['current']} (target {m['want']})" for m in metrics)
    for t in _HPA_CONDITIONS:
        c = conds.get(t)
        if c and c.get("status") != "True":
            return {**out, "reason": c.get("reason", t), "message": f"{wants}; {t}=False: {c.get('message', '')}"}
    limited = conds.get("ScalingLimited")
    chosen = limited if limited and limited.get("status") == "True" else conds.get("ScalingActive")
    if chosen is None:
        return {**out, "reason": "NotComputedYet",
                "message": f"{wants}; the HorizontalPodAutoscaler has not computed yet"}
    return {**out, "reason": chosen.get("reason", ""), "message": f"{wants}; {chosen.get('message', '')}"}


def _in_unit(quantity: str | None, scale: int) -> str:
    """An HPA metric value (a quantity, e.g. 6667m) times `scale`, in the unit of its spec.autoscaling target."""
    if quantity is None:
        return "unknown"
    return f"{round(float(parse_quantity(quantity)) * scale, 2):g}"
