"""Read LMCache's metrics: the prometheus_client multiprocess files LMCache writes (or the
`lmcache:*` families vLLM re-exports when both share PROMETHEUS_MULTIPROC_DIR)."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from ..api.fetch import SourceError

_USED = frozenset({
    "lmcache:num_requested_tokens_total",
    "lmcache:num_hit_tokens_total",
    "lmcache:num_stored_tokens_total",
    "lmcache:local_cache_usage",
    "lmcache:local_storage_usage",
    "lmcache:local_cpu_evict_keys_count_total",
})


@dataclass(frozen=True)
class LmcacheSnapshot:
    """LMCache figures for the whole pod. Every TP worker sees the same tokens (each holds a shard
    of the KV heads), so token counters take the max over workers; bytes and evictions are per
    worker and are summed."""

    workers: int
    requested_tokens: float  # lmcache:num_requested_tokens (tokens asked of LMCache on retrieve)
    hit_tokens: float  # lmcache:num_hit_tokens (of those, found in the CPU or disk tier)
    stored_tokens: float  # lmcache:num_stored_tokens
    cpu_used_bytes: float  # lmcache:local_cache_usage
    disk_used_bytes: float  # lmcache:local_storage_usage
    cpu_evicted_chunks: float  # lmcache:local_cpu_evict_keys_count (keys = chunks)


def read_multiproc_dir(path: str) -> list[Metric]:
    """All families in a PROMETHEUS_MULTIPROC_DIR. The path is passed explicitly to a private
    registry: the env var PROMETHEUS_MULTIPROC_DIR, if set in this process, is ignored."""
    try:
        if not any(name.endswith(".db") for name in os.listdir(path)):
            raise SourceError(f"no .db files in {path} (LMCache not started, or not sharing this dir)")
        registry = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(registry, path=path)
        return list(registry.collect())
    except SourceError:
        raise
    except FileNotFoundError:
        raise SourceError(f"multiprocess dir {path} does not exist") from None
    except Exception as exc:  # corrupt .db files raise RuntimeError, struct.error, JSON errors...
        raise SourceError(f"unreadable multiprocess files in {path}: {type(exc).__name__}") from None


def parse_lmcache(families: Iterable[Metric]) -> LmcacheSnapshot:
    """Aggregate `lmcache:*` families; raises SourceError when there are none."""
    per_worker: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    found = False
    for fam in families:
        if not fam.name.startswith("lmcache:"):
            continue
        found = True
        for s in fam.samples:
            if s.name in _USED:
                per_worker[s.name][s.labels.get("worker_id", "")] += s.value
    if not found:
        raise SourceError("no lmcache:* metrics found")

    def most(name: str) -> float:
        return max(per_worker.get(name, {}).values(), default=0.0)

    def total(name: str) -> float:
        return sum(per_worker.get(name, {}).values())

    return LmcacheSnapshot(
        workers=len({w for by_worker in per_worker.values() for w in by_worker}),
        requested_tokens=most("lmcache:num_requested_tokens_total"),
        hit_tokens=most("lmcache:num_hit_tokens_total"),
        stored_tokens=most("lmcache:num_stored_tokens_total"),
        cpu_used_bytes=total("lmcache:local_cache_usage"),
        disk_used_bytes=total("lmcache:local_storage_usage"),
        cpu_evicted_chunks=total("lmcache:local_cpu_evict_keys_count_total"),
    )
