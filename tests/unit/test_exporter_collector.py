"""What /metrics says: exact tier figures from the real samples, metric hygiene, the
offload-active rule, and every failure mode (keep serving, count, log once, bounded time)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.exporter import collector as collector_mod
from kvoffload.exporter.capacity import GiB, capacity_from_config
from kvoffload.exporter.collector import ExporterConfig, TierCollector
from kvoffload.exporter.disk_tier import DiskTierMonitor
from kvoffload.exporter.sources import SourceHealth
from kvtest.exporter import FakeVllm, write_lmcache_metrics

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VLLM_TEXT = (FIXTURES / "vllm-0.33.0-metrics-sample" / "exposition.txt").read_text()
LMCACHE_SAMPLE = FIXTURES / "lmcache-0.5.6-metrics-sample"
MULTIPROC = str(LMCACHE_SAMPLE / "multiproc")
CACHE_CONFIG_INFO = (
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
)
CAPACITY = capacity_from_config({"max_local_cpu_size": 40, "local_disk": "file:///mnt/nvme/p/",
                             "max_local_disk_size": 100}, 2)
KV_BYTES_PER_TOKEN = 131072  # Llama-3-8B


def without_external_queries(text: str) -> str:
    return re.sub(r"^(vllm:external_prefix_cache_\w+_total\{[^}]*\}) \S+$", r"\1 0.0", text, flags=re.M)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def make(config: ExporterConfig, disk: DiskTierMonitor | None = None,
         clock=time.monotonic) -> tuple[CollectorRegistry, TierCollector]:  # type: ignore[no-untyped-def]
    collector = TierCollector(config, disk, clock=clock)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry, collector


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tier_figures_from_the_real_samples(tmp_path: Path) -> None:
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    for i in range(4):
        (disk_dir / f"chunk{i}.pt").write_bytes(b"k" * 2500)
    disk = DiskTierMonitor(str(disk_dir), interval=3600, health=SourceHealth("disk"))
    disk.rescan_now()
    with FakeVllm(VLLM_TEXT + CACHE_CONFIG_INFO) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=MULTIPROC,
                                          kv_bytes_per_token=KV_BYTES_PER_TOKEN, capacity=CAPACITY), disk)
        m = scrape(registry)

    gpu_capacity = 1000 * 16 * KV_BYTES_PER_TOKEN
    assert value(m, "kvoffload_tier_capacity_bytes", tier="gpu") == gpu_capacity
    assert value(m, "kvoffload_tier_used_bytes", tier="gpu") == pytest.approx(0.42 * gpu_capacity)
    assert value(m, "kvoffload_tier_capacity_bytes", tier="cpu") == 80 * GiB  # 40 GiB x TP 2
    assert value(m, "kvoffload_tier_capacity_bytes", tier="disk") == 200 * GiB
    assert value(m, "kvoffload_tier_used_bytes", tier="cpu") == 21474836480
    assert value(m, "kvoffload_tier_used_bytes", tier="disk") == 64424509440
    assert value(m, "kvoffload_tier_hit_tokens_total", tier="gpu") == 4096
    assert value(m, "kvoffload_tier_requested_tokens_total", tier="gpu") == 12288
    assert value(m, "kvoffload_tier_hit_tokens_total", tier="external") == 8192
    assert value(m, "kvoffload_tier_requested_tokens_total", tier="external") == 12288
    assert value(m, "kvoffload_tier_evictions_total", tier="cpu") == 5
    assert value(m, "kvoffload_tier_evictions_total", tier="disk") == 0
    assert value(m, "kvoffload_disk_bytes") == 10000
    assert value(m, "kvoffload_disk_files") == 4
    assert value(m, "kvoffload_disk_free_bytes") > 0
    assert value(m, "kvoffload_disk_orphaned_bytes") == 0  # LMCache accounts for 60 GiB > 10 kB
    assert value(m, "kvoffload_offload_active") == 1
    for source in ("vllm", "lmcache", "disk"):
        assert value(m, "kvoffload_source_up", source=source) == 1
        assert value(m, "kvoffload_scrape_errors_total", source=source) == 0


def test_metric_hygiene() -> None:
    with FakeVllm(VLLM_TEXT + CACHE_CONFIG_INFO) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=MULTIPROC,
                                          kv_bytes_per_token=1, capacity=CAPACITY))
        text = generate_latest(registry).decode()
    families = list(text_string_to_metric_families(text))
    assert len(families) >= 8
    for fam in families:
        assert fam.name.startswith("kvoffload_"), fam.name
        assert fam.documentation, f"{fam.name} has no HELP"
        assert f"# HELP {fam.name}" in text
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples), fam.name
        for s in fam.samples:
            assert s.labels.get("tier", "gpu") in {"gpu", "cpu", "disk", "external"}
            assert not re.search(r"_(kib|mib|gib|kb|mb|gb|ms|percent)$", s.name)


def test_gpu_capacity_needs_cache_config_info_and_bytes_per_token() -> None:
    with FakeVllm(VLLM_TEXT) as vllm:
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url, kv_bytes_per_token=1))[0])
        assert value(m, "kvoffload_tier_capacity_bytes", tier="gpu") is None
        vllm.body = VLLM_TEXT + CACHE_CONFIG_INFO
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url, kv_bytes_per_token=0))[0])
        assert value(m, "kvoffload_tier_capacity_bytes", tier="gpu") is None


def test_lmcache_from_vllm_page_without_multiproc_dir() -> None:
    with FakeVllm(VLLM_TEXT + (LMCACHE_SAMPLE / "exposition.txt").read_text()) as vllm:
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url))[0])
    assert value(m, "kvoffload_tier_used_bytes", tier="cpu") == 20 * GiB
    assert value(m, "kvoffload_source_up", source="lmcache") == 1


def test_external_hits_fall_back_to_vllm_when_lmcache_is_absent(tmp_path: Path) -> None:
    with FakeVllm(VLLM_TEXT) as vllm:
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=str(tmp_path)))[0])
    assert value(m, "kvoffload_tier_hit_tokens_total", tier="external") == 8192
    assert value(m, "kvoffload_tier_requested_tokens_total", tier="external") == 8192
    assert value(m, "kvoffload_tier_used_bytes", tier="cpu") is None
    assert value(m, "kvoffload_offload_active") == 0  # vLLM queried a connector, but no LMCache


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_offload_active_rule(tmp_path: Path) -> None:
    mp = tmp_path / "mp"
    mp.mkdir()
    clock = FakeClock()
    with FakeVllm(without_external_queries(VLLM_TEXT)) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=str(mp)), clock=clock)
        active = lambda: value(scrape(registry), "kvoffload_offload_active")  # noqa: E731

        assert active() == 0  # no LMCache metrics at all: the most common silent failure
        write_lmcache_metrics(str(mp), counters={"lmcache:num_stored_tokens": 0,
                                                 "lmcache:num_requested_tokens": 0})
        assert active() == 0  # LMCache loaded but never asked: vLLM is not using it
        write_lmcache_metrics(str(mp), counters={"lmcache:num_stored_tokens": 256})
        clock.now += 15
        assert active() == 1  # stored tokens rose since the previous look
        clock.now += collector_mod.ACTIVITY_WINDOW_S - 20
        assert active() == 1  # still within the window
        clock.now += 30
        assert active() == 0  # quiet for longer than the window, and vLLM shows no external queries
        vllm.body = VLLM_TEXT  # vLLM has sent 8,192 tokens of external queries
        assert active() == 1
        shutil.rmtree(mp)
        assert active() == 0  # LMCache metrics gone


def test_offload_active_help_states_the_rule() -> None:
    with FakeVllm(VLLM_TEXT) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url))
        text = generate_latest(registry).decode()
    help_line = next(ln for ln in text.splitlines() if ln.startswith("# HELP kvoffload_offload_active"))
    for words in ("LMCache metrics are present", "external prefix-cache queries", "rose within the last 300 s"):
        assert words in help_line


def test_vllm_down_keeps_serving_counts_and_logs_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvoffload.exporter")
    port = _closed_port()
    registry, _ = make(ExporterConfig(vllm_metrics_url=f"http://127.0.0.1:{port}/metrics",
                                      multiproc_dir=MULTIPROC, capacity=CAPACITY))
    for _ in range(3):
        m = scrape(registry)
    assert value(m, "kvoffload_source_up", source="vllm") == 0
    assert value(m, "kvoffload_scrape_errors_total", source="vllm") == 3
    assert value(m, "kvoffload_tier_used_bytes", tier="cpu") == 20 * GiB  # LMCache still read
    assert value(m, "kvoffload_tier_hit_tokens_total", tier="gpu") is None  # unknown, not zero
    warnings = [r for r in caplog.records if "source vllm failing" in r.getMessage()]
    assert len(warnings) == 1

    with FakeVllm("garbage{{{ not prometheus\n") as vllm:  # a different error: logged again
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=MULTIPROC))
        scrape(registry)
        scrape(registry)
        vllm.body = VLLM_TEXT
        m = scrape(registry)
    assert value(m, "kvoffload_source_up", source="vllm") == 1
    assert value(m, "kvoffload_scrape_errors_total", source="vllm") == 2
    messages = [r.getMessage() for r in caplog.records]
    assert sum("source vllm failing: no vllm:kv_cache_usage_perc" in msg for msg in messages) == 1
    assert sum("source vllm recovered" in msg for msg in messages) == 1


@pytest.mark.parametrize("status, body", [(500, "internal error"), (200, 'vllm:kv_cache_usage_perc{x="1" 3\n')])
def test_vllm_errors_and_garbage(status: int, body: str) -> None:
    with FakeVllm(body, status=status) as vllm:
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=MULTIPROC))[0])
    assert value(m, "kvoffload_source_up", source="vllm") == 0
    assert value(m, "kvoffload_scrape_errors_total", source="vllm") == 1


def test_hung_vllm_does_not_block_a_scrape_beyond_the_timeout() -> None:
    with FakeVllm(VLLM_TEXT, delay=10) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=MULTIPROC,
                                          scrape_timeout=0.5))
        start = time.monotonic()
        m = scrape(registry)
        elapsed = time.monotonic() - start
        vllm.delay = 0
    assert elapsed < 1.5
    assert value(m, "kvoffload_source_up", source="vllm") == 0
    assert value(m, "kvoffload_tier_used_bytes", tier="cpu") == 20 * GiB


def test_concurrent_scrapes_each_bounded_by_the_timeout() -> None:
    with FakeVllm(VLLM_TEXT, delay=10) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=MULTIPROC,
                                          scrape_timeout=0.5))
        start = time.monotonic()
        threads = [threading.Thread(target=scrape, args=(registry,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
        vllm.delay = 0
    assert elapsed < 1.5  # not 3 x 0.5 s one after the other


def test_empty_or_missing_multiproc_dir(tmp_path: Path) -> None:
    with FakeVllm(VLLM_TEXT) as vllm:
        for mp in (tmp_path, tmp_path / "missing"):
            registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=str(mp)))
            m = scrape(registry)
            m = scrape(registry)
            assert value(m, "kvoffload_source_up", source="lmcache") == 0
            assert value(m, "kvoffload_scrape_errors_total", source="lmcache") == 2
            assert value(m, "kvoffload_source_up", source="vllm") == 1
            assert value(m, "kvoffload_offload_active") == 0


def test_everything_down_still_answers(tmp_path: Path) -> None:
    disk = DiskTierMonitor(str(tmp_path / "missing"), interval=3600, health=SourceHealth("disk"))
    disk.rescan_now()
    registry, _ = make(ExporterConfig(vllm_metrics_url=f"http://127.0.0.1:{_closed_port()}/metrics",
                                      multiproc_dir=str(tmp_path / "nope")), disk)
    m = scrape(registry)
    assert {value(m, "kvoffload_source_up", source=s) for s in ("vllm", "lmcache", "disk")} == {0}
    assert value(m, "kvoffload_offload_active") == 0
    assert value(m, "kvoffload_disk_bytes") is None


def test_scrape_reads_cached_disk_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "c.pt").write_bytes(b"k" * 10)
    disk = DiskTierMonitor(str(tmp_path), interval=3600, health=SourceHealth("disk"))
    disk.rescan_now()

    def no_walk(*_a, **_k):  # type: ignore[no-untyped-def]
        raise AssertionError("a scrape must not walk the disk-tier directory")

    monkeypatch.setattr(os, "scandir", no_walk)
    monkeypatch.setattr(os, "statvfs", no_walk)
    with FakeVllm(VLLM_TEXT) as vllm:
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=MULTIPROC), disk)[0])
    assert value(m, "kvoffload_disk_bytes") == 10


def test_orphaned_bytes(tmp_path: Path) -> None:
    disk_dir, mp = tmp_path / "disk", tmp_path / "mp"
    disk_dir.mkdir()
    mp.mkdir()
    old = time.time() - 3600  # left by an earlier pod, before vLLM started
    for i in range(3):
        (disk_dir / f"old{i}.pt").write_bytes(b"k" * 1000)
        os.utime(disk_dir / f"old{i}.pt", (old, old))
    for i in range(2):
        (disk_dir / f"new{i}.pt").write_bytes(b"k" * 500)
    disk = DiskTierMonitor(str(disk_dir), interval=3600, health=SourceHealth("disk"))
    recent_start = VLLM_TEXT.replace("process_start_time_seconds 1.79601672347e+09",
                                     f"process_start_time_seconds {time.time() - 60}")
    with FakeVllm(recent_start) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=str(mp)), disk)
        scrape(registry)  # learns vLLM's start time: the cutoff for "left by an earlier process"
        disk.rescan_now()
        m = scrape(registry)
        assert value(m, "kvoffload_disk_bytes") == 4000
        assert value(m, "kvoffload_disk_orphaned_bytes") == 3000  # no LMCache: by age
        write_lmcache_metrics(str(mp), gauges={"lmcache:local_storage_usage": 600})
        m = scrape(registry)
        assert value(m, "kvoffload_disk_orphaned_bytes") == 3400  # dir bytes - LMCache's accounting
        for i in range(3):
            (disk_dir / f"old{i}.pt").unlink()  # someone cleans up
        disk.rescan_now()
        m = scrape(registry)
        assert value(m, "kvoffload_disk_orphaned_bytes") == 400
        assert value(m, "kvoffload_tier_evictions_total", tier="disk") == 3
