"""One look at vLLM, LMCache and the disk tier per scrape, exported as `kvoffload_*` families with
a `tier` label (gpu|cpu|disk, and `external` for LMCache's CPU+disk tiers seen through vLLM's KV
connector, which vLLM does not split).

Where each figure comes from: hits, lookups and prompt-token origins from vLLM's own counters
(what the engine really served); tier bytes, CPU evictions and stored tokens from LMCache (only it
knows them); disk files from the directory itself."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import backends
from ..api.fetch import SourceError, fetch_text
from ..backends.base import LMCACHE_METRICS, SERVER_STATUS, VLLM, Seen
from ..engine import versions as engine_versions
from .capacity import TierCapacity
from .disk_tier import DiskScan, DiskTierMonitor
from .lmcache_metrics import LmcacheSnapshot, parse_lmcache, read_multiproc_dir
from .lmcache_server import ServerSnapshot, fetch_status
from .sources import SourceHealth
from .vllm_metrics import VllmSnapshot, parse_vllm

T = TypeVar("T")  # what one source reads

# vllm:prompt_tokens_by_source{source=...} -> the `origin` label of kvoffload_prompt_tokens_total.
PROMPT_ORIGINS = {"local_cache_hit": "gpu", "external_kv_transfer": "external", "local_compute": "compute"}


@dataclass(frozen=True)
class ExporterConfig:
    vllm_metrics_url: str = "http://127.0.0.1:8000/metrics"
    multiproc_dir: str | None = None
    scrape_timeout: float = 2.0
    kv_bytes_per_token: int = 0  # per replica; 0: unknown, no gpu capacity
    engine_versions_file: str | None = None
    capacity: TierCapacity = TierCapacity()
    backend: str = backends.DEFAULT  # spec.offload.backend
    server_status_url: str | None = None  # the LMCache server's /status (backend lmcache-server)
    # spec.offload.server PerNode: the node whose shared server /status is (read through the resource's node-local
    # Service). Its figures are the node's, not this pod's: served as tier="shared" with this node's name.
    shared_node: str | None = None
    # LMCache publishes its counters every 10 s (LMCacheStatsLogger, log_interval=10) while vLLM counts
    # hits at once: external hits without a retrieve are reported only after they outlast this.
    unloaded_grace_s: float = 25.0


class TierCollector(Collector):
    """prometheus_client custom collector; each collect() is one bounded look at every source."""

    def __init__(self, config: ExporterConfig, disk: DiskTierMonitor | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.disk = disk
        self.clock = clock
        self._lock = threading.Lock()
        self._unloaded_since: float | None = None  # when hits without a retrieve were first seen
        self.backend = backends.get(config.backend, "--backend")
        self.health = {s.label: SourceHealth(s.label) for s in self.backend.sources}
        if disk is not None:
            self.health["disk"] = disk.health
        if config.engine_versions_file is not None:
            self.health["engine"] = SourceHealth("engine")
        # Concurrent scrapes (an HA Prometheus pair) look at the sources in parallel, each bounded
        # by the scrape timeout; they share nothing but the sources' health (locked).

    def describe(self) -> list[Metric]:
        return []  # keeps registration from running a (network) look

    def collect(self) -> Iterator[Metric]:
        yield from self._look()

    def _look(self) -> list[Metric]:
        vllm = self._look_vllm()
        sources = self.backend.sources
        lmc = self._look_lmcache(vllm) if LMCACHE_METRICS in sources else None
        server = self._look_server() if SERVER_STATUS in sources else None
        disk = self.disk.latest if self.disk is not None else None
        if vllm is not None and vllm.process_start is not None and self.disk is not None and self.backend.in_process:
            self.disk.cutoff = vllm.process_start  # files older than vLLM were left by an earlier pod
        seen = Seen(vllm, lmc, server)
        active = self.backend.offload_active(seen)
        unloaded = self._settled(self.backend.unloaded_tokens(seen))
        engine = self._look_engine()
        families = _families(self.config, vllm, lmc, disk, active, unloaded, self.health, server)
        return families + ([engine_info(engine)] if engine is not None else [])

    def _observe(self, source: str, read: Callable[[], T]) -> T | None:
        """read() one source; `source`'s health records whether that worked."""
        try:
            snap = read()
        except SourceError as exc:
            self.health[source].fail(str(exc))
            return None
        self.health[source].ok()
        return snap

    def _look_server(self) -> ServerSnapshot | None:
        def read() -> ServerSnapshot:
            if not self.config.server_status_url:
                raise SourceError("no --lmcache-server-url")
            return fetch_status(self.config.server_status_url, self.config.scrape_timeout)
        return self._observe(SERVER_STATUS.label, read)

    def _settled(self, unloaded: float | None) -> float | None:
        """`unloaded` once it has lasted unloaded_grace_s (LMCache's counters lag vLLM's), else 0."""
        with self._lock:
            if not unloaded:
                self._unloaded_since = None
                return unloaded
            now = self.clock()
            if self._unloaded_since is None:
                self._unloaded_since = now
            return unloaded if now - self._unloaded_since >= self.config.unloaded_grace_s else 0.0

    def _look_vllm(self) -> VllmSnapshot | None:
        url, timeout = self.config.vllm_metrics_url, self.config.scrape_timeout
        return self._observe(VLLM.label, lambda: parse_vllm(fetch_text(url, timeout)))

    def _look_lmcache(self, vllm: VllmSnapshot | None) -> LmcacheSnapshot | None:
        def read() -> LmcacheSnapshot:
            if self.config.multiproc_dir is not None:
                return parse_lmcache(read_multiproc_dir(self.config.multiproc_dir))
            if vllm is not None:
                return parse_lmcache(vllm.lmcache_families)
            raise SourceError("no --multiproc-dir and vLLM unreachable")
        return self._observe(LMCACHE_METRICS.label, read)

    def _look_engine(self) -> engine_versions.EngineVersions | None:
        # A few bytes, read at every scrape: no state to keep, and a rewritten file is seen at once.
        path = self.config.engine_versions_file
        if path is None:
            return None
        try:
            with open(path, encoding="utf-8") as f:
                found = engine_versions.parse(f.read(4096))
        except OSError as exc:
            self.health["engine"].fail(f"cannot read {path}: {exc.strerror or type(exc).__name__}")
            return None
        except ValueError as exc:
            self.health["engine"].fail(f"{path}: {exc}")
            return None
        self.health["engine"].ok()
        return found


