"""The pure middle of a reconcile: CR -> Spec -> Budget -> children. No I/O."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..api.errors import ConfigError, InputError
from ..api.quantity import format_bytes
from ..api.settings import Settings
from ..api.spec import PLAN_FIELDS, Spec, parse
from ..planning import catalog, sizing
from ..rendering import render, shared_cache
from ..rendering import routing as render_routing

WEIGHT_DTYPE = {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16"}
_ARCH_KW = {"layers": "layers", "attentionHeads": "attention_heads", "kvHeads": "kv_heads", "headDim": "head_dim",
            "parameters": "params"}


# On every child the operator applies: a hash of the whole rendered child. The no-op check compares
# it with the live object's, so removing a field from the spec (which leaves everything else the live
# child holds in place) still changes what is applied, and server-side apply then drops the field.
RENDERED_HASH_ANNOTATION = "kvoffload.io/rendered-hash"


def rendered_hash(child: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(child, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def stamped(child: dict[str, Any]) -> dict[str, Any]:
    """The child as applied: the rendered child plus its hash annotation."""
    meta = child["metadata"]
    annotations = {**meta.get("annotations", {}), RENDERED_HASH_ANNOTATION: rendered_hash(child)}
    return {**child, "metadata": {**meta, "annotations": annotations}}


@dataclass(frozen=True)
class Desired:
    spec: Spec
    budget: sizing.Budget
    children: list[dict[str, Any]]  # as rendered (the goldens, `kvoffload render`)
    applied: list[dict[str, Any]] = field(default_factory=list)  # as applied: each stamped with its hash
    autoscaler: str = ""  # with spec.autoscaling: what renders it, "hpa" or "keda" (decided here, not read back)
    max_tree_size: int | None = None  # cache_aware routing: the router's --max-tree-size (decided here, not read back)
    workers: tuple[str, ...] = ()  # kv_aware routing: the Ready serving pods' IPs the router was rendered with
    # kv_aware routing: the tiers worth a hit whose KV events the engines do not publish (status.routing.unseenTiers)
    unseen_tiers: tuple[str, ...] = ()
    # spec.offload.server PerNode: the nodes that get a shared server, and its Service's ClusterIP ("": not known yet)
    nodes: tuple[shared_cache.Node, ...] = ()
    address: str = ""


def bandwidths(spec: Spec) -> sizing.Bandwidths:
    """The figures behind "slower than recompute", with their sources.

    From the spec or the operator's settings (parse chose)."""
    o, b = spec.offload, sizing.Bandwidths()
    if o.cpu_read_gbps:
        b = dataclasses.replace(b, cpu_read=o.cpu_read_gbps.value * 1e9, cpu_read_from=o.cpu_read_gbps.source)
    if o.disk and o.disk.read_gbps:
        b = dataclasses.replace(b, disk_read=o.disk.read_gbps.value * 1e9, disk_read_from=o.disk.read_gbps.source)
    if o.prefill_tokens_per_second:
        p = o.prefill_tokens_per_second
        b = dataclasses.replace(b, prefill_tokens_per_s=p.value, prefill_from=p.source)
    return b


def plan_input(spec: Spec) -> sizing.PlanInput:
    """Spec -> the planner's input (`kvoffload plan -f` prints it next to the Budget)."""
    r = spec.resources
    overrides: dict[str, Any] = {_ARCH_KW[k]: v for k, v in spec.model.architecture.items()}
    return sizing.PlanInput(
        model=catalog.resolve_model(spec.model.name, **overrides),
        max_model_len=spec.engine.max_model_len,
        concurrency=spec.engine.max_num_seqs,
        gpu_memory=r.gpu_memory,
        tp=spec.engine.tensor_parallel_size,
        gpu_memory_utilization=spec.engine.gpu_memory_utilization,
        weight_dtype=WEIGHT_DTYPE[spec.engine.dtype],
        kv_dtype=spec.model.kv_dtype,
        cpu_size=spec.offload.cpu_size,
        disk_size=spec.offload.disk.size if spec.offload.disk else 0,
        chunk_size=spec.offload.chunk_size,
        backend=spec.offload.backend,
        vllm_version=spec.engine.vllm_version,
        shared=spec.offload.shared,
        memory=sizing.MemoryDefaults(engine_baseline=r.engine_baseline, per_worker_overhead=r.per_worker_overhead,
                                     staging_per_worker=r.staging_per_worker, server_baseline=r.server_baseline,
                                     shm=r.shm,
                                     headroom_percent=r.headroom_percent),
        bandwidths=bandwidths(spec),
        weights_on_pvc=spec.model.cache_claim is not None,
    )


