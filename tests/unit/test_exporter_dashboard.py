"""The Grafana dashboard loads, is templated on its data source, and every PromQL expression names
only metrics that really exist: the exporter's (as it serves them), vLLM's (on the real vLLM 0.26.0
page and in the 0.33.0 sample) or LMCache 0.5.6's (per lmcache-0.5.6-metrics.txt, copied beside the
LMCache sample). Its hit panels read the exporter's figures, which come from vLLM's counters."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.exporter import cli as exporter_cli
from kvtest.exporter import FakeVllm

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "kvoffload-operator" / "dashboards" / "kvoffload-tiers.json"
FIXTURES = ROOT / "tests" / "fixtures"
VLLM_TEXT = (FIXTURES / "vllm-0.33.0-metrics-sample" / "exposition.txt").read_text()
VLLM_026_TEXT = (FIXTURES / "vllm-0.26.0-lmcache-0.5.3-h200" / "vllm-metrics-with-lmcache.txt").read_text()
LMCACHE_NAMES = FIXTURES / "lmcache-0.5.6-metrics-sample" / "lmcache-0.5.6-metrics.txt"
CACHE_CONFIG_INFO = ('# TYPE vllm:cache_config_info gauge\n'
                     'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n')

PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                   "or", "unless", "offset", "inf", "nan"}
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def metric_names(expr: str) -> list[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, labels
    or Grafana variables."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\w+", "", expr)
    names = []
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[m.end():].lstrip().startswith("(") or m.group().lower() in PROMQL_KEYWORDS:
            continue
        names.append(m.group())
    return names


def test_metric_names_extraction() -> None:
    expr = ('sum by (tier) (rate(kvoffload_tier_hit_tokens_total{pod=~"$pod", tier!="x"}[$__rate_interval]))'
            ' / on (tier) group_left max(vllm:kv_cache_usage_perc) > bool 0.5')
    assert metric_names(expr) == ["kvoffload_tier_hit_tokens_total", "vllm:kv_cache_usage_perc"]


def sample_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="module")
def exporter_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Everything the exporter serves when every source is up (gpu capacity and disk included)."""
    tmp = tmp_path_factory.mktemp("dash")
    (tmp / "disk").mkdir()
    (tmp / "lmcache.yaml").write_text("max_local_cpu_size: 4\nlocal_disk: /d\nmax_local_disk_size: 8\n")
    (tmp / "versions.json").write_text('{"vllm": "0.26.0", "lmcache": "0.5.3", "torch": "2.11.0+cu130"}')
    with FakeVllm(VLLM_TEXT + CACHE_CONFIG_INFO) as vllm:
        parser = argparse.ArgumentParser()
        exporter_cli.add_arguments(parser)
        registry, collector, _ = exporter_cli.build(parser.parse_args([
            "--vllm-metrics-url", vllm.url, "--disk-dir", str(tmp / "disk"),
            "--multiproc-dir", str(FIXTURES / "lmcache-0.5.6-metrics-sample" / "multiproc"),
            "--lmcache-config", str(tmp / "lmcache.yaml"), "--kv-bytes-per-token", "131072",
            "--engine-versions-file", str(tmp / "versions.json")]))
        assert collector.disk is not None
        collector.disk.rescan_now()
        names = sample_names(generate_latest(registry).decode())
    assert "kvoffload_disk_free_bytes" in names and "kvoffload_tier_capacity_bytes" in names
    # The other backends' own families (spec.offload.backend lmcache-server and vllm-native).
    status = (FIXTURES / "lmcache-0.5.3-server-status" / "status-idle.json").read_text()
    native = ("# TYPE vllm:kv_offload_store_bytes_total counter\nvllm:kv_offload_store_bytes_total 1.0\n"
              "# TYPE vllm:kv_offload_load_bytes_total counter\nvllm:kv_offload_load_bytes_total 1.0\n")
    with FakeVllm(VLLM_TEXT + native) as vllm, FakeVllm(status) as server:
        for extra in (["--backend", "lmcache-server", "--lmcache-server-url", server.url],
                      ["--backend", "vllm-native"]):
            parser = argparse.ArgumentParser()
            exporter_cli.add_arguments(parser)
            registry, _, _ = exporter_cli.build(parser.parse_args(["--vllm-metrics-url", vllm.url, *extra]))
            names |= sample_names(generate_latest(registry).decode())
    assert {"kvoffload_lmcache_server_engines", "kvoffload_offload_transfer_bytes_total"} <= names
    return names