def engine_info(found: engine_versions.EngineVersions) -> Metric:
    info = GaugeMetricFamily(
        "kvoffload_engine_info",
        "1, labelled with the vLLM, LMCache and torch versions the serving image really holds "
        "(importlib.metadata, read by the pod's init container; \"none\": not installed).",
        labels=list(engine_versions.PACKAGES))
    info.add_metric([found.labels()[name] for name in engine_versions.PACKAGES], 1)
    return info


def _shared_tier(config: ExporterConfig, server: ServerSnapshot, capacity: Metric, used: Metric) -> None:
    """PerNode: the node's shared server's L1 and L2 as tier="shared", labelled with the node (the server is the
    resource's on that node), beside this pod's own tier="gpu" samples. Every replica on the node serves the same
    figures: a sum over pods counts the server once per replica, a max by node counts it once."""
    def add(family: Metric, medium: str, value: float) -> None:
        family.add_sample(family.name, {"tier": "shared", "medium": medium, "node": str(config.shared_node)}, value)

    add(capacity, "cpu", server.l1_total_bytes)
    add(used, "cpu", server.l1_used_bytes)
    # The L2's capacity as LMCache tracks it, else the one the operator rendered (an L2 without an eviction block).
    l2_capacity = server.l2_capacity_bytes if server.l2_capacity_bytes is not None else config.capacity.disk_bytes
    if l2_capacity is not None:
        add(capacity, "disk", l2_capacity)
    if server.l2_used_bytes is not None:
        add(used, "disk", server.l2_used_bytes)


