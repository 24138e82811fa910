"""What /metrics says: exact figures from the real vLLM 0.26.0 + LMCache 0.5.3 pages (H200) and
samples, metric hygiene, the offload-active rule, and every failure mode (keep serving, count, log
once, bounded time)."""

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

from kvoffload.exporter.capacity import GiB, capacity_from_config
from kvoffload.exporter.collector import ExporterConfig, TierCollector
from kvoffload.exporter.disk_tier import DiskTierMonitor
from kvoffload.exporter.sources import SourceHealth
from kvtest.exporter import FakeVllm, write_lmcache_metrics

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VLLM_TEXT = (FIXTURES / "vllm-0.33.0-metrics-sample" / "exposition.txt").read_text()
H200 = FIXTURES / "vllm-0.26.0-lmcache-0.5.3-h200"
WITH_LMCACHE = (H200 / "vllm-metrics-with-lmcache.txt").read_text()
WITHOUT_CONNECTOR = (H200 / "vllm-metrics-without-connector.txt").read_text()
# The same engine pair with VLLM_USE_V2_MODEL_RUNNER=0 (H200, benchmarks/gpu): LMCache really loads.
V1_RUNNER = (FIXTURES / "vllm-0.26.0-lmcache-0.5.3-h200-v1runner" / "vllm-metrics-with-lmcache.txt").read_text()
LMCACHE_SAMPLE = FIXTURES / "lmcache-0.5.6-metrics-sample"
MULTIPROC = str(LMCACHE_SAMPLE / "multiproc")
CACHE_CONFIG_INFO = (
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
)
CAPACITY = capacity_from_config({"max_local_cpu_size": 40, "local_disk": "file:///mnt/nvme/p/",
                             "max_local_disk_size": 100}, 2)
KV_BYTES_PER_TOKEN = 131072  # Llama-3-8B


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
         clock=time.monotonic) -> tuple[CollectorRegistry, TierCollector]:
    collector = TierCollector(config, disk, clock)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry, collector


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_figures_from_the_real_h200_page_with_lmcache() -> None:
    """vLLM 0.26.0 + LMCache 0.5.3 (default V2 model runner) after 2 x (cold, GPU hit, reset + reload)
    of 32,000 tokens: vLLM counts 64,028 tokens as loaded from its connector, but LMCache never
    retrieved (lmcache:num_retrieve_requests_total 0): the V2 runner gave it no attention metadata, so
    vLLM skipped those tokens' prefill without their KV. Offload is NOT active. (This test used to
    assert active == 1: that belief was false.) No --multiproc-dir: LMCache's figures come from
    vLLM's shared page."""
    with FakeVllm(WITH_LMCACHE) as vllm:
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                                       capacity=capacity_from_config({"max_local_cpu_size": 2}, 1),
                                       unloaded_grace_s=0))[0])

    assert value(m, "kvoffload_tier_hit_tokens_total", tier="external") == 64028
    assert value(m, "kvoffload_tier_requested_tokens_total", tier="external") == 128544
    assert value(m, "kvoffload_tier_hit_tokens_total", tier="gpu") == 63968
    assert value(m, "kvoffload_tier_requested_tokens_total", tier="gpu") == 192512
    assert value(m, "kvoffload_prompt_tokens_total", origin="gpu") == 63968
    assert value(m, "kvoffload_prompt_tokens_total", origin="external") == 64028
    assert value(m, "kvoffload_prompt_tokens_total", origin="compute") == 64516
    assert value(m, "kvoffload_tier_stored_tokens_total", tier="external") == 64512
    gpu_capacity = 119475 * 16 * KV_BYTES_PER_TOKEN  # num_gpu_blocks x block_size from cache_config_info
    assert value(m, "kvoffload_tier_capacity_bytes", tier="gpu") == gpu_capacity
    assert value(m, "kvoffload_tier_used_bytes", tier="gpu") == 0  # idle when the page was taken
    assert value(m, "kvoffload_tier_capacity_bytes", tier="cpu") == 2 * GiB
    assert value(m, "kvoffload_tier_used_bytes", tier="cpu") == 2 * GiB  # full: 124 evictions
    assert value(m, "kvoffload_tier_used_bytes", tier="disk") == 4227858432
    assert value(m, "kvoffload_tier_evictions_total", tier="cpu") == 124
    assert value(m, "kvoffload_offload_active") == 0
    assert value(m, "kvoffload_external_hits_unloaded_tokens") == 64028
    for source in ("vllm", "lmcache"):
        assert value(m, "kvoffload_source_up", source=source) == 1
        assert value(m, "kvoffload_scrape_errors_total", source=source) == 0


