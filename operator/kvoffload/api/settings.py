"""Operator settings: what the cluster admin decides (chart values -> a YAML file -> this)."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field, fields, replace
from typing import Any

import yaml

from . import crd
from .errors import ConfigError


@dataclass(frozen=True)
class Settings:
    # hostPath roots the disk tier may live under (never the root itself).
    allowed_disk_roots: tuple[str, ...] = ("/mnt/nvme", "/var/lib/kvoffload")
    # Default serving image (engine/images.py DEFAULT_IMAGE: this layer cannot import it; tests check they agree);
    # its (vLLM, LMCache) pair comes from kvoffload.engine.images.
    default_image: str = "ghcr.io/kvoffload/vllm-lmcache:0.33.0-0.5.6"
    # Serving images the admin built or mirrored under their own names, with the pair each holds
    # ({image: {vllm: "0.33.0", lmcache: "0.5.6"}}; no lmcache: a plain vLLM image, vllm-native only).
    # The operator renders for them as for the images it knows; EngineVerified checks the pods.
    image_versions: dict[str, dict[str, str]] = field(default_factory=dict)
    # Serving images a KVOffloadServe may name (spec.engine.image), beside the ones the operator knows, defaultImage
    # and imageVersions' keys (always allowed): an exact reference ("registry.acme/vllm:0.33.0", "...@sha256:...")
    # or every image below a registry path ("registry.acme/vllm/*"). An image is what runs in the pod, so it is
    # the admin's decision: nothing else is accepted (engine/images.py allowed).
    allowed_images: tuple[str, ...] = ()
    # Names of the NVIDIA_* family (which the NVIDIA container runtime reads to add host devices and libraries to
    # the container) that spec.engine.env may set; by default none (api/managed.py ENV_PREFIXES).
    allowed_nvidia_env: tuple[str, ...] = ()
    # Image of the exporter sidecar and of the disk-tier init container: the operator's own image, which carries
    # the `kvoffload` package (images/operator/Dockerfile; the chart fills in its own image when this is empty).
    exporter_image: str = "ghcr.io/kvoffload/kvoffload:0.1.0"
    exporter_image_pull_policy: str = "IfNotPresent"
    # spec.offload.server PerNode (docs/shared-cache.md): a tmpfs directory the admin mounted on every node that may
    # run this operator's serving pods (e.g. a `mount -t tmpfs -o size=...` of its own, root-owned, mode 0755). Each
    # resource's server and serving pods on a node share <root>/<namespace>/<name> as their /dev/shm (hostPath, type
    # Directory, the rest a subPathExpr), where the server's L1 segment lives. Empty: PerNode is refused.
    shared_memory_root: str = ""
    # How long a node's shared server outlives the last of its resource's replicas there, so that a replica rescheduled
    # or scaled up on the node soon after finds it warm.
    shared_server_grace_seconds: int = 600
    # Node label (key=value) that marks nodes with local NVMe for the disk tier.
    nvme_node_label: str = "kvoffload.io/nvme=true"
    default_gpu_memory: str = "80Gi"
    # Memory-term defaults (Kubernetes quantities); each is overridable per resource.
    engine_baseline: str = "4Gi"
    per_worker_overhead: str = "2Gi"
    staging_per_worker: str = "1Gi"
    server_baseline: str = "2Gi"  # the LMCache server process of backend lmcache-server, before its CPU tier
    headroom_percent: int = 10
    # Read bandwidths (GB/s, 10^9 bytes per second) that decide whether a tier's hits are "slower than recompute": the
    # cluster's own figures belong here (and per resource in spec.offload.cpu/disk.readGbps). Defaults: one H200 host
    # (reference/h200-tier-physics.json): pinned host->GPU copy per GPU, and that host's virtual disk; a real NVMe reads
    # 3-14 GB/s. prefill_tokens_per_second: the recompute side, per replica; 0 derives it from the same host's
    # measured 32K-token prefill of an 8B Llama, scaled by parameters and TP.
    cpu_read_gbps: float = 54.847573715916525
    disk_read_gbps: float = 0.9384999892678052
    prefill_tokens_per_second: float = 0
    # Same value in every rank and replica, or LMCache chunk hashes differ (zero hits with TP > 1).
    python_hash_seed: str = "0"
    # Ask each running pod's exporter whether offloading is proven (OffloadActive) and which vLLM /
    # LMCache the image holds (EngineVerified); needs the operator to reach pod IPs on the metrics port.
    probe_exporters: bool = True
    # Seconds between level-based resyncs of every resource (also refreshes OffloadActive).
    resync_seconds: int = 300
    # Events on KVOffloadServes go through one token bucket for the whole operator, so a thousand
    # resources changing at once cost at most event_burst + events_per_second x seconds Events.
    # 0 events per second: no Events at all.
    events_per_second: float = 5
    event_burst: int = 50
    labels: dict[str, str] = field(default_factory=dict)
    # The operator's namespace (the chart sets it): a KVOffloadServe's NetworkPolicy lets it reach the
    # exporters' metrics port when probe_exporters is on.
    operator_namespace: str = ""
    # What spec.autoscaling renders: hpa (a HorizontalPodAutoscaler on Pods metrics, for clusters that run a
    # custom-metrics adapter), keda (a KEDA ScaledObject with Prometheus triggers; scale to zero), or auto: keda
    # where the API server serves KEDA's ScaledObject when the operator starts and prometheusAddress is set, else
    # hpa (resolve_autoscaler). The AutoscalingReady condition says what the chosen one lacks.
    autoscaler: str = "auto"
    # The Prometheus that KEDA's triggers query (autoscaler keda), e.g. http://prometheus.monitoring.svc:9090.
    prometheus_address: str = ""
    # spec.routing: the router's image (vLLM's router, vllm-router on PyPI; the operator renders its flags for
    # engine/router.VERSION).
    router_image: str = "ghcr.io/kvoffload/vllm-router:0.1.17"
    router_image_pull_policy: str = "IfNotPresent"
    # Where the router pods run: a nodeSelector and tolerations on every router Deployment. They need no GPU, so
    # by default none (the scheduler puts them on any node that takes them, never because of the serving pods'
    # placement); set them to keep routers on CPU nodes, or on a dedicated pool.
    router_node_selector: dict[str, str] = field(default_factory=dict)
    router_tolerations: tuple[dict[str, Any], ...] = ()

    @property
    def kvoffload_image(self) -> str:
        """The image that carries the `kvoffload` package (exporter_image): what runs the operator's own code in a
        serving pod, the exporter and the disk-tier init container, never the tenant's spec.engine.image."""
        return self.exporter_image

    def nvme_selector(self) -> dict[str, str]:
        key, _, value = self.nvme_node_label.partition("=")
        return {key: value or "true"}