def lmcache_names() -> set[str]:
    return {ln.strip() for ln in LMCACHE_NAMES.read_text().splitlines() if ln.strip() and "{" not in ln}


def is_lmcache_name(name: str) -> bool:
    known = lmcache_names()
    return name in known or any(name.endswith(s) and name[: -len(s)] in known for s in SUFFIXES)


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # collapsed rows


def test_dashboard_is_json_with_uid_title_and_datasource_variable() -> None:
    dash = load()
    assert dash["uid"] == "kvoffload-tiers" and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}", p["title"]


def test_dashboard_has_the_panels_the_issue_asks_for() -> None:
    exprs = " ".join(t["expr"] for p in panels(load()) for t in p.get("targets", []))
    for name in ("kvoffload_tier_capacity_bytes", "kvoffload_tier_used_bytes",
                 "kvoffload_tier_hit_tokens_total", "kvoffload_tier_requested_tokens_total",
                 "kvoffload_tier_evictions_total", "kvoffload_disk_free_bytes",
                 "kvoffload_offload_active", "kvoffload_prompt_tokens_total", "kvoffload_engine_info",
                 "vllm:kv_cache_usage_perc", "kvoffload_lmcache_server_engines",
                 "kvoffload_offload_transfer_bytes_total"):
        assert name in exprs, name


def test_hit_panels_follow_from_vllms_counters_through_the_exporter() -> None:
    """A hit or rate panel reads kvoffload_tier_hit/requested or kvoffload_prompt_tokens (their
    HELP names the vLLM counter behind each), never LMCache's hit counters, which count only what
    LMCache loaded (0 under vLLM 0.26.0's V2 model runner while vLLM skipped the prefill)."""
    for p in panels(load()):
        exprs = " ".join(t["expr"] for t in p.get("targets", []))
        assert "lmcache:num_hit_tokens" not in exprs and "lmcache:num_requested_tokens" not in exprs
        if "hit" in p["title"].lower() or "prompt tokens" in p["title"].lower():
            assert "kvoffload_tier_hit_tokens_total" in exprs or "kvoffload_prompt_tokens_total" in exprs, p["title"]


def test_every_promql_names_only_real_metrics(exporter_names: set[str]) -> None:
    vllm_names = sample_names(VLLM_TEXT) & sample_names(VLLM_026_TEXT)
    assert "vllm:gpu_cache_usage_perc" not in vllm_names  # gone in 0.33: the check has teeth
    assert not is_lmcache_name("lmcache:local_disk_usage")
    dash = load()
    exprs = [t["expr"] for p in panels(dash) for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    assert exprs
    for expr in exprs:
        # Grafana's label_values(<series selector>, <label>): only the selector is PromQL
        names = metric_names(re.sub(r"label_values\((.*),\s*\w+\s*\)", r"\1", expr))
        assert names, f"no metric in {expr!r}"
        for name in names:
            if name.startswith("kvoffload_"):
                assert name in exporter_names, f"{name} is not served by the exporter"
            elif name.startswith("vllm:"):
                assert name in vllm_names, f"{name} is not in both vLLM 0.26.0's and 0.33.0's /metrics"
            elif name.startswith("lmcache:"):
                assert is_lmcache_name(name), f"{name} is not an LMCache 0.5.6 metric"
            else:
                pytest.fail(f"{name} in {expr!r} comes from no known exporter")