def test_figures_from_the_real_h200_page_with_the_v1_runner() -> None:
    """The same pair with VLLM_USE_V2_MODEL_RUNNER=0 (what the operator renders), H200: cold, GPU hit,
    reset + reload of a 32,768-token prompt, 3 times each. LMCache retrieved 6 times (99,072 tokens),
    vLLM counted 98,346 external hits: offload is active, nothing unloaded."""
    with FakeVllm(V1_RUNNER) as vllm:
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url, unloaded_grace_s=0))[0])
    assert value(m, "kvoffload_tier_hit_tokens_total", tier="external") == 98346
    assert value(m, "kvoffload_tier_requested_tokens_total", tier="external") == 197168
    assert value(m, "kvoffload_tier_hit_tokens_total", tier="gpu") == 98256
    assert value(m, "kvoffload_tier_requested_tokens_total", tier="gpu") == 295424
    assert value(m, "kvoffload_prompt_tokens_total", origin="external") == 98346
    assert value(m, "kvoffload_prompt_tokens_total", origin="compute") == 98822
    assert value(m, "kvoffload_tier_stored_tokens_total", tier="external") == 98816
    assert value(m, "kvoffload_offload_active") == 1
    assert value(m, "kvoffload_external_hits_unloaded_tokens") == 0


def test_unloaded_hits_are_reported_after_lmcaches_publish_lag() -> None:
    """LMCache publishes its counters every 10 s, vLLM counts hits at once: hits without a retrieve
    are 'not yet proven' (active 0, unloaded 0) until they outlast the grace, then reported; a
    retrieve clears them."""
    now = [100.0]
    with FakeVllm(WITH_LMCACHE) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url), clock=lambda: now[0])
        look = lambda: (value(m := scrape(registry), "kvoffload_offload_active"),  # noqa: E731
                        value(m, "kvoffload_external_hits_unloaded_tokens"))
        assert look() == (0, 0)
        now[0] += 24.9
        assert look() == (0, 0)
        now[0] += 0.1  # 25 s: two LMCache publishes and a margin
        assert look() == (0, 64028)
        series = ('lmcache:num_retrieve_requests_total{model_name="/tmp/e2e_model",role="worker",'
                  'served_model_name="meta-llama/Llama-3.1-8B-Instruct",worker_id="0"}')
        vllm.body = WITH_LMCACHE.replace(series + ' 0.0', series + ' 2.0')
        assert look() == (1, 0)
        vllm.status = 503
        assert look() == (0, None)  # vLLM unreadable: nothing judged


def test_figures_from_the_real_h200_page_without_connector() -> None:
    with FakeVllm(WITHOUT_CONNECTOR) as vllm:
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url))[0])
    assert value(m, "kvoffload_tier_hit_tokens_total", tier="external") == 0
    assert value(m, "kvoffload_tier_requested_tokens_total", tier="external") == 0
    assert value(m, "kvoffload_tier_hit_tokens_total", tier="gpu") == 63968
    assert value(m, "kvoffload_prompt_tokens_total", origin="external") == 0
    assert value(m, "kvoffload_prompt_tokens_total", origin="compute") == 128544
    assert value(m, "kvoffload_tier_stored_tokens_total", tier="external") is None  # no LMCache: unknown
    assert value(m, "kvoffload_offload_active") == 0
    assert value(m, "kvoffload_external_hits_unloaded_tokens") is None  # no LMCache: not judged
    assert value(m, "kvoffload_source_up", source="vllm") == 1
    assert value(m, "kvoffload_source_up", source="lmcache") == 0