_KEYS = {f.name: f for f in fields(Settings)}
_LISTS = ("allowed_disk_roots", "allowed_images", "allowed_nvidia_env")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def from_dict(data: dict[str, Any]) -> Settings:
    """Settings from the chart's camelCase keys; an unknown key is an error, not a silent default."""
    by_camel = {_camel(n): n for n in _KEYS}
    kwargs: dict[str, Any] = {}
    for key, value in (data or {}).items():
        if key not in by_camel:
            raise ConfigError(f"operator config {key}", f"unknown setting; allowed: {', '.join(sorted(by_camel))}")
        name = by_camel[key]
        kwargs[name] = tuple(value) if name in _LISTS else value
        if name == "router_tolerations" and isinstance(value, list):
            kwargs[name] = tuple(value)
    for image, pair in (kwargs.get("image_versions") or {}).items():
        if not isinstance(pair, dict) or not isinstance(pair.get("vllm"), str) or set(pair) - {"vllm", "lmcache"} \
                or not isinstance(pair.get("lmcache", ""), str):
            raise ConfigError(f"operator config imageVersions[{image!r}]",
                              f"must be {{vllm: VERSION, lmcache: VERSION}} (lmcache optional), got {pair!r}")
    for name, kind, least in (("events_per_second", (int, float), 0), ("event_burst", int, 1),
                              ("cpu_read_gbps", (int, float), 1e-6),
                              ("disk_read_gbps", (int, float), 1e-6), ("prefill_tokens_per_second", (int, float), 0)):
        value = kwargs.get(name, getattr(Settings, name))
        if isinstance(value, bool) or not isinstance(value, kind) or value < least:
            raise ConfigError(f"operator config {_camel(name)}", f"must be a number >= {least}, got {value!r}")
    _check_placement(kwargs)
    _check_shared(kwargs)
    _check_images(kwargs)
    autoscaler = kwargs.get("autoscaler", Settings.autoscaler)
    if autoscaler not in crd.AUTOSCALERS:
        raise ConfigError("operator config autoscaler", f"{autoscaler!r} is not allowed; allowed values: "
                                                        f"{', '.join(crd.AUTOSCALERS)}")
    if autoscaler == "keda" and not kwargs.get("prometheus_address"):
        raise ConfigError("operator config prometheusAddress",
                          "is required with autoscaler keda (the Prometheus KEDA's "
                          "triggers query, e.g. http://prometheus.monitoring.svc:9090)")
    return Settings(**kwargs)


