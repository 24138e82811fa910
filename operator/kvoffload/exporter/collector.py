"""One look at vLLM, LMCache and the disk tier per scrape, exported as `kvoffload_*` families with
a `tier` label (gpu|cpu|disk, and `external` for hits LMCache does not split between cpu and disk)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..api.fetch import SourceError, fetch_text
from .capacity import TierCapacity
from .disk_tier import DiskScan, DiskTierMonitor
from .lmcache_metrics import LmcacheSnapshot, parse_lmcache, read_multiproc_dir
from .sources import SourceHealth
from .vllm_metrics import VllmSnapshot, parse_vllm

# LMCache counters that rose within this many seconds count as "moving" for kvoffload_offload_active.
ACTIVITY_WINDOW_S = 300.0

OFFLOAD_ACTIVE_HELP = (
    "1 if KV offloading through LMCache really works, else 0. Rule: LMCache metrics are present "
    "(lmcache:* in the multiprocess dir, or on vLLM's page without --multiproc-dir) AND either "
    "vLLM reports external prefix-cache queries or external_kv_transfer prompt tokens > 0, or "
    "LMCache's num_requested_tokens/num_stored_tokens rose within the last "
    f"{ACTIVITY_WINDOW_S:g} s (from 0 at exporter start). 0 while vLLM serves traffic means "
    "offloading is not wired."
)


@dataclass(frozen=True)
class ExporterConfig:
    vllm_metrics_url: str = "http://127.0.0.1:8000/metrics"
    multiproc_dir: str | None = None
    scrape_timeout: float = 2.0
    kv_bytes_per_token: int = 0  # per replica; 0: unknown, no gpu capacity
    capacity: TierCapacity = TierCapacity()


class TierCollector(Collector):
    """prometheus_client custom collector; each collect() is one bounded look at every source."""

    def __init__(self, config: ExporterConfig, disk: DiskTierMonitor | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.disk = disk
        self.health = {name: SourceHealth(name) for name in ("vllm", "lmcache")}
        if disk is not None:
            self.health["disk"] = disk.health
        self._clock = clock
        # Concurrent scrapes (an HA Prometheus pair) look at the sources in parallel, each bounded
        # by the scrape timeout; only the offload-activity state is shared.
        self._activity_lock = threading.Lock()
        self._lmcache_progress = 0.0
        self._last_move: float | None = None

    def describe(self) -> list[Metric]:
        return []  # keeps registration from running a (network) look

    def collect(self) -> Iterator[Metric]:
        yield from self._look()

    def _look(self) -> list[Metric]:
        vllm = self._look_vllm()
        lmc = self._look_lmcache(vllm)
        disk = self.disk.latest if self.disk is not None else None
        if vllm is not None and vllm.process_start is not None and self.disk is not None:
            self.disk.cutoff = vllm.process_start  # files older than vLLM were left by an earlier pod
        return _families(self.config, vllm, lmc, disk, self._offload_active(vllm, lmc), self.health)

    def _look_vllm(self) -> VllmSnapshot | None:
        try:
            snap = parse_vllm(fetch_text(self.config.vllm_metrics_url, self.config.scrape_timeout))
        except SourceError as exc:
            self.health["vllm"].fail(str(exc))
            return None
        self.health["vllm"].ok()
        return snap

    def _look_lmcache(self, vllm: VllmSnapshot | None) -> LmcacheSnapshot | None:
        try:
            if self.config.multiproc_dir is not None:
                families = read_multiproc_dir(self.config.multiproc_dir)
            elif vllm is not None:
                families = vllm.lmcache_families
            else:
                raise SourceError("no --multiproc-dir and vLLM unreachable")
            snap = parse_lmcache(families)
        except SourceError as exc:
            self.health["lmcache"].fail(str(exc))
            return None
        self.health["lmcache"].ok()
        return snap

    def _offload_active(self, vllm: VllmSnapshot | None, lmc: LmcacheSnapshot | None) -> bool:
        if lmc is None:
            return False
        progress = lmc.requested_tokens + lmc.stored_tokens
        with self._activity_lock:
            now = self._clock()
            if progress != self._lmcache_progress and progress > 0:  # rose, or LMCache restarted and moved
                self._last_move = now
            self._lmcache_progress = progress
            moving = self._last_move is not None and now - self._last_move <= ACTIVITY_WINDOW_S
        consulted = vllm is not None and ((vllm.external_queries or 0) > 0
                                          or (vllm.external_prompt_tokens or 0) > 0)
        return moving or consulted


def _families(config: ExporterConfig, vllm: VllmSnapshot | None, lmc: LmcacheSnapshot | None,
              disk: DiskScan | None, active: bool, health: dict[str, SourceHealth]) -> list[Metric]:
    """Pure: figures in, families out. A figure whose source is down is left out, never zeroed."""
    capacity = GaugeMetricFamily(
        "kvoffload_tier_capacity_bytes",
        "Bytes the KV-cache tier may hold in this pod. gpu: vLLM num_gpu_blocks x block_size "
        "(vllm:cache_config_info) x --kv-bytes-per-token; cpu/disk: LMCache max_local_cpu_size/"
        "max_local_disk_size GiB x --tensor-parallel-size.", labels=["tier"])
    used = GaugeMetricFamily(
        "kvoffload_tier_used_bytes",
        "Bytes the KV-cache tier holds. gpu: vllm:kv_cache_usage_perc x gpu capacity; cpu: "
        "sum of lmcache:local_cache_usage; disk: sum of lmcache:local_storage_usage (what LMCache "
        "accounts for; see kvoffload_disk_bytes for what is on disk).", labels=["tier"])
    hits = CounterMetricFamily(
        "kvoffload_tier_hit_tokens",
        "Prompt tokens found in the tier. gpu: vllm:prefix_cache_hits; external (LMCache cpu+disk, "
        "which LMCache 0.5.6 does not split): lmcache:num_hit_tokens (max over TP workers), or "
        "vllm:external_prefix_cache_hits when LMCache metrics are absent.", labels=["tier"])
    requested = CounterMetricFamily(
        "kvoffload_tier_requested_tokens",
        "Prompt tokens looked up in the tier; hit ratio = hit_tokens / requested_tokens. gpu: "
        "vllm:prefix_cache_queries; external: lmcache:num_requested_tokens (max over TP workers), "
        "or vllm:external_prefix_cache_queries when LMCache metrics are absent.", labels=["tier"])
    evictions = CounterMetricFamily(
        "kvoffload_tier_evictions",
        "Chunks evicted from the tier. cpu: lmcache:local_cpu_evict_keys_count summed over TP "
        "workers; disk: chunk files that disappeared from the disk-tier directory between rescans "
        "(LMCache 0.5.6 exports no disk eviction metric). vLLM exports no GPU eviction count.",
        labels=["tier"])

    if vllm is not None:
        gpu_tokens = sum(vllm.gpu_tokens.values())
        if gpu_tokens and config.kv_bytes_per_token:
            capacity.add_metric(["gpu"], gpu_tokens * config.kv_bytes_per_token)
            used.add_metric(["gpu"], config.kv_bytes_per_token * sum(
                vllm.kv_usage.get(engine, 0.0) * tokens for engine, tokens in vllm.gpu_tokens.items()))
        if vllm.prefix_hits is not None and vllm.prefix_queries is not None:
            hits.add_metric(["gpu"], vllm.prefix_hits)
            requested.add_metric(["gpu"], vllm.prefix_queries)
    if config.capacity.cpu_bytes is not None:
        capacity.add_metric(["cpu"], config.capacity.cpu_bytes)
    if config.capacity.disk_bytes is not None:
        capacity.add_metric(["disk"], config.capacity.disk_bytes)
    if lmc is not None:
        used.add_metric(["cpu"], lmc.cpu_used_bytes)
        used.add_metric(["disk"], lmc.disk_used_bytes)
        hits.add_metric(["external"], lmc.hit_tokens)
        requested.add_metric(["external"], lmc.requested_tokens)
        evictions.add_metric(["cpu"], lmc.cpu_evicted_chunks)
    elif vllm is not None and vllm.external_hits is not None and vllm.external_queries is not None:
        hits.add_metric(["external"], vllm.external_hits)
        requested.add_metric(["external"], vllm.external_queries)

    families: list[Metric] = [capacity, used, hits, requested, evictions]
    if disk is not None:
        evictions.add_metric(["disk"], disk.removed_files)
        if lmc is not None:
            orphaned = max(0, disk.bytes - lmc.disk_used_bytes)
        else:
            orphaned = disk.old_bytes or 0
        families += [
            GaugeMetricFamily("kvoffload_disk_bytes",
                              "Bytes in regular files under the disk-tier directory (last rescan).",
                              value=disk.bytes),
            GaugeMetricFamily("kvoffload_disk_files",
                              "Regular files (LMCache chunk files) under the disk-tier directory.",
                              value=disk.files),
            GaugeMetricFamily("kvoffload_disk_free_bytes",
                              "Bytes available to the pod on the disk tier's filesystem (statvfs).",
                              value=disk.free_bytes),
            GaugeMetricFamily(
                "kvoffload_disk_orphaned_bytes",
                "Bytes on disk LMCache does not account for and will never reuse or evict: disk "
                "dir bytes - sum of lmcache:local_storage_usage (floor 0); without LMCache metrics, "
                "bytes in files last modified before vLLM started (its process_start_time_seconds, "
                "else the exporter's start): files left by an earlier process.",
                value=orphaned),
            GaugeMetricFamily("kvoffload_disk_last_rescan_timestamp_seconds",
                              "When the last successful rescan of the disk-tier directory ended.",
                              value=disk.finished_at),
        ]

    families.append(GaugeMetricFamily("kvoffload_offload_active", OFFLOAD_ACTIVE_HELP, value=int(active)))
    errors = CounterMetricFamily(
        "kvoffload_scrape_errors",
        "Failed reads of a source: vllm and lmcache per scrape, disk per background rescan.",
        labels=["source"])
    up = GaugeMetricFamily("kvoffload_source_up", "1 if the last read of the source succeeded.",
                           labels=["source"])
    for name, h in health.items():
        errors.add_metric([name], h.errors)
        up.add_metric([name], int(h.up))
    return families + [errors, up]
