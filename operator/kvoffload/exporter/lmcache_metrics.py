"""Read LMCache's metrics: the prometheus_client multiprocess files LMCache writes (or the
`lmcache:*` families vLLM re-exports when both share PROMETHEUS_MULTIPROC_DIR).

Only what LMCache alone knows is taken from here: tier bytes, CPU evictions, stored tokens, and
whether it has retrieved anything at all. Hits come from vLLM (what the engine served). LMCache's
retrieve counters (lmcache:num_retrieve_requests / num_hit_tokens) count only real loads: they
stayed 0 under vLLM 0.26.0's V2 model runner, which never let LMCache load (while vLLM counted
64,028 tokens as loaded), and counted under the V1 runner (6 retrieves, 99,072 tokens on the H200)."""

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
    "lmcache:num_stored_tokens_total",
    "lmcache:num_retrieve_requests_total",
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
    stored_tokens: float  # lmcache:num_stored_tokens (tokens written into the CPU/disk tiers)
    cpu_used_bytes: float  # lmcache:local_cache_usage
    disk_used_bytes: float  # lmcache:local_storage_usage
    cpu_evicted_chunks: float  # lmcache:local_cpu_evict_keys_count (keys = chunks)
    # lmcache:num_retrieve_requests summed over workers: loads LMCache really started into vLLM's GPU
    # buffers since it started (0 when absent: nothing proves a load).
    retrieve_requests: float = 0.0


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
        stored_tokens=most("lmcache:num_stored_tokens_total"),
        cpu_used_bytes=total("lmcache:local_cache_usage"),
        disk_used_bytes=total("lmcache:local_storage_usage"),
        cpu_evicted_chunks=total("lmcache:local_cpu_evict_keys_count_total"),
        retrieve_requests=total("lmcache:num_retrieve_requests_total"),
    )
