"""The pure middle of a reconcile: CR -> Spec -> Budget -> children. No I/O."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..api.errors import ConfigError, InputError
from ..api.quantity import format_bytes
from ..api.settings import Settings
from ..api.spec import PLAN_FIELDS, Spec, parse
from ..planning import catalog, sizing
from ..rendering import render

_WEIGHT_DTYPE = {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16"}
_ARCH_KW = {"layers": "layers", "attentionHeads": "attention_heads", "kvHeads": "kv_heads", "headDim": "head_dim",
            "parameters": "params"}


@dataclass(frozen=True)
class Desired:
    spec: Spec
    budget: sizing.Budget
    children: list[dict[str, Any]]


def plan_for(spec: Spec) -> sizing.Budget:
    """Spec -> Budget. spec.parse held every bound, so only the planner's own rules can refuse;
    its errors and warnings come back naming CRD fields."""
    r = spec.resources
    try:
        model = catalog.resolve_model(spec.model.name, **{_ARCH_KW[k]: v for k, v in spec.model.architecture.items()})
        budget = sizing.plan(sizing.PlanInput(
            model=model,
            max_model_len=spec.engine.max_model_len,
            concurrency=spec.engine.max_num_seqs,
            gpu_memory=r.gpu_memory,
            tp=spec.engine.tensor_parallel_size,
            gpu_memory_utilization=spec.engine.gpu_memory_utilization,
            weight_dtype=_WEIGHT_DTYPE[spec.engine.dtype],
            kv_dtype=spec.model.kv_dtype,
            cpu_size=spec.offload.cpu_size,
            disk_size=spec.offload.disk.size if spec.offload.disk else 0,
            chunk_size=spec.offload.chunk_size,
            memory=sizing.MemoryDefaults(engine_baseline=r.engine_baseline, per_worker_overhead=r.per_worker_overhead,
                                         staging_per_worker=r.staging_per_worker, shm=r.shm,
                                         headroom_percent=r.headroom_percent),
            weights_on_pvc=spec.model.cache_claim is not None,
        )).named(PLAN_FIELDS)
    except InputError as exc:
        raise exc.named(PLAN_FIELDS) from None
    if r.memory is not None:
        # An explicit figure replaces the sum; the terms stay visible so users see what they overrode.
        if r.memory < budget.memory_request:
            note = f"spec.resources.memory {format_bytes(r.memory)} is below the computed {format_bytes(budget.memory_request)}"
            budget = dataclasses.replace(budget, warnings=(*budget.warnings, note))
        budget = dataclasses.replace(budget, memory_request=r.memory, memory_limit=r.memory)
    return budget


def desired(name: str, namespace: str, uid: str, spec_dict: dict[str, Any], settings: Settings) -> Desired:
    """Everything the operator wants for one KVOffloadServe, or a ConfigError naming the field."""
    render.check_name(name)
    spec = parse(spec_dict, settings)
    budget = plan_for(spec)
    owner = render.Owner(name=name, namespace=namespace, uid=uid)
    return Desired(spec=spec, budget=budget, children=render.children(owner, spec, budget, settings))


__all__ = ["ConfigError", "Desired", "desired", "plan_for"]
