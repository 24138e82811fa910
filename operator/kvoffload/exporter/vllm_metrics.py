"""Read vLLM's /metrics: one GET bounded by a deadline, then only the families the exporter uses."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ..api.fetch import SourceError

# vLLM's page is mostly histograms the exporter never reads; parsing only these lines keeps a scrape
# cheap. `lmcache:` lines appear when vLLM shares PROMETHEUS_MULTIPROC_DIR with LMCache.
_WANTED = (
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_",
    "vllm:external_prefix_cache_",
    "vllm:prompt_tokens_by_source",
    "vllm:cache_config_info",
    "process_start_time_seconds",
    "lmcache:",
)


@dataclass(frozen=True)
class VllmSnapshot:
    """The figures the exporter takes from one vLLM /metrics page (counters summed over engines)."""

    kv_usage: dict[str, float]  # engine -> fraction of GPU KV blocks in use (0..1)
    gpu_tokens: dict[str, int]  # engine -> num_gpu_blocks x block_size (from vllm:cache_config_info)
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    external_queries: float | None = None
    external_hits: float | None = None
    external_prompt_tokens: float | None = None  # prompt_tokens_by_source{source="external_kv_transfer"}
    process_start: float | None = None
    lmcache_families: list[Metric] = field(default_factory=list)


def parse_vllm(text: str) -> VllmSnapshot:
    """Figures from a vLLM /metrics page. Raises SourceError if the page is garbled or is not
    vLLM's (vllm:kv_cache_usage_perc is always present in vLLM 0.33)."""
    lines = [ln for ln in text.splitlines()
             if (ln[7:] if ln.startswith(("# HELP ", "# TYPE ")) else ln).startswith(_WANTED)]
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on garbage
        raise SourceError(f"unparsable vLLM metrics: {type(exc).__name__}") from None

    sums: dict[str, float] = defaultdict(float)
    kv_usage: dict[str, float] = {}
    gpu_tokens: dict[str, int] = {}
    process_start = None
    for fam in families:
        for s in fam.samples:
            engine = s.labels.get("engine", "0")
            if s.name == "vllm:kv_cache_usage_perc":
                kv_usage[engine] = s.value
            elif s.name == "vllm:cache_config_info":
                blocks, block_size = s.labels.get("num_gpu_blocks", ""), s.labels.get("block_size", "")
                if blocks.isdigit() and block_size.isdigit():
                    gpu_tokens[engine] = int(blocks) * int(block_size)
            elif s.name == "vllm:prompt_tokens_by_source_total":
                sums[f"{s.name}/{s.labels.get('source')}"] += s.value
            elif s.name == "process_start_time_seconds":
                process_start = s.value
            elif s.name.startswith("vllm:") and s.name.endswith("_total"):
                sums[s.name] += s.value
    if not kv_usage:
        raise SourceError("no vllm:kv_cache_usage_perc in the response (not a vLLM 0.33 /metrics page?)")
    return VllmSnapshot(
        kv_usage=kv_usage,
        gpu_tokens=gpu_tokens,
        prefix_queries=sums.get("vllm:prefix_cache_queries_total"),
        prefix_hits=sums.get("vllm:prefix_cache_hits_total"),
        external_queries=sums.get("vllm:external_prefix_cache_queries_total"),
        external_hits=sums.get("vllm:external_prefix_cache_hits_total"),
        external_prompt_tokens=sums.get("vllm:prompt_tokens_by_source_total/external_kv_transfer"),
        process_start=process_start,
        lmcache_families=[f for f in families if f.name.startswith("lmcache:")],
    )