def test_page_before_kv_cache_usage_is_published_is_not_an_error() -> None:
    """Right after start vLLM serves /metrics without vllm:kv_cache_usage_perc: gpu used bytes is
    absent (not yet), everything else is read, no scrape error is counted."""
    early = "".join(ln for ln in WITH_LMCACHE.splitlines(keepends=True)
                    if not ln.startswith("vllm:kv_cache_usage_perc"))
    with FakeVllm(early) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, kv_bytes_per_token=KV_BYTES_PER_TOKEN))
        m = scrape(registry)
        assert value(m, "kvoffload_tier_used_bytes", tier="gpu") is None
        assert value(m, "kvoffload_tier_capacity_bytes", tier="gpu") == 119475 * 16 * KV_BYTES_PER_TOKEN
        assert value(m, "kvoffload_tier_hit_tokens_total", tier="external") == 64028
        assert value(m, "kvoffload_source_up", source="vllm") == 1
        assert value(m, "kvoffload_scrape_errors_total", source="vllm") == 0
        vllm.body = WITH_LMCACHE  # published a moment later
        m = scrape(registry)
    assert value(m, "kvoffload_tier_used_bytes", tier="gpu") == 0
    assert value(m, "kvoffload_scrape_errors_total", source="vllm") == 0


def test_tier_figures_from_the_real_samples(tmp_path: Path) -> None:
    """The pod's wiring: hits from vLLM's page, tier bytes / evictions / stored tokens from LMCache's
    multiprocess files (LMCache 0.5.6's own, which win over the lmcache:* lines on vLLM's page)."""
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    for i in range(4):
        (disk_dir / f"chunk{i}.pt").write_bytes(b"k" * 2500)
    disk = DiskTierMonitor(str(disk_dir), interval=3600, health=SourceHealth("disk"))
    disk.rescan_now()
    with FakeVllm(WITH_LMCACHE) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=MULTIPROC,
                                          kv_bytes_per_token=KV_BYTES_PER_TOKEN, capacity=CAPACITY), disk)
        m = scrape(registry)

    assert value(m, "kvoffload_tier_capacity_bytes", tier="cpu") == 80 * GiB  # 40 GiB x TP 2
    assert value(m, "kvoffload_tier_capacity_bytes", tier="disk") == 200 * GiB
    assert value(m, "kvoffload_tier_used_bytes", tier="cpu") == 21474836480
    assert value(m, "kvoffload_tier_used_bytes", tier="disk") == 64424509440
    assert value(m, "kvoffload_tier_stored_tokens_total", tier="external") == 16384
    assert value(m, "kvoffload_tier_evictions_total", tier="cpu") == 5
    assert value(m, "kvoffload_tier_evictions_total", tier="disk") == 0
    # LMCache 0.5.6's files say 8,192 hit of 12,288 requested; the figures are vLLM's.
    assert value(m, "kvoffload_tier_hit_tokens_total", tier="external") == 64028
    assert value(m, "kvoffload_tier_requested_tokens_total", tier="external") == 128544
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
            assert s.labels.get("origin", "gpu") in {"gpu", "external", "compute"}
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


def test_lmcache_hit_counters_are_not_read(tmp_path: Path) -> None:
    """Hit figures are vLLM's whatever LMCache's num_hit_tokens / num_requested_tokens say (they count
    only LMCache's own loads: 0 under vLLM 0.26.0's V2 runner, 99,072 under the V1 runner)."""
    write_lmcache_metrics(str(tmp_path), counters={"lmcache:num_hit_tokens": 999, "lmcache:num_requested_tokens": 999})
    with FakeVllm(WITHOUT_CONNECTOR) as vllm:
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=str(tmp_path)))[0])
    assert value(m, "kvoffload_tier_hit_tokens_total", tier="external") == 0
    assert value(m, "kvoffload_tier_requested_tokens_total", tier="external") == 0
    assert value(m, "kvoffload_offload_active") == 0  # LMCache loaded, vLLM never consulted a connector


