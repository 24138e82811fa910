"""parse: a KVOffloadServe spec (a dict from the API) -> a typed, defaulted, validated Spec.

The API server already refused what the schema and CEL rules can see; this re-checks all of
it (the operator may see objects written before a CRD upgrade, and `kvoffload render` runs
without an API server) plus what only the operator knows: allowed disk roots, the image's
engine versions, the model catalog. Every error names the field.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from ..engine import flags, images
from . import crd, managed, rules
from .errors import ConfigError
from .quantity import to_bytes
from .settings import Settings

_MISSING = object()
# The Kubernetes quantity grammar, as the API server's isQuantity() reads it (no spaces, no "inf", no "0x").
_QUANTITY = re.compile(r"[+-]?([0-9]+([.][0-9]*)?|[.][0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i|[mkMGTPE])?")
MAX_BYTES = int(parse_quantity(crd.MAX_QUANTITY))


_node = crd.schema_at

# The planner's input names (planning.sizing.PlanInput, planning.catalog) -> the CRD field that sets
# each, so that planning errors and warnings name the field. Inputs the operator never sets (gpus,
# activation_reserve, headroom_min, bandwidths, config_json) have no field and keep their own name.
PLAN_FIELDS = {
    "model": "spec.model.name",
    "architecture": "spec.model.architecture",
    "layers": "spec.model.architecture.layers",
    "attention_heads": "spec.model.architecture.attentionHeads",
    "kv_heads": "spec.model.architecture.kvHeads",
    "head_dim": "spec.model.architecture.headDim",
    "params": "spec.model.architecture.parameters",
    "kv_dtype": "spec.model.kvDtype",
    "max_model_len": "spec.engine.maxModelLen",
    "concurrency": "spec.engine.maxNumSeqs",
    "tp": "spec.engine.tensorParallelSize",
    "gpu_memory_utilization": "spec.engine.gpuMemoryUtilization",
    "weight_dtype": "spec.engine.dtype",
    "gpu_memory": "spec.resources.gpuMemory",
    "engine_baseline": "spec.resources.engineBaseline",
    "per_worker_overhead": "spec.resources.perWorkerOverhead",
    "staging_per_worker": "spec.resources.stagingPerWorker",
    "shm": "spec.resources.shm",
    "headroom_percent": "spec.resources.headroomPercent",
    "cpu_size": "spec.offload.cpu.size",
    "disk_size": "spec.offload.disk.size",
    "chunk_size": "spec.offload.chunkSize",
    "backend": "spec.offload.backend",
    "server_baseline": "spec.resources.serverBaseline",
    "shared": "spec.offload.server",
}


def _declared(backend: Any) -> dict[str, Any] | None:
    """What spec.offload.backend `backend` declares (crd.backend_declarations), None for an unknown one."""
    return next((b for b in crd.backend_declarations()["backends"] if b["name"] == backend), None)


def _matches(pattern: str, value: str) -> bool:
    """An anchored OpenAPI pattern as the API server (Go RE2) applies it: `$` never matches before a final newline."""
    return re.fullmatch(pattern.removeprefix("^").removesuffix("$"), value) is not None


class _Reader:
    """Reads dotted spec paths, falling back to the CRD's defaults."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def get(self, path: str, default: Any = _MISSING) -> Any:
        node: Any = self.spec
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node or node[part] is None:
                return crd.default_at(path) if default is _MISSING else default
            node = node[part]
        return node

    def has(self, path: str) -> bool:
        return self.get(path, None) is not None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    served_name: str
    architecture: dict[str, int]
    kv_dtype: str
    hf_token_secret: tuple[str, str] | None  # (secret name, key)
    cache_claim: str | None
    cache_read_only: bool


@dataclass(frozen=True)
class EngineSpec:
    image: str
    vllm_version: str
    lmcache_version: str
    max_model_len: int
    gpu_memory_utilization: float
    max_num_seqs: int
    tensor_parallel_size: int
    dtype: str
    extra_args: tuple[str, ...]
    env: tuple[dict[str, Any], ...]
    api_key_secret: tuple[str, str] | None = None  # (secret name, key) -> VLLM_API_KEY