def _engines(config: ExporterConfig, server: ServerSnapshot) -> Metric:
    help_ = ("vLLM workers that registered their KV caches with the pod's LMCache server (its /status: "
             "registered_gpu_ids + registered_non_cuda_instance_ids); 0 means vLLM is not connected.")
    if config.shared_node is None:
        return GaugeMetricFamily("kvoffload_lmcache_server_engines", help_, value=server.engines)
    engines = GaugeMetricFamily(
        "kvoffload_lmcache_server_engines",
        "vLLM workers of every replica on the node that registered with the node's shared LMCache server "
        "(PerNode; its /status: registered_gpu_ids + registered_non_cuda_instance_ids, which name no pod); "
        "the same figure from each replica there: take max by (node).", labels=["node"])
    engines.add_metric([config.shared_node], server.engines)
    return engines


def _families(config: ExporterConfig, vllm: VllmSnapshot | None, lmc: LmcacheSnapshot | None,
              disk: DiskScan | None, active: bool, unloaded: float | None, health: dict[str, SourceHealth],
              server: ServerSnapshot | None = None) -> list[Metric]:
    """Pure: figures in, families out. A figure whose source is down is left out, never zeroed."""
    capacity = GaugeMetricFamily(
        "kvoffload_tier_capacity_bytes",
        "Bytes the KV-cache tier may hold in this pod. gpu: vLLM num_gpu_blocks x block_size "
        "(vllm:cache_config_info) x --kv-bytes-per-token; cpu/disk: LMCache max_local_cpu_size/"
        "max_local_disk_size GiB x --tensor-parallel-size (lmcache), the LMCache server's L1 total "
        "from its /status (lmcache-server), else --cpu-capacity-bytes/--disk-capacity-bytes. shared "
        "(spec.offload.server PerNode), labelled medium and node: the node's shared server's L1 (cpu) and L2 "
        "(disk), the same figures from every replica on that node: take max by (node, medium), never a sum "
        "over pods.", labels=["tier"])
    used = GaugeMetricFamily(
        "kvoffload_tier_used_bytes",
        "Bytes the KV-cache tier holds. gpu: vllm:kv_cache_usage_perc x gpu capacity (absent until "
        "vLLM publishes it, just after start); cpu: sum of lmcache:local_cache_usage (lmcache), the "
        "LMCache server's L1 memory_used_bytes (lmcache-server), absent for vllm-native (vLLM exports "
        "no fill level of its CPU tier); disk: sum of lmcache:local_storage_usage (what LMCache "
        "accounts for; see kvoffload_disk_bytes for what is on disk). shared (PerNode), labelled medium and "
        "node: the node's shared server's L1 memory_used_bytes (cpu) and its L2 adapters' total_bytes_used "
        "(disk), one copy per replica on that node: take max by (node, medium).", labels=["tier"])
    hits = CounterMetricFamily(
        "kvoffload_tier_hit_tokens",
        "Prompt tokens found in the tier, as vLLM counts them. gpu: vllm:prefix_cache_hits; "
        "external (LMCache's cpu+disk tiers through the KV connector; vLLM does not split them): "
        "vllm:external_prefix_cache_hits.", labels=["tier"])
    requested = CounterMetricFamily(
        "kvoffload_tier_requested_tokens",
        "Prompt tokens looked up in the tier, as vLLM counts them; hit ratio = hit_tokens / "
        "requested_tokens. gpu: vllm:prefix_cache_queries; external: "
        "vllm:external_prefix_cache_queries (the tokens the GPU prefix cache missed).", labels=["tier"])
    origins = CounterMetricFamily(
        "kvoffload_prompt_tokens",
        "Prompt tokens by where their KV came from, from vllm:prompt_tokens_by_source: gpu "
        "(local_cache_hit: vLLM's GPU prefix cache), external (external_kv_transfer: loaded from "
        "LMCache's cpu/disk tiers), compute (local_compute: prefilled). The three add up to "
        "vllm:prompt_tokens.", labels=["origin"])
    stored = CounterMetricFamily(
        "kvoffload_tier_stored_tokens",
        "Tokens LMCache stored into its tiers. external: lmcache:num_stored_tokens (max over TP "
        "workers).", labels=["tier"])
    evictions = CounterMetricFamily(
        "kvoffload_tier_evictions",
        "Chunks evicted from the tier. cpu: lmcache:local_cpu_evict_keys_count summed over TP "
        "workers; disk: chunk files that disappeared from the disk-tier directory between rescans "
        "(LMCache exports no disk eviction metric). vLLM exports no GPU eviction count.",
        labels=["tier"])

    if vllm is not None:
        gpu_tokens = sum(vllm.gpu_tokens.values())
        if gpu_tokens and config.kv_bytes_per_token:
            capacity.add_metric(["gpu"], gpu_tokens * config.kv_bytes_per_token)
            if vllm.kv_usage:
                used.add_metric(["gpu"], config.kv_bytes_per_token * sum(
                    vllm.kv_usage.get(engine, 0.0) * tokens for engine, tokens in vllm.gpu_tokens.items()))
        for tier, tier_hits, tier_queries in (("gpu", vllm.prefix_hits, vllm.prefix_queries),
                                              ("external", vllm.external_hits, vllm.external_queries)):
            if tier_hits is not None and tier_queries is not None:
                hits.add_metric([tier], tier_hits)
                requested.add_metric([tier], tier_queries)
        for source, origin in PROMPT_ORIGINS.items():
            if source in vllm.prompt_tokens:
                origins.add_metric([origin], vllm.prompt_tokens[source])
    shared = config.shared_node is not None  # the cpu and disk tiers are the node's, not this pod's
    if shared:
        if server is not None:
            _shared_tier(config, server, capacity, used)
    elif server is not None:
        capacity.add_metric(["cpu"], server.l1_total_bytes)  # the L1 in force
    elif config.capacity.cpu_bytes is not None:
        capacity.add_metric(["cpu"], config.capacity.cpu_bytes)
    if config.capacity.disk_bytes is not None and not shared:
        capacity.add_metric(["disk"], config.capacity.disk_bytes)
    if lmc is not None:
        used.add_metric(["cpu"], lmc.cpu_used_bytes)
        used.add_metric(["disk"], lmc.disk_used_bytes)
        stored.add_metric(["external"], lmc.stored_tokens)
        evictions.add_metric(["cpu"], lmc.cpu_evicted_chunks)

    families: list[Metric] = [capacity, used, hits, requested, origins, stored, evictions]
    if server is not None:
        if not shared:
            used.add_metric(["cpu"], server.l1_used_bytes)
        families.append(_engines(config, server))
    if vllm is not None and vllm.offload_store_bytes is not None:
        moved = CounterMetricFamily(
            "kvoffload_offload_transfer_bytes",
            "Bytes vLLM's native offloading moved (backend vllm-native): store = GPU -> CPU tier "
            "(vllm:kv_offload_store_bytes), load = CPU tier -> GPU (vllm:kv_offload_load_bytes).",
            labels=["direction"])
        moved.add_metric(["store"], vllm.offload_store_bytes)
        moved.add_metric(["load"], vllm.offload_load_bytes or 0.0)
        families.append(moved)
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
                "Bytes on disk LMCache does not account for and never evicts (backend lmcache never reads them "
                "again; lmcache-server reads the files its pod kept at start, docs/disk-tier.md): disk "
                "dir bytes - sum of lmcache:local_storage_usage (floor 0); without LMCache metrics, "
                "bytes in files last modified before vLLM started (its process_start_time_seconds, "
                "else the exporter's start): files left by an earlier process.",
                value=orphaned),
            GaugeMetricFamily("kvoffload_disk_last_rescan_timestamp_seconds",
                              "When the last successful rescan of the disk-tier directory ended.",
                              value=disk.finished_at),
        ]

    backend = backends.get(config.backend)
    families.append(GaugeMetricFamily("kvoffload_offload_active", backend.offload_active_help(), value=int(active)))
    if unloaded is not None:
        families.append(GaugeMetricFamily("kvoffload_external_hits_unloaded_tokens", backend.unloaded_help,
                                          value=unloaded))
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