TOLERATION_KEYS = {"key": str, "operator": str, "value": str, "effect": str, "tolerationSeconds": int}
TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")


def _check_placement(kwargs: dict[str, Any]) -> None:
    """routerNodeSelector: a map of strings; routerTolerations: Kubernetes tolerations.

    The chart's schema says the same."""
    selector = kwargs.get("router_node_selector", {})
    if (not isinstance(selector, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in selector.items())):
        raise ConfigError("operator config routerNodeSelector",
                          f"must map label keys to string values, got {selector!r}")
    tolerations = kwargs.get("router_tolerations", ())
    if not isinstance(tolerations, tuple):
        raise ConfigError("operator config routerTolerations", f"must be a list of tolerations, got {tolerations!r}")
    for i, t in enumerate(tolerations):
        where = f"operator config routerTolerations[{i}]"
        if not isinstance(t, dict) or set(t) - set(TOLERATION_KEYS):
            raise ConfigError(where, f"must be a toleration with keys among {', '.join(TOLERATION_KEYS)}, got {t!r}")
        for k, kind in TOLERATION_KEYS.items():
            if k in t and (isinstance(t[k], bool) or not isinstance(t[k], kind)):
                raise ConfigError(f"{where}.{k}", f"must be a {kind.__name__}, got {t[k]!r}")
        if t.get("operator", "Equal") not in TOLERATION_OPERATORS:
            raise ConfigError(f"{where}.operator", f"{t['operator']!r} is not allowed; allowed values: "
                                                   f"{', '.join(TOLERATION_OPERATORS)}")
        if t.get("effect", "") not in TOLERATION_EFFECTS:
            raise ConfigError(f"{where}.effect", f"{t['effect']!r} is not allowed; allowed values: "
                                                 f"{', '.join(e or '(empty: all)' for e in TOLERATION_EFFECTS)}")


def _check_shared(kwargs: dict[str, Any]) -> None:
    """sharedMemoryRoot: empty, or a normalized absolute directory other than / (a hostPath volume's own path, so
    kubelet resolves it as the admin wrote it). sharedServerGraceSeconds: a whole number of seconds >= 0."""
    root = kwargs.get("shared_memory_root", "")
    if not isinstance(root, str) or (root and (not root.startswith("/") or root == "/"
                                               or posixpath.normpath(root) != root)):
        raise ConfigError("operator config sharedMemoryRoot", f"{root!r} must be empty (no PerNode servers) or a "
                                                              "normalized absolute directory other than /, e.g. "
                                                              "/run/kvoffload-shm")
    grace = kwargs.get("shared_server_grace_seconds", Settings.shared_server_grace_seconds)
    if isinstance(grace, bool) or not isinstance(grace, int) or grace < 0:
        raise ConfigError("operator config sharedServerGraceSeconds", f"must be an integer >= 0, got {grace!r}")


def _check_images(kwargs: dict[str, Any]) -> None:
    for i, entry in enumerate(kwargs.get("allowed_images", ())):
        stem = entry[:-1] if isinstance(entry, str) and entry.endswith("/*") else entry
        if not isinstance(entry, str) or not stem or "*" in stem or any(c.isspace() for c in entry):
            raise ConfigError(f"operator config allowedImages[{i}]", f"{entry!r} must be an image reference "
                                                                     "(registry/repository:tag or @digest) or a path "
                                                                     "ending in /* (every image below it)")
    for i, name in enumerate(kwargs.get("allowed_nvidia_env", ())):
        if not isinstance(name, str) or not name.startswith("NVIDIA_"):
            raise ConfigError(f"operator config allowedNvidiaEnv[{i}]",
                              f"{name!r} must be a variable name starting NVIDIA_")


def load(path: str | None = None) -> Settings:
    if not path:
        return Settings()
    with open(path, encoding="utf-8") as fh:
        return from_dict(yaml.safe_load(fh) or {})


def resolve_autoscaler(settings: Settings, keda_served: bool) -> Settings:
    """`auto` made concrete, once, when the operator starts (kopf fixes the watched kinds then): KEDA where its
    ScaledObject is served and its triggers have a Prometheus to query, else the HPA. hpa and keda stay as set."""
    if settings.autoscaler != "auto":
        return settings
    return replace(settings, autoscaler="keda" if keda_served and settings.prometheus_address else "hpa")

