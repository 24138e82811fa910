"""Every vLLM and LMCache metric the exporter reads is one that each offered pair defines: the names are
taken from the exporter's own code and looked up, as string literals, in that pair's installed vLLM
(vllm/v1/metrics, the offloading connector's metrics) and LMCache (lmcache/observability.py) sources.
The replayed pages (tests/fixtures: vLLM 0.26.0 on an H200, vLLM 0.33.0's own logger) test the parsing."""

from __future__ import annotations

import re
from pathlib import Path

import engine_venv
import pytest

from kvoffload import exporter

EXPORTER = sorted(Path(exporter.__file__).parent.glob("*.py"))


def read_names(prefix: str) -> set[str]:
    """Full metric names (a family, without prometheus_client's _total) the exporter's code names."""
    found = set()
    for path in EXPORTER:
        for name in re.findall(rf'"({prefix}:[a-z_]+)', path.read_text()):
            if not name.endswith("_"):  # a prefix the exporter filters lines by, not a name
                found.add(name.removesuffix("_total"))
    return found


def defined(root, names: set[str], dist: str) -> set[str]:
    sources = "\n".join(p.read_text() for p in (engine_venv.site_packages(root) / dist).rglob("*.py"))
    return {n for n in names if f'"{n}"' in sources or f'"{n.split(":", 1)[1]}"' in sources}


@pytest.mark.parametrize("pair", engine_venv.PAIRS, ids=lambda p: f"vllm-{p.vllm}-lmcache-{p.lmcache}")
def test_the_exporters_metric_names_exist_in_each_offered_pair(pair):
    venv = engine_venv.require(pair.vllm, pair.lmcache)
    vllm_names, lmcache_names = read_names("vllm"), read_names("lmcache")
    assert {"vllm:kv_cache_usage_perc", "vllm:external_prefix_cache_hits", "vllm:prompt_tokens_by_source"} <= vllm_names
    assert "lmcache:num_retrieve_requests" in lmcache_names
    assert defined(venv, vllm_names, "vllm") == vllm_names, vllm_names - defined(venv, vllm_names, "vllm")
    assert defined(venv, lmcache_names, "lmcache") == lmcache_names, (
        lmcache_names - defined(venv, lmcache_names, "lmcache"))
    # The check has teeth: vLLM 0.33 dropped the old GPU cache gauge.
    if pair.vllm == "0.33.0":
        assert not defined(venv, {"vllm:gpu_cache_usage_perc"}, "vllm")