def test_offload_active_rule(tmp_path: Path) -> None:
    mp = tmp_path / "mp"
    mp.mkdir()
    before_first_request = WITH_LMCACHE.replace("vllm:external_prefix_cache_queries_total{", "x{")
    with FakeVllm(WITHOUT_CONNECTOR) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, multiproc_dir=str(mp)))
        active = lambda: value(scrape(registry), "kvoffload_offload_active")  # noqa: E731

        assert active() == 0  # no connector, no LMCache metrics: the most common silent failure
        write_lmcache_metrics(str(mp), counters={"lmcache:num_stored_tokens": 256})
        assert active() == 0  # LMCache loaded and even storing, but vLLM never asked a connector
        vllm.body = before_first_request
        assert active() == 0  # no external queries counted yet: not proven
        vllm.body = WITH_LMCACHE  # vLLM asked its connector for 128,544 tokens and counted 64,028 loaded
        assert active() == 0  # ... but LMCache never retrieved (the V2-runner skip): not active
        write_lmcache_metrics(str(mp), counters={"lmcache:num_retrieve_requests": 2})
        assert active() == 1  # LMCache really loaded
        assert active() == 1  # monotone: no window to fall out of while vLLM runs
        shutil.rmtree(mp)
        assert active() == 0  # LMCache metrics gone: the connector answering is not LMCache
        mp.mkdir()
        write_lmcache_metrics(str(mp), counters={"lmcache:num_stored_tokens": 0})
        assert active() == 0  # LMCache is back but has not retrieved since it started
        write_lmcache_metrics(str(mp), counters={"lmcache:num_retrieve_requests": 1})
        assert active() == 1
        vllm.status = 503
        assert active() == 0  # vLLM unreadable: nothing proven


def test_offload_active_help_states_the_rule() -> None:
    with FakeVllm(VLLM_TEXT) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url))
        text = generate_latest(registry).decode()
    help_line = next(ln for ln in text.splitlines() if ln.startswith("# HELP kvoffload_offload_active"))
    for words in ("vllm:external_prefix_cache_queries_total > 0", "LMCache's metrics are present",
                  "lmcache:num_retrieve_requests_total > 0", "0 before the first request"):
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
    assert sum("source vllm failing: no vllm:* figures" in msg for msg in messages) == 1
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


# --- the engine's versions, from the file the serving image's init container wrote -------------------

def test_engine_info_from_the_versions_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from kvoffload.controller.probe import Reading, parse_page

    path = tmp_path / "versions.json"
    with FakeVllm(V1_RUNNER) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, engine_versions_file=str(path)))
        m = scrape(registry)  # the init container has not written it (cannot happen in a pod; counted)
        assert value(m, "kvoffload_source_up", source="engine") == 0
        assert value(m, "kvoffload_scrape_errors_total", source="engine") == 1
        assert not [k for k in m if k[0] == "kvoffload_engine_info"]

        path.write_text('{"vllm": "0.26.0", "lmcache": "0.5.3", "torch": "2.11.0+cu130"}')
        text = generate_latest(registry).decode()
        m = scrape(registry)
        assert value(m, "kvoffload_engine_info", vllm="0.26.0", lmcache="0.5.3", torch="2.11.0+cu130") == 1
        assert value(m, "kvoffload_source_up", source="engine") == 1
        # What the operator's probe makes of the same page.
        assert parse_page(text) == Reading(1.0, {"vllm": "0.26.0", "lmcache": "0.5.3", "torch": "2.11.0+cu130"}, 0.0)

        path.write_text('{"vllm": "0.27.1", "lmcache": null}')
        m = scrape(registry)
        assert value(m, "kvoffload_engine_info", vllm="0.27.1", lmcache="none", torch="none") == 1

        path.write_text("garbage")
        m = scrape(registry)
    assert value(m, "kvoffload_source_up", source="engine") == 0
    assert value(m, "kvoffload_scrape_errors_total", source="engine") == 2
    assert any("source engine failing" in r.getMessage() and "not JSON" in r.getMessage() for r in caplog.records)


def test_probe_reads_the_unloaded_hits() -> None:
    """What the operator's probe makes of the reference page (V2 runner, LMCache never retrieved)."""
    from kvoffload.controller.probe import Reading, parse_page

    with FakeVllm(WITH_LMCACHE) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url, unloaded_grace_s=0))
        assert parse_page(generate_latest(registry).decode()) == Reading(0.0, None, 64028.0)
        vllm.body = V1_RUNNER
        assert parse_page(generate_latest(registry).decode()) == Reading(1.0, None, 0.0)