@dataclass(frozen=True)
class Figure:
    """A figure the planner uses and where it came from (a spec field or an operator setting), for status."""
    value: float
    source: str


@dataclass(frozen=True)
class DiskSpec:
    path: str | None
    storage_class: str | None
    size: int
    reclaim_policy: str
    node_selector: dict[str, str]
    read_gbps: Figure | None = None  # None: the planner's default
    # The admin's allowed root that `path` lies under: the hostPath volume is exactly this directory, and
    # everything the tenant chose below it is a subPath that kubelet opens component by component (O_NOFOLLOW).
    root: str | None = None

    @property
    def below_root(self) -> str:
        """The tenant's part of `path`, relative to `root` (at least one component: the root itself is refused)."""
        if not self.path or not self.root:
            return ""
        return self.path[len(self.root):].strip("/")


@dataclass(frozen=True)
class OffloadSpec:
    backend: str  # a name in backends.REGISTRY
    chunk_size: int
    cpu_size: int
    eviction_policy: str
    disk: DiskSpec | None
    cpu_read_gbps: Figure | None = None  # None: the planner's default
    prefill_tokens_per_second: Figure | None = None  # None: derived from the model (planning.sizing)
    server: str = rules.SIDECAR  # spec.offload.server: where backend lmcache-server's LMCache server runs
    shared_memory_root: str = ""  # PerNode: the admin's tmpfs root (operator setting sharedMemoryRoot)
    # PerNode: where vLLM reaches its node's server, filled in by rendering (rendering/shared_cache.py): the ClusterIP
    # of the resource's node-local Service once the API server gave it one, else that Service's DNS name.
    shared_address: str = ""

    @property
    def shared(self) -> bool:
        """One LMCache server pod per node, shared by this resource's replicas there (docs/shared-cache.md)."""
        return self.server == rules.SHARED


@dataclass(frozen=True)
class ResourcesSpec:
    gpu_resource_name: str
    gpu_memory: int
    cpu: str
    memory: int | None
    engine_baseline: int
    per_worker_overhead: int
    staging_per_worker: int
    server_baseline: int
    shm: int | None
    headroom_percent: int


@dataclass(frozen=True)
class SchedulingSpec:
    node_selector: dict[str, str]
    tolerations: tuple[dict[str, Any], ...]
    affinity: dict[str, Any] | None
    priority_class_name: str | None
    topology_spread_constraints: tuple[dict[str, Any], ...] | None = None  # None: the default spread


@dataclass(frozen=True)
class NetworkPolicySpec:
    serving_from: tuple[str, ...]
    metrics_from: tuple[str, ...]


@dataclass(frozen=True)
class AutoscalingSpec:
    min_replicas: int
    max_replicas: int
    targets: dict[str, int]  # spec.autoscaling.targets field -> its value, in crd order
    scale_up_period: int | None  # None: derived from the start-up budget (rendering/autoscaling.py)
    scale_down_window: int | None
    wake_query: str | None


@dataclass(frozen=True)
class RoutingSpec:
    policy: str  # what the router runs: spec.routing.policy, auto until rendering/routing.resolve decides
    requested: str  # spec.routing.policy as written (or its default)
    replicas: int


@dataclass(frozen=True)
class Spec:
    model: ModelSpec
    replicas: int
    engine: EngineSpec
    offload: OffloadSpec
    resources: ResourcesSpec
    scheduling: SchedulingSpec
    metrics_enabled: bool
    metrics_port: int
    network_policy: NetworkPolicySpec | None = None
    autoscaling: AutoscalingSpec | None = None
    routing: RoutingSpec | None = None  # None: no router (spec.routing unset, or enabled false)


def _int(r: _Reader, path: str) -> int:
    # The bounds are the CRD schema's (crd.py), declared there once: admission and this parser cannot disagree.
    node = _node(path)
    lo, hi = node.get("minimum", 0), node["maximum"]
    value = r.get(path)
    if value is None:
        raise ConfigError(f"spec.{path}", "is required")
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"spec.{path}", f"{value!r} must be an integer in [{lo}, {hi}]")
    return value


