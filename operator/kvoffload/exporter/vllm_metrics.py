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
    "vllm:kv_offload_store_bytes",  # vLLM's native offloading (OffloadingConnector)
    "vllm:kv_offload_load_bytes",
    "process_start_time_seconds",
    "lmcache:",
)


@dataclass(frozen=True)
class VllmSnapshot:
    """The figures the exporter takes from one vLLM /metrics page (counters summed over engines).
    None: the page does not hold that figure (yet)."""

    kv_usage: dict[str, float]  # engine -> fraction of GPU KV blocks in use (0..1); {} just after start
    gpu_tokens: dict[str, int]  # engine -> num_gpu_blocks x block_size (from vllm:cache_config_info)
    prefix_queries: float | None = None  # vllm:prefix_cache_queries (GPU prefix cache)
    prefix_hits: float | None = None
    external_queries: float | None = None  # vllm:external_prefix_cache_queries (asked of the KV connector)
    external_hits: float | None = None
    prompt_tokens: dict[str, float] = field(default_factory=dict)  # vllm:prompt_tokens_by_source, by source
    process_start: float | None = None
    offload_store_bytes: float | None = None  # vllm:kv_offload_store_bytes (GPU -> native CPU tier)
    offload_load_bytes: float | None = None  # vllm:kv_offload_load_bytes (native CPU tier -> GPU)
    lmcache_families: list[Metric] = field(default_factory=list)


def parse_vllm(text: str) -> VllmSnapshot:
    """Figures from a vLLM /metrics page. Raises SourceError if the page is garbled or holds no
    `vllm:` figure at all (not vLLM's page). vLLM answers /health, and serves this page, before it
    publishes vllm:kv_cache_usage_perc: without it the page is "not yet", not an error (kv_usage {})."""
    lines = [ln for ln in text.splitlines()
             if (ln[7:] if ln.startswith(("# HELP ", "# TYPE ")) else ln).startswith(_WANTED)]
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on garbage
        raise SourceError(f"unparsable vLLM metrics: {type(exc).__name__}") from None

    sums: dict[str, float] = defaultdict(float)
    by_source: dict[str, float] = defaultdict(float)
    kv_usage: dict[str, float] = {}
    gpu_tokens: dict[str, int] = {}
    process_start = None
    seen_vllm = False
    for fam in families:
        for s in fam.samples:
            engine = s.labels.get("engine", "0")
            seen_vllm = seen_vllm or s.name.startswith("vllm:")
            if s.name == "vllm:kv_cache_usage_perc":
                kv_usage[engine] = s.value
            elif s.name == "vllm:cache_config_info":
                blocks, block_size = s.labels.get("num_gpu_blocks", ""), s.labels.get("block_size", "")
                if blocks.isdigit() and block_size.isdigit():
                    gpu_tokens[engine] = int(blocks) * int(block_size)
            elif s.name == "vllm:prompt_tokens_by_source_total":
                by_source[s.labels.get("source", "")] += s.value
            elif s.name == "process_start_time_seconds":
                process_start = s.value
            elif s.name.startswith("vllm:") and s.name.endswith("_total"):
                sums[s.name] += s.value
    if not seen_vllm:
        raise SourceError("no vllm:* figures in the response (not vLLM's /metrics page?)")
    return VllmSnapshot(
        kv_usage=kv_usage,
        gpu_tokens=gpu_tokens,
        prefix_queries=sums.get("vllm:prefix_cache_queries_total"),
        prefix_hits=sums.get("vllm:prefix_cache_hits_total"),
        external_queries=sums.get("vllm:external_prefix_cache_queries_total"),
        external_hits=sums.get("vllm:external_prefix_cache_hits_total"),
        prompt_tokens=dict(by_source),
        process_start=process_start,
        offload_store_bytes=sums.get("vllm:kv_offload_store_bytes_total"),
        offload_load_bytes=sums.get("vllm:kv_offload_load_bytes_total"),
        lmcache_families=[f for f in families if f.name.startswith("lmcache:")],
    )