def test_no_versions_file_flag_no_engine_source() -> None:
    from kvoffload.controller.probe import Reading, parse_page

    with FakeVllm(WITHOUT_CONNECTOR) as vllm:
        registry, _ = make(ExporterConfig(vllm_metrics_url=vllm.url))
        text = generate_latest(registry).decode()
    assert "kvoffload_engine_info" not in text and 'source="engine"' not in text
    assert parse_page(text) == Reading(0.0, None)
    assert parse_page("# nothing\n") == "kvoffload_offload_active missing from the exporter's /metrics"


# ------------------------------------------------------------------ the other backends' real H200 pages
# benchmarks/gpu/results/h200-backends.md: the rendered lmcache-server and vllm-native pods and the
# lmcache pod at TP 2 on NVIDIA H200s (vLLM 0.26.0 + LMCache 0.5.3), pages captured by the benchmark.
BACKENDS = FIXTURES / "h200-backends-vllm-0.26.0-lmcache-0.5.3"


def test_lmcache_whose_init_failed_is_not_active() -> None:
    """TP 2, V1 runner: LMCache's engine failed to start in both workers (a ZMQ ipc path over 107
    characters) and vLLM served on: 197,168 external queries, 0 hits, LMCache's counters all 0. The
    exporter said kvoffload_offload_active 1 on that page; it must say 0."""
    page = ((BACKENDS / "lmcache-tp2-init-failed-vllm.txt").read_text()
            + (BACKENDS / "lmcache-tp2-init-failed-lmcache.txt").read_text())
    # as captured
    assert "kvoffload_offload_active 1.0" in (BACKENDS / "lmcache-tp2-init-failed-exporter.txt").read_text()
    with FakeVllm(page) as vllm:
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url))[0])
    assert value(m, "kvoffload_tier_requested_tokens_total", tier="external") == 197168
    assert value(m, "kvoffload_tier_hit_tokens_total", tier="external") == 0
    assert value(m, "kvoffload_tier_stored_tokens_total", tier="external") == 0
    assert value(m, "kvoffload_source_up", source="lmcache") == 1  # LMCache's families are there, all zero
    assert value(m, "kvoffload_offload_active") == 0


def test_native_offload_figures_from_the_real_h200_page() -> None:
    with FakeVllm((BACKENDS / "native-vllm.txt").read_text()) as vllm:
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url, backend="vllm-native"))[0])
    # 3 prompts x 32,768 tokens x 128 KiB stored, and loaded back after each reset (+16 tokens per GPU-hit phase).
    assert value(m, "kvoffload_offload_transfer_bytes_total", direction="store") == 12952010752
    assert value(m, "kvoffload_offload_transfer_bytes_total", direction="load") == 12891193344
    assert value(m, "kvoffload_prompt_tokens_total", origin="external") == 3 * 32768 + 3 * 16
    assert value(m, "kvoffload_offload_active") == 1
    assert value(m, "kvoffload_source_up", source="lmcache") is None  # no LMCache source for this backend


def test_server_status_from_the_real_h200_server() -> None:
    """The GPU host's /status has no registered_gpu_ids key (engine-driven mode registers a non-CUDA
    instance), unlike the CPU host's; the exporter reads it all the same."""
    doc = (BACKENDS / "server-status-lazy-l1.json").read_text()
    assert '"registered_gpu_ids"' not in doc
    with FakeVllm((BACKENDS / "server-vllm.txt").read_text()) as vllm, FakeVllm(doc) as server:
        m = scrape(make(ExporterConfig(vllm_metrics_url=vllm.url, backend="lmcache-server",
                                       server_status_url=server.url))[0])
    assert value(m, "kvoffload_lmcache_server_engines") == 1
    assert value(m, "kvoffload_tier_capacity_bytes", tier="cpu") == 40 * GiB
    assert value(m, "kvoffload_tier_used_bytes", tier="cpu") == 4362076160
    assert value(m, "kvoffload_offload_active") == 1