def plan_for(spec: Spec) -> sizing.Budget:
    """Spec -> Budget. spec.parse held every bound, so only the planner's own rules can refuse;
    its errors and warnings come back naming CRD fields."""
    r = spec.resources
    try:
        budget = sizing.plan(plan_input(spec)).named(PLAN_FIELDS)
    except InputError as exc:
        raise exc.named(PLAN_FIELDS) from None
    if r.memory is not None:
        # An explicit figure replaces the sum; the terms stay visible so users see what they overrode.
        if r.memory < budget.memory_request:
            note = (f"spec.resources.memory {format_bytes(r.memory)} is below the computed "
                    f"{format_bytes(budget.memory_request)}")
            budget = dataclasses.replace(budget, warnings=(*budget.warnings, note))
        budget = dataclasses.replace(budget, memory_request=r.memory, memory_limit=r.memory)
    return budget


def desired(name: str, namespace: str, uid: str, spec_dict: dict[str, Any], settings: Settings,
            workers: tuple[str, ...] = (), nodes: tuple[shared_cache.Node, ...] = (), address: str = "") -> Desired:
    """Everything the operator wants for one KVOffloadServe, or a ConfigError naming the field. `workers`: the Ready
    serving pods' IPs (rendering/routing.workers), which only kv_aware's router reads. `nodes` and `address`: where
    PerNode's shared servers run and how their replicas reach them (rendering/shared_cache.py), which only PerNode
    reads."""
    render.check_name(name)
    spec = parse(spec_dict, settings)
    budget = plan_for(spec)
    spec = render_routing.resolve(spec)
    kv_aware = spec.routing is not None and spec.routing.policy == "kv_aware"
    unseen = render_routing.unseen(spec, budget) if kv_aware else ()
    if not kv_aware:
        workers = ()  # nothing else depends on them: one cached answer whatever the pods do
    if not spec.offload.shared:
        nodes, address = (), ""
    spec = shared_cache.with_address(spec, name, namespace, address)
    owner = render.Owner(name=name, namespace=namespace, uid=uid)
    children = render.children(owner, spec, budget, settings, workers, nodes, address)
    scaler = ("keda" if settings.autoscaler == "keda" else "hpa") if spec.autoscaling else ""
    return Desired(spec=spec, budget=budget, children=children, applied=[stamped(c) for c in children],
                   autoscaler=scaler, max_tree_size=render_routing.max_tree_size(spec.routing, budget),
                   workers=workers, unseen_tiers=unseen, nodes=nodes, address=address)


class DesiredCache:
    """The last `desired` answer per resource. Reconciles run on every watch event of a resource's
    children and pods, and parse + plan + render take milliseconds, while the spec changes rarely. A hit
    needs the same uid, an equal spec and equal Settings (and, for kv_aware, the same workers), so it is exactly
    what `desired` would return.
    Thread-safe (reconciles run in worker threads); one per Runtime, passed to each reconcile."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self.entries: OrderedDict[tuple[str, str, str], tuple[dict[str, Any], Settings, Desired | ConfigError]] = (
            OrderedDict())
        self.lock = threading.Lock()

    def get(self, name: str, namespace: str, uid: str, spec_dict: dict[str, Any], settings: Settings,
            workers: tuple[str, ...] = (), nodes: tuple[shared_cache.Node, ...] = (), address: str = "") -> Desired:
        key = (namespace, name, uid)
        with self.lock:
            hit = self.entries.get(key)
            if hit is not None and hit[0] == spec_dict and hit[1] == settings and _same_workers(hit[2], workers) \
                    and _same_servers(hit[2], nodes, address):
                self.entries.move_to_end(key)
                result = hit[2]
            else:
                hit = None
        if hit is None:
            try:
                result = desired(name, namespace, uid, spec_dict, settings, workers, nodes, address)
            except ConfigError as exc:
                result = exc
            with self.lock:
                self.entries[key] = (copy.deepcopy(spec_dict), settings, result)
                self.entries.move_to_end(key)
                while len(self.entries) > self.size:
                    self.entries.popitem(last=False)
        if isinstance(result, ConfigError):
            raise result
        return result


def _same_workers(result: Desired | ConfigError, workers: tuple[str, ...]) -> bool:
    """A cached answer holds for these workers: it did not read them (not kv_aware), or read the same."""
    if isinstance(result, ConfigError) or result.spec.routing is None or result.spec.routing.policy != "kv_aware":
        return True
    return result.workers == workers


def _same_servers(result: Desired | ConfigError, nodes: tuple[shared_cache.Node, ...], address: str) -> bool:
    """A cached answer holds for these shared servers: it did not read them (not PerNode), or read the same."""
    if isinstance(result, ConfigError) or not result.spec.offload.shared:
        return True
    return result.nodes == nodes and result.address == address


def unchecked(spec: Spec) -> bool:
    """The spec sets fields that reach the pod template unchecked by the CRD schema (the free-form
    env, tolerations and affinity; an image with surrounding blanks, which a pod may not have), so only
    the API server can tell whether the StatefulSet it makes is valid."""
    s, image = spec.scheduling, spec.engine.image
    return bool(spec.engine.env or s.tolerations or s.affinity or image != image.strip())


__all__ = ["ConfigError", "Desired", "DesiredCache", "desired", "plan_for", "stamped", "unchecked"]
