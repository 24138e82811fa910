"""The exporter's inputs: vLLM's /metrics page, LMCache's multiprocess files, the LMCache YAML.
Figures come from the real vLLM 0.33.0 / LMCache 0.5.6 samples in tests/fixtures."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import pytest

from kvoffload.api.errors import ConfigError
from kvoffload.api.fetch import SourceError, fetch_text
from kvoffload.exporter.capacity import GiB, TierCapacity, capacity_from_config, load_capacity
from kvoffload.exporter.lmcache_metrics import parse_lmcache, read_multiproc_dir
from kvoffload.exporter.vllm_metrics import parse_vllm
from kvtest.exporter import FakeVllm, write_lmcache_metrics

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VLLM_TEXT = (FIXTURES / "vllm-0.33.0-metrics-sample" / "exposition.txt").read_text()
LMCACHE_SAMPLE = FIXTURES / "lmcache-0.5.6-metrics-sample"
CACHE_CONFIG_INFO = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
    'gpu_memory_utilization="0.9",num_gpu_blocks="1000"} 1.0\n'
)


# --- vLLM ------------------------------------------------------------------------------------

def test_parse_real_vllm_sample() -> None:
    snap = parse_vllm(VLLM_TEXT)
    assert snap.kv_usage == {"0": 0.42}
    assert (snap.prefix_queries, snap.prefix_hits) == (12288.0, 4096.0)
    assert (snap.external_queries, snap.external_hits) == (8192.0, 8192.0)
    assert snap.external_prompt_tokens == 0.0
    assert snap.process_start == 1.79601672347e9
    assert snap.gpu_tokens == {}  # the sample was made without vllm:cache_config_info
    assert snap.lmcache_families == []


def test_cache_config_info_gives_gpu_tokens() -> None:
    assert parse_vllm(VLLM_TEXT + CACHE_CONFIG_INFO).gpu_tokens == {"0": 16000}
    unknown = CACHE_CONFIG_INFO.replace('num_gpu_blocks="1000"', 'num_gpu_blocks="None"')
    assert parse_vllm(VLLM_TEXT + unknown).gpu_tokens == {}


def test_lmcache_families_on_vllm_page_when_the_dir_is_shared() -> None:
    text = VLLM_TEXT + (LMCACHE_SAMPLE / "exposition.txt").read_text()
    lmc = parse_lmcache(parse_vllm(text).lmcache_families)
    assert (lmc.requested_tokens, lmc.hit_tokens, lmc.stored_tokens) == (12288, 8192, 16384)
    assert (lmc.cpu_used_bytes, lmc.disk_used_bytes) == (20 * GiB, 60 * GiB)


@pytest.mark.parametrize("text, reason", [
    ('vllm:kv_cache_usage_perc{engine="0" 0.4\n', "unparsable"),
    ("vllm:kv_cache_usage_perc{engine=\"0\"} not-a-number\n", "unparsable"),
    ("<html><body>502 Bad Gateway</body></html>", "no vllm:kv_cache_usage_perc"),
    ("", "no vllm:kv_cache_usage_perc"),
])
def test_garbled_vllm_page(text: str, reason: str) -> None:
    with pytest.raises(SourceError, match=reason):
        parse_vllm(text)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fetch_errors_are_source_errors() -> None:
    with pytest.raises(SourceError, match="refused"):
        fetch_text(f"http://127.0.0.1:{_closed_port()}/metrics", 1.0)
    with pytest.raises(SourceError, match="unsupported URL"):
        fetch_text("https://127.0.0.1:1/metrics", 1.0)
    with FakeVllm("oops", status=500) as vllm, pytest.raises(SourceError, match="HTTP 500"):
        fetch_text(vllm.url, 1.0)


def test_fetch_never_waits_beyond_the_timeout() -> None:
    with FakeVllm(VLLM_TEXT, delay=5.0) as vllm:
        start = time.monotonic()
        with pytest.raises(SourceError, match="within 0.5s"):
            fetch_text(vllm.url, 0.5)
        assert time.monotonic() - start < 1.5
        vllm.delay = 0
        assert "vllm:kv_cache_usage_perc" in fetch_text(vllm.url, 2.0)


# --- LMCache multiprocess files --------------------------------------------------------------

def test_read_real_lmcache_multiproc_files() -> None:
    lmc = parse_lmcache(read_multiproc_dir(str(LMCACHE_SAMPLE / "multiproc")))
    assert lmc.workers == 1
    assert lmc.requested_tokens == 12288
    assert lmc.hit_tokens == 8192
    assert lmc.stored_tokens == 16384
    assert lmc.cpu_used_bytes == 21474836480  # 20 GiB
    assert lmc.disk_used_bytes == 64424509440  # 60 GiB
    assert lmc.cpu_evicted_chunks == 5  # one eviction of 5 keys


def test_env_var_is_not_what_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # empty
    assert parse_lmcache(read_multiproc_dir(str(LMCACHE_SAMPLE / "multiproc"))).hit_tokens == 8192
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(LMCACHE_SAMPLE / "multiproc"))
    with pytest.raises(SourceError, match="no .db files"):
        read_multiproc_dir(str(tmp_path))


def test_multiproc_dir_failures(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="does not exist"):
        read_multiproc_dir(str(tmp_path / "missing"))
    # header says 64 bytes used, first entry claims a 1000-byte key: prometheus_client refuses it
    (tmp_path / "counter_1.db").write_bytes(struct.pack("ii", 64, 0) + struct.pack("i", 1000) + b"x" * 52)
    with pytest.raises(SourceError, match="unreadable multiprocess files"):
        read_multiproc_dir(str(tmp_path))
    (tmp_path / "counter_1.db").write_bytes(b"\xff" * 64)  # garbage that reads as "nothing written"
    with pytest.raises(SourceError, match="no lmcache"):
        parse_lmcache(read_multiproc_dir(str(tmp_path)))


def test_no_lmcache_metrics_among_other_families(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no lmcache"):
        parse_lmcache([])


def test_tp_workers_tokens_max_bytes_sum(tmp_path: Path) -> None:
    for worker, tokens in (("0", 1000), ("1", 1200)):
        write_lmcache_metrics(str(tmp_path), worker_id=worker,
                              counters={"lmcache:num_requested_tokens": tokens,
                                        "lmcache:num_hit_tokens": tokens / 2,
                                        "lmcache:local_cpu_evict_keys_count": 3},
                              gauges={"lmcache:local_cache_usage": 1 * GiB,
                                      "lmcache:local_storage_usage": 2 * GiB})
    lmc = parse_lmcache(read_multiproc_dir(str(tmp_path)))
    assert lmc.workers == 2
    assert (lmc.requested_tokens, lmc.hit_tokens) == (1200, 600)
    assert (lmc.cpu_used_bytes, lmc.disk_used_bytes, lmc.cpu_evicted_chunks) == (2 * GiB, 4 * GiB, 6)


# --- LMCache YAML -> tier capacities ---------------------------------------------------------

@pytest.mark.parametrize("doc, tp, expected", [
    ({}, 1, TierCapacity(cpu_bytes=5 * GiB)),  # LMCache defaults: 5 GiB CPU, no disk
    ({"max_local_cpu_size": 40, "local_disk": "file:///mnt/nvme/x/", "max_local_disk_size": 100},
     2, TierCapacity(cpu_bytes=80 * GiB, disk_bytes=200 * GiB)),
    ({"max_local_cpu_size": 2.5}, 4, TierCapacity(cpu_bytes=10 * GiB)),
    ({"local_cpu": False, "local_disk": "/d", "max_local_disk_size": 1}, 1, TierCapacity(disk_bytes=GiB)),
    ({"max_local_disk_size": 50}, 1, TierCapacity(cpu_bytes=5 * GiB)),  # no local_disk: tier off
    ({"local_disk": "/d"}, 1, TierCapacity(cpu_bytes=5 * GiB)),  # no size: tier off
])
def test_capacity_from_config(doc: dict, tp: int, expected: TierCapacity) -> None:
    assert capacity_from_config(doc, tp) == expected


def test_capacity_errors_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--lmcache-config max_local_cpu_size"):
        capacity_from_config({"max_local_cpu_size": "40Gi"}, 1)
    with pytest.raises(ConfigError, match="--lmcache-config"):
        load_capacity(str(tmp_path / "missing.yaml"), 1)
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(ConfigError, match="not a YAML mapping"):
        load_capacity(str(tmp_path / "list.yaml"), 1)


def test_load_capacity_from_file(tmp_path: Path) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 8.0\n"
                    "local_disk: file:///var/lib/kvoffload/ns/x/x-0/\nmax_local_disk_size: 20.0\n")
    assert load_capacity(str(path), 2) == TierCapacity(cpu_bytes=16 * GiB, disk_bytes=40 * GiB)
    assert load_capacity(None, 2) == TierCapacity()
