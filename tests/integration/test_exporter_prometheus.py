"""A REAL Prometheus (/usr/bin/prometheus, the Debian package) scrapes the exporter every second;
PromQL over its HTTP API returns the tier figures of the real vLLM 0.33.0 / LMCache 0.5.6 samples,
and every expression of the Grafana dashboard evaluates. Everything binds to 127.0.0.1."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.exporter.capacity import GiB
from kvtest.exporter import ExporterProcess, FakeVllm
from kvtest.prometheus import PROMETHEUS, PromAPI, Prometheus

pytestmark = pytest.mark.skipif(not PROMETHEUS.exists(),
                                reason="/usr/bin/prometheus is absent (Debian: apt-get install -y prometheus)")

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
VLLM_TEXT = (FIXTURES / "vllm-0.33.0-metrics-sample" / "exposition.txt").read_text()
MULTIPROC = FIXTURES / "lmcache-0.5.6-metrics-sample" / "multiproc"
DASHBOARD = ROOT / "charts" / "kvoffload-operator" / "dashboards" / "kvoffload-tiers.json"
CACHE_CONFIG_INFO = ('# TYPE vllm:cache_config_info gauge\n'
                     'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n')
KV_BYTES_PER_TOKEN = 131072


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[PromAPI, FakeVllm]]:
    mp = tmp_path / "multiproc"
    shutil.copytree(MULTIPROC, mp)
    disk = tmp_path / "disk"
    disk.mkdir()
    for i in range(3):
        (disk / f"chunk{i}.pt").write_bytes(b"k" * 1000)
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 40\n"
                      f"local_disk: file://{disk}/\nmax_local_disk_size: 100\n")
    versions = tmp_path / "versions.json"
    versions.write_text('{"vllm": "0.26.0", "lmcache": "0.5.3", "torch": "2.11.0+cu130"}')
    with FakeVllm(VLLM_TEXT + CACHE_CONFIG_INFO) as vllm, ExporterProcess([
            "--vllm-metrics-url", vllm.url, "--multiproc-dir", str(mp), "--disk-dir", str(disk),
            "--lmcache-config", str(config), "--tensor-parallel-size", "2",
            "--kv-bytes-per-token", str(KV_BYTES_PER_TOKEN), "--disk-rescan-interval", "1",
            "--engine-versions-file", str(versions)]) as exporter:
        vllm_target = vllm.url.split("//", 1)[1].split("/", 1)[0]
        with Prometheus(tmp_path, [
                {"job_name": "kvoffload", "static_configs": [
                    {"targets": [f"127.0.0.1:{exporter.port}"], "labels": {"namespace": "ns", "pod": "serve-0"}}]},
                {"job_name": "vllm", "static_configs": [
                    {"targets": [vllm_target], "labels": {"namespace": "ns", "pod": "serve-0"}}]},
        ]) as prom:
            api = prom.api
            api.wait_for('kvoffload_tier_used_bytes{tier="cpu"}')
            api.wait_for("vllm:kv_cache_usage_perc")
            yield api, vllm


def test_prometheus_sees_the_tier_figures(stack: tuple[PromAPI, FakeVllm]) -> None:
    api, _ = stack
    assert api.scalar('up{job="kvoffload"}') == 1
    capacity = api.by("kvoffload_tier_capacity_bytes", "tier")
    assert capacity == {"gpu": 1000 * 16 * KV_BYTES_PER_TOKEN, "cpu": 80 * GiB, "disk": 200 * GiB}
    used = api.by("kvoffload_tier_used_bytes", "tier")
    assert used["cpu"] == 21474836480 and used["disk"] == 64424509440
    assert used["gpu"] == pytest.approx(0.42 * capacity["gpu"])
    ratio = api.by("kvoffload_tier_hit_tokens_total / kvoffload_tier_requested_tokens_total", "tier")
    # vLLM's counters (the sample: prefix cache 4,096 of 12,288; connector 8,192 of 8,192), not
    # LMCache's files (8,192 of 12,288 there).
    assert ratio == pytest.approx({"gpu": 4096 / 12288, "external": 8192 / 8192})
    assert api.by("kvoffload_tier_evictions_total", "tier") == {"cpu": 5, "disk": 0}
    assert api.scalar("kvoffload_disk_files") == 3
    assert api.scalar("kvoffload_disk_bytes") == 3000
    assert api.scalar("kvoffload_disk_orphaned_bytes") == 0
    assert api.scalar("kvoffload_disk_free_bytes") > 0
    assert api.scalar("kvoffload_offload_active") == 1
    assert api.by("kvoffload_source_up", "source") == {"vllm": 1, "lmcache": 1, "disk": 1, "engine": 1}
    assert api.by("kvoffload_scrape_errors_total", "source") == {"vllm": 0, "lmcache": 0, "disk": 0, "engine": 0}
    assert api.by("kvoffload_engine_info", "vllm") == {"0.26.0": 1}
    assert api.scalar('max by (pod) (vllm:kv_cache_usage_perc{namespace=~".*", pod=~".*"})') == 0.42


def test_dashboard_queries_evaluate_and_hit_ratio_follows_traffic(stack: tuple[PromAPI, FakeVllm]) -> None:
    api, vllm = stack
    # More traffic: 12,288 more tokens queried, 8,192 more found in the GPU prefix cache.
    vllm.body = (VLLM_TEXT + CACHE_CONFIG_INFO).replace(
        'vllm:prefix_cache_queries_total{engine="0",model_name="llama-8b"} 12288.0',
        'vllm:prefix_cache_queries_total{engine="0",model_name="llama-8b"} 24576.0').replace(
        'vllm:prefix_cache_hits_total{engine="0",model_name="llama-8b"} 4096.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="llama-8b"} 12288.0')
    # A few scrapes at the new value (a subquery at the 1 s scrape interval counts them), not a fixed sleep.
    api.wait_for('count_over_time((kvoffload_tier_requested_tokens_total{tier="gpu"} == 24576)[1m:1s]) >= 3')

    dashboard = json.loads(DASHBOARD.read_text())
    values = {"$__rate_interval": "1m", "$namespace": "ns", "$pod": "serve-0"}
    results: dict[str, list[dict[str, Any]]] = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, val in values.items():
                expr = expr.replace(var, val)
            results[f"{panel['title']}/{target['refId']}"] = api.query(expr)  # asserts success
    # This stack's exporter runs backend lmcache: the other backends' panels evaluate and show nothing.
    other_backends = ("Backend lmcache-server:", "Backend vllm-native:")
    for key, result in results.items():
        if key.startswith(other_backends):
            assert result == [], f"dashboard query {key} shows series from an lmcache pod"
        else:
            assert result, f"dashboard query {key} returned no series"

    hit_ratio = {r["metric"]["tier"]: float(r["value"][1]) for r in results["Hit ratio by tier (vLLM's counters)/A"]}
    assert hit_ratio["gpu"] == pytest.approx(8192 / 12288)
    fill = {r["metric"]["tier"]: float(r["value"][1]) for r in results["Tier fill/A"]}
    assert fill == pytest.approx({"gpu": 0.42, "cpu": 20 / 80, "disk": 60 / 200})
    assert float(results["Offload active/A"][0]["value"][1]) == 1
    (info,) = results["Engine versions per pod/A"]
    assert info["metric"] == {"pod": "serve-0", "vllm": "0.26.0", "lmcache": "0.5.3", "torch": "2.11.0+cu130"}