def _enum(r: _Reader, path: str) -> str:
    node = _node(path)
    value = r.get(path)
    if not isinstance(value, str) or value not in node["enum"]:
        raise ConfigError(f"spec.{path}", f"{value!r} is not allowed; allowed values: {', '.join(node['enum'])}")
    return value


def quantity_bytes(value: Any, field_: str, *, allow_zero: bool) -> int:
    """A quantity the API server would accept (string in its grammar, or a plain integer), at most MAX_BYTES."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or (
            isinstance(value, str) and (len(value) > crd.MAX_QUANTITY_LENGTH or not _QUANTITY.fullmatch(value))):
        raise ConfigError(field_, f"{value!r} is not a Kubernetes quantity (examples: 40Gi, 500G, 1073741824)")
    try:
        too_big = parse_quantity(value) > Decimal(MAX_BYTES)
    except ArithmeticError:  # an exponent beyond Decimal's range
        too_big = True
    if too_big:
        raise ConfigError(field_, f"{value!r} is more than {crd.MAX_QUANTITY}")
    return to_bytes(value, field_, allow_zero=allow_zero)


def _required_size(r: _Reader, path: str) -> int:
    value = _size(r, path, required=True)
    assert value is not None  # _size raised otherwise
    return value


def _size(r: _Reader, path: str, *, required: bool = False, allow_zero: bool = False) -> int | None:
    value = r.get(path)
    if value is None:
        if required:
            raise ConfigError(f"spec.{path}", "is required (a Kubernetes quantity such as 40Gi)")
        return None
    return quantity_bytes(value, f"spec.{path}", allow_zero=allow_zero)


def _text(r: _Reader, path: str) -> str:
    """A string field that always has a value here (set, or its schema default)."""
    value = _str(r, path)
    if value is None:
        raise ConfigError(f"spec.{path}", "is required")
    return value


def _secret(r: _Reader, path: str) -> tuple[str, str] | None:
    """(name, key) of a Secret reference, or None when unset."""
    return (_text(r, f"{path}.name"), _text(r, f"{path}.key")) if r.has(f"{path}.name") else None


def _str(r: _Reader, path: str) -> str | None:
    """An optional string field, checked against its schema (length, pattern) as the API server does."""
    value = r.get(path)
    if value is None:
        return None
    node, field_ = _node(path), f"spec.{path}"
    if not isinstance(value, str):
        raise ConfigError(field_, f"{value!r} must be a string")
    if not node.get("minLength", 0) <= len(value) <= node.get("maxLength", len(value)):
        raise ConfigError(field_, f"must be {node.get('minLength', 0)} to {node.get('maxLength')} characters long")
    if "pattern" in node and not _matches(node["pattern"], value):
        raise ConfigError(field_, f"{value!r} must match {node['pattern']}")
    return value


def _bool(r: _Reader, path: str) -> bool:
    value = r.get(path)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"spec.{path}", f"{value!r} must be true or false")
    return value


def _list(r: _Reader, path: str) -> list[Any]:
    value = r.get(path)
    if value is None:
        return []
    limit = _node(path).get("maxItems")
    if not isinstance(value, list) or (limit is not None and len(value) > limit):
        raise ConfigError(f"spec.{path}", f"must be a list{f' of at most {limit} items' if limit else ''}")
    return value


def _str_map(r: _Reader, path: str) -> dict[str, str]:
    value = r.get(path) or {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(f"spec.{path}", "must be a map of string to string")
    node = _node(path)
    if len(value) > node["maxProperties"]:
        raise ConfigError(f"spec.{path}", f"must have at most {node['maxProperties']} entries")
    longest = node["additionalProperties"]["maxLength"]
    for k, v in value.items():
        if (len(k) > crd.LABEL_KEY_MAX or not _matches(crd.LABEL_KEY, k)
                or len(v) > longest or not _matches(node["additionalProperties"]["pattern"], v)):
            raise ConfigError(f"spec.{path}", f"{k!r}: {v!r} is not a Kubernetes label (key "
                                              f"[prefix/]name, value <= {longest} characters)")
    return dict(value)


def _model(r: _Reader) -> ModelSpec:
    name, node = r.get("model.name"), _node("model.name")
    if (not isinstance(name, str) or not node["minLength"] <= len(name) <= node["maxLength"]
            or not _matches(node["pattern"], name)):
        raise ConfigError("spec.model.name", f"{name!r} must be a Hugging Face id or path (letters, digits, _ . / -)")
    arch = {k: _int(r, f"model.architecture.{k}")
            for k in ("layers", "attentionHeads", "kvHeads", "headDim", "parameters")
            if r.has(f"model.architecture.{k}")}
    return ModelSpec(
        name=name,
        served_name=_str(r, "model.servedName") or name,
        architecture=arch,
        kv_dtype=_enum(r, "model.kvDtype"),
        hf_token_secret=_secret(r, "model.hfTokenSecret"),
        cache_claim=_str(r, "model.cache.claimName"),
        cache_read_only=_bool(r, "model.cache.readOnly"),
    )


def _engine(r: _Reader, settings: Settings) -> EngineSpec:
    image = _str(r, "engine.image") or settings.default_image
    backend = _declared(r.get("offload.backend"))
    table = {**images.KNOWN_IMAGES, **images.declared(settings.image_versions)}
    # The image is what runs in the pod: every env and flag guard below assumes it is one the admin allows.
    images.check_allowed(image, (settings.default_image, *settings.allowed_images), table)
    pair = images.resolve(image, _str(r, "engine.vllmVersion"), _str(r, "engine.lmcacheVersion"),
                          needs_lmcache=backend is None or backend["minLmcache"] is not None, table=table)
    util = _number("engine.gpuMemoryUtilization", r.get("engine.gpuMemoryUtilization"))
    extra = tuple(_list(r, "engine.extraArgs"))
    longest = _node("engine.extraArgs")["items"]["maxLength"]
    for arg in extra:
        if not isinstance(arg, str) or len(arg) > longest:
            raise ConfigError("spec.engine.extraArgs", f"{arg!r} must be a string of at most {longest} characters")
    flags.check_args(extra, pair.vllm)  # against the flag table of the image's vLLM version
    env = tuple(_list(r, "engine.env"))
    seen: set[str] = set()
    longest = _node("engine.env")["items"]["properties"]["name"]["maxLength"]
    for var in env:
        name = var.get("name", "") if isinstance(var, dict) else ""
        if not name or not isinstance(name, str) or len(name) > longest:
            raise ConfigError("spec.engine.env",
                              f"every entry needs a name (a string of at most {longest} characters)")
        if not isinstance(var.get("value", ""), str) or not isinstance(var.get("valueFrom", {}), dict):
            raise ConfigError("spec.engine.env", f"{name}: value must be a string and valueFrom an object")
        if name in seen:  # the CRD's list-map refuses it too; a pod spec with it fails server-side apply
            raise ConfigError("spec.engine.env", f"{name} is set twice: each variable at most once")
        seen.add(name)
    rules.ENV.check(r.spec)  # before the flag table's checks of the values: a managed name is refused whatever it says
    for name in (v["name"] for v in env):
        why = managed.admin_env_why(name, settings.allowed_nvidia_env)
        if why:
            raise ConfigError("spec.engine.env", f"{name} is managed by the operator: {why}")
    flags.check_env(env, pair.vllm)
    return EngineSpec(
        image=image, vllm_version=pair.vllm, lmcache_version=pair.lmcache,
        max_model_len=_int(r, "engine.maxModelLen"),
        gpu_memory_utilization=float(util),
        max_num_seqs=_int(r, "engine.maxNumSeqs"),
        tensor_parallel_size=_int(r, "engine.tensorParallelSize"),
        dtype=_enum(r, "engine.dtype"),
        extra_args=tuple(str(a) for a in extra),
        env=env,
        api_key_secret=_secret(r, "engine.apiKeySecretRef"),
    )


def check_disk_path(path: str, allowed_roots: tuple[str, ...]) -> tuple[str, str]:
    """A hostPath is host access: accept only a normalized absolute path strictly below an allowed root.
    Returns (path, root): the longest allowed root it lies under, which becomes the hostPath volume itself."""
    field_ = "spec.offload.disk.path"
    roots = ", ".join(allowed_roots) or "(none: the admin allowed no hostPath roots)"
    if not path.startswith("/"):
        raise ConfigError(field_, f"{path!r} must be an absolute path under an allowed root: {roots}")
    if not rules.DISK_PATH_NORMALIZED.holds(path) or posixpath.normpath(path) != path.rstrip("/"):
        raise ConfigError(field_, rules.DISK_PATH_NORMALIZED.message)
    path = path.rstrip("/")
    under = []
    for root in allowed_roots:
        root = posixpath.normpath(root)
        if path == root:
            raise ConfigError(field_, f"{path!r} is an allowed root itself; use a sub-directory such as {root}/lmcache")
        if path.startswith(root.rstrip("/") + "/"):
            under.append(root)
    if not under:
        raise ConfigError(field_, f"{path!r} is outside the allowed roots: {roots}")
    # Nested roots: the longest one, so the volume is the most specific directory the admin made.
    return path, max(under, key=len)


def _figure(r: _Reader, path: str, setting: str, default: float) -> Figure:
    """A positive number from the spec, else the operator's setting, with where it came from."""
    value = r.get(path)
    if value is None:
        if isinstance(default, bool) or not isinstance(default, (int, float)) or not default > 0:
            raise ConfigError(f"operator setting {setting}", f"{default!r} must be a number > 0")
        return Figure(float(default), f"operator setting {setting}")
    return Figure(float(_number(path, value)), f"spec.{path}")


