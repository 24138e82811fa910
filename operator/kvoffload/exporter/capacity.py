"""Tier capacities from the LMCache YAML the operator rendered (sizes are GiB PER TP WORKER).

The sidecar reads LMCache's own config rather than a figure in its arguments: these keys are what
LMCache enforces, so the capacity reported is the one in force (the rendered figure is the Budget's
per-worker bytes, rounded to 6 decimals of GiB; × tp gives the tier back to within that rounding)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from ..api.errors import ConfigError

GiB = 1024**3
_FIELD = "--lmcache-config"


@dataclass(frozen=True)
class TierCapacity:
    """Bytes the CPU and disk tiers may hold for the whole pod; None when the tier is off/unknown."""

    cpu_bytes: int | None = None
    disk_bytes: int | None = None


def load_capacity(path: str | None, tensor_parallel_size: int) -> TierCapacity:
    if path is None:
        return TierCapacity()
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(_FIELD, f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(_FIELD, f"{path} is not a YAML mapping")
    return capacity_from_config(doc, tensor_parallel_size)


def capacity_from_config(doc: dict[str, Any], tensor_parallel_size: int) -> TierCapacity:
    # LMCache 0.5.6 defaults: local_cpu true, max_local_cpu_size 5.0, local_disk null,
    # max_local_disk_size 0.0; the disk tier is on only when both local_disk and a size are set.
    cpu_gib = _gib(doc, "max_local_cpu_size", 5.0) if doc.get("local_cpu", True) else 0.0
    disk_gib = _gib(doc, "max_local_disk_size", 0.0) if doc.get("local_disk") else 0.0
    return TierCapacity(
        cpu_bytes=int(cpu_gib * GiB) * tensor_parallel_size if cpu_gib > 0 else None,
        disk_bytes=int(disk_gib * GiB) * tensor_parallel_size if disk_gib > 0 else None,
    )


def _gib(doc: dict[str, Any], key: str, default: float) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{_FIELD} {key}", f"{value!r} must be a number of GiB >= 0")
    return float(value)