def _number(path: str, value: Any) -> float:
    """A number in the schema's (minimum, maximum], returned as given (every number field of the spec has an
    exclusive minimum)."""
    node = _node(path)
    assert node.get("exclusiveMinimum") is True, path
    lo, hi = node["minimum"], node["maximum"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo < value <= hi:
        raise ConfigError(f"spec.{path}", f"{value!r} must be a number in ({lo}, {hi}]")
    return value


def _offload(r: _Reader, settings: Settings) -> OffloadSpec:
    backend, policy = _enum(r, "offload.backend"), _enum(r, "offload.cpu.evictionPolicy")
    for name, refused, allowed, tail in crd.backend_refusals():  # the fields this backend cannot honour, first
        value = r.get(refused, None)
        if name == backend and value is not None and (allowed is None or value not in allowed):
            raise ConfigError(f"spec.{refused}", tail)
    cpu = _required_size(r, "offload.cpu.size")
    disk = None
    if r.get("offload.disk") is not None:
        path, sc = _str(r, "offload.disk.path"), _str(r, "offload.disk.storageClassName")
        rules.DISK_ONE_OF.check(r.spec)
        node_selector = _str_map(r, "offload.disk.nodeSelector") or (settings.nvme_selector() if path else {})
        path, root = check_disk_path(path, settings.allowed_disk_roots) if path is not None else (None, None)
        disk = DiskSpec(
            path=path,
            root=root,
            storage_class=sc,
            size=_required_size(r, "offload.disk.size"),
            reclaim_policy=_enum(r, "offload.disk.reclaimPolicy"),
            node_selector=node_selector,
            read_gbps=_figure(r, "offload.disk.readGbps", "diskReadGbps", settings.disk_read_gbps),
        )
    server = _enum(r, "offload.server")
    rules.SHARED_DISK_ON_NODE.check(r.spec)
    if server == rules.SHARED and not settings.shared_memory_root:
        raise ConfigError("spec.offload.server", f"{server} needs a tmpfs directory on every node for the server's "
                                                 "shared memory, which the cluster admin has not configured (operator "
                                                 "setting sharedMemoryRoot, chart value "
                                                 "operator.config.sharedMemoryRoot); allowed values here: "
                                                 f"{rules.SIDECAR}")
    prefill = settings.prefill_tokens_per_second
    return OffloadSpec(server=server, shared_memory_root=settings.shared_memory_root if server == rules.SHARED else "",
                       backend=backend, chunk_size=_int(r, "offload.chunkSize"), cpu_size=cpu,
                       eviction_policy=policy, disk=disk,
                       cpu_read_gbps=_figure(r, "offload.cpu.readGbps", "cpuReadGbps", settings.cpu_read_gbps),
                       prefill_tokens_per_second=None if not prefill
                       else Figure(prefill, "operator setting prefillTokensPerSecond"))


def _resources(r: _Reader, settings: Settings) -> ResourcesSpec:
    def term(path: str, default: str) -> int:
        value = _size(r, path, allow_zero=True)
        return value if value is not None else to_bytes(default, f"operator setting for spec.{path}")

    cpu = r.get("resources.cpu")
    quantity_bytes(cpu, "spec.resources.cpu", allow_zero=False)  # validates the quantity
    if r.has("resources.headroomPercent"):
        headroom = _int(r, "resources.headroomPercent")
    else:
        headroom, node = settings.headroom_percent, _node("resources.headroomPercent")
        lo, hi = node["minimum"], node["maximum"]  # the setting takes the field's bounds
        if isinstance(headroom, bool) or not isinstance(headroom, int) or not lo <= headroom <= hi:
            raise ConfigError("operator setting headroomPercent", f"{headroom!r} must be an integer in [{lo}, {hi}]")
    return ResourcesSpec(
        gpu_resource_name=_text(r, "resources.gpuResourceName"),
        gpu_memory=_size(r, "resources.gpuMemory")
        or to_bytes(settings.default_gpu_memory, "operator setting defaultGpuMemory", allow_zero=False),
        cpu=str(cpu),
        memory=_size(r, "resources.memory"),
        engine_baseline=term("resources.engineBaseline", settings.engine_baseline),
        per_worker_overhead=term("resources.perWorkerOverhead", settings.per_worker_overhead),
        staging_per_worker=term("resources.stagingPerWorker", settings.staging_per_worker),
        server_baseline=term("resources.serverBaseline", settings.server_baseline),
        shm=_size(r, "resources.shm"),
        headroom_percent=headroom,
    )


def _scheduling(r: _Reader) -> SchedulingSpec:
    tolerations = r.get("scheduling.tolerations") or []
    affinity = r.get("scheduling.affinity")
    if not isinstance(tolerations, list) or not all(isinstance(t, dict) for t in tolerations):
        raise ConfigError("spec.scheduling.tolerations", "must be a list of Kubernetes Tolerations")
    if affinity is not None and not isinstance(affinity, dict):
        raise ConfigError("spec.scheduling.affinity", "must be a Kubernetes Affinity object")
    spread = r.get("scheduling.topologySpreadConstraints")
    if spread is not None and (not isinstance(spread, list) or len(spread) > 8
                               or not all(isinstance(c, dict) for c in spread)):
        raise ConfigError("spec.scheduling.topologySpreadConstraints",
                          "must be a list of at most 8 Kubernetes "
                          "TopologySpreadConstraints (an empty list turns spreading off)")
    return SchedulingSpec(node_selector=_str_map(r, "scheduling.nodeSelector"), tolerations=tuple(tolerations),
                          affinity=affinity, priority_class_name=_str(r, "scheduling.priorityClassName"),
                          topology_spread_constraints=None if spread is None else tuple(spread))


def _namespaces(r: _Reader, path: str) -> tuple[str, ...]:
    values = _list(r, path)
    for v in values:
        item = _node(path)["items"]
        if not isinstance(v, str) or not _matches(item["pattern"], v) or len(v) > item["maxLength"]:
            raise ConfigError(f"spec.{path}", f"{v!r} is not a namespace name (a DNS-1123 label)")
    if len(set(values)) != len(values):
        raise ConfigError(f"spec.{path}", "lists a namespace twice")
    return tuple(values)


def _network_policy(r: _Reader) -> NetworkPolicySpec | None:
    if r.get("networkPolicy", None) is None:
        return None
    return NetworkPolicySpec(serving_from=_namespaces(r, "networkPolicy.servingFrom"),
                             metrics_from=_namespaces(r, "networkPolicy.metricsFrom"))


def _autoscaling(r: _Reader, settings: Settings) -> AutoscalingSpec | None:
    if r.get("autoscaling", None) is None:
        return None
    lo, hi = _int(r, "autoscaling.minReplicas"), _int(r, "autoscaling.maxReplicas")
    names = [n for n in _node("autoscaling.targets")["properties"] if n not in crd.REMOVED_TARGETS]  # refused: rules.py
    if not isinstance(r.get("autoscaling.targets", None), dict):
        raise ConfigError("spec.autoscaling.targets", f"is required: an object with at least one of {', '.join(names)}")
    targets = {n: _int(r, f"autoscaling.targets.{n}") for n in names if r.has(f"autoscaling.targets.{n}")}
    wake = _str(r, "autoscaling.wakeQuery")  # min/max, targets, wakeQuery and metrics: api/rules.py (AUTOSCALING_*)
    if lo == 0 and wake is not None and settings.autoscaler != "keda":
        raise ConfigError("spec.autoscaling.minReplicas",
                          f"0 (scale to zero) needs KEDA: the operator's setting autoscaler is "
                          f"{settings.autoscaler!r}, and a HorizontalPodAutoscaler cannot scale "
                          "to zero; allowed here: 1 to maxReplicas")
    optional = lambda path: _int(r, f"autoscaling.{path}") if r.has(f"autoscaling.{path}") else None  # noqa: E731
    return AutoscalingSpec(min_replicas=lo, max_replicas=hi, targets=targets,
                           scale_up_period=optional("scaleUpPeriodSeconds"),
                           scale_down_window=optional("scaleDownWindowSeconds"), wake_query=wake)


def _routing(r: _Reader) -> RoutingSpec | None:
    if r.get("routing", None) is None:
        return None
    enabled, requested = _bool(r, "routing.enabled"), _enum(r, "routing.policy")
    replicas = _int(r, "routing.replicas")
    if not enabled:
        return None
    # auto is resolved with the Budget (rendering/routing.resolve): which tiers are worth a hit decides it.
    return RoutingSpec(policy=requested, requested=requested, replicas=replicas)


def parse(spec: dict[str, Any], settings: Settings) -> Spec:
    if not isinstance(spec, dict):
        raise ConfigError("spec", "is required")
    r = _Reader(spec)
    engine = _engine(r, settings)
    parsed = Spec(
        model=_model(r),
        replicas=_int(r, "replicas"),
        engine=engine,
        offload=_offload(r, settings),
        resources=_resources(r, settings),
        scheduling=_scheduling(r),
        metrics_enabled=_bool(r, "metrics.enabled"),
        metrics_port=_int(r, "metrics.port"),
        network_policy=_network_policy(r),
        autoscaling=_autoscaling(r, settings),
        routing=_routing(r),
    )
    rules.check(spec)  # the CRD's CEL rules, each declared once in api/rules.py
    flags.check_dtypes(parsed.model.kv_dtype, parsed.engine.dtype, parsed.engine.vllm_version)
    backend = _declared(parsed.offload.backend)
    assert backend is not None  # _enum held the backend to the declared names
    pair = images.EnginePair(parsed.engine.vllm_version, parsed.engine.lmcache_version)
    images.check_backend(parsed.offload.backend, backend["minVllm"], backend["minLmcache"], pair)
    if parsed.offload.shared:
        images.check_shared_server(parsed.offload.server, pair, rules.SIDECAR)
    floor = images.server_baseline_floor(parsed.engine.lmcache_version)
    floor_bytes = to_bytes(floor, "SERVER_BASELINE_FLOOR") if floor else 0
    if parsed.resources.server_baseline < floor_bytes:
        if r.has("resources.serverBaseline"):  # only lmcache-server takes the field (the others refuse it)
            raise ConfigError("spec.resources.serverBaseline", f"below {floor}, what LMCache "
                              f"{parsed.engine.lmcache_version}'s server process needs beside its CPU tier (its server "
                              f"was OOM-killed at 2Gi on an H200: docs/benchmarks.md); set at least {floor}")
        parsed = replace(parsed, resources=replace(parsed.resources, server_baseline=floor_bytes))
    if parsed.offload.disk and parsed.offload.disk.node_selector:
        # Only the operator knows the default NVMe label a hostPath disk tier selects.
        for key, value in parsed.offload.disk.node_selector.items():
            if parsed.scheduling.node_selector.get(key, value) != value:
                raise ConfigError("spec.scheduling.nodeSelector",
                                  f"{key} disagrees with spec.offload.disk.nodeSelector")
    return parsed
