"""Every kvoffload_* figure of the exporter against the engine's own counters. Pure.

Engine truth, read independently of the exporter's code:
- vLLM's /metrics page (prefix-cache and external prefix-cache counters, KV usage, cache_config_info);
- LMCache's multiprocess files (the lmcache:* families, as exposition text);
- the disk-tier directory (bytes and regular files, statvfs free bytes), scanned by the benchmark;
- the LMCache config the engine was started with (capacities) and the model's KV bytes per token;
- backend lmcache-server: the LMCache server's own /status document (L1 bytes, registered engines);
- backend vllm-native: vLLM's own offload counters (vllm:kv_offload_{store,load}_bytes_total).

Counters move while we look, so the engine is read before and after the exporter: a figure agrees
when it lies between the two engine reads (plus a small tolerance).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from kvoffload import backends
from kvoffload.backends.base import LMCACHE_METRICS, SERVER_STATUS, VLLM_OFFLOAD

GiB = 2**30
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_text(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> (name, labels, value) samples (comments skipped)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(3) or "")), value))
    return out


class Page:
    """Samples of one page, with sums by name and label filter."""

    def __init__(self, text: str) -> None:
        self.samples = parse_text(text)

    def sum(self, name: str, **labels: str) -> float | None:
        vals = [v for n, lab, v in self.samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
        return sum(vals) if vals else None

    def get(self, name: str, **labels: str) -> float | None:
        return self.sum(name, **labels)

    def labels_of(self, name: str) -> list[dict[str, str]]:
        return [lab for n, lab, _ in self.samples if n == name]


@dataclass(frozen=True)
class EngineRead:
    """One look at the engine: vLLM's page, LMCache's families, the disk directory."""
    vllm: str
    lmcache: str  # exposition text of LMCache's multiprocess files ('' if none)
    disk_bytes: int | None = None
    disk_files: int | None = None
    disk_free: int | None = None
    server: dict[str, Any] | None = None  # the LMCache server's /status (backend lmcache-server)


@dataclass(frozen=True)
class Check:
    metric: str
    labels: str
    exporter: float | None
    engine_lo: float | None
    engine_hi: float | None
    source: str
    ok: bool | None  # None: no engine figure to compare with (reported only)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gpu_tokens(p: Page) -> float | None:
    total = None
    for lab in p.labels_of("vllm:cache_config_info"):
        if lab.get("num_gpu_blocks", "").isdigit() and lab.get("block_size", "").isdigit():
            total = (total or 0) + int(lab["num_gpu_blocks"]) * int(lab["block_size"])
    return total


def _server_figures(doc: dict[str, Any] | None) -> tuple[float | None, float | None, float | None]:
    """L1 total and used bytes and registered engines from a server /status document (None: absent)."""
    try:
        l1 = doc["storage_manager"]["l1_manager"]  # type: ignore[index]
        engines = (len(doc.get("registered_gpu_ids") or [])  # type: ignore[union-attr]
                   + len(doc.get("registered_non_cuda_instance_ids") or []))  # type: ignore[union-attr]
        return float(l1["memory_total_bytes"]), float(l1["memory_used_bytes"]), float(engines)
    except (KeyError, TypeError, ValueError):
        return None, None, None


def engine_figures(read: EngineRead, *, kv_bytes_per_token: int, lmcache_config: dict[str, Any] | None,
                   tp: int, connector: bool, served: bool,
                   backend: str = backends.DEFAULT) -> dict[tuple[str, str], tuple[float | None, str]]:
    """(metric, labels) -> (engine value, where it comes from), for one engine read. A label of the
    form "k=v" is taken as is; any other is the tier label's value. Which figures: the sources the
    backend declares (Backend.sources), the ones its exporter reads."""
    v, lm = Page(read.vllm), Page(read.lmcache)
    sources = backends.get(backend, "--backend").sources
    out: dict[tuple[str, str], tuple[float | None, str]] = {}
    tokens = _gpu_tokens(v)
    cap_gpu = None if tokens is None else tokens * kv_bytes_per_token
    out[("kvoffload_tier_capacity_bytes", "gpu")] = (cap_gpu, "vllm:cache_config_info num_gpu_blocks "
                                                              "x block_size x KV B/token")
    usage = v.sum("vllm:kv_cache_usage_perc")
    out[("kvoffload_tier_used_bytes", "gpu")] = (None if cap_gpu is None or usage is None else usage * cap_gpu,
                                                "vllm:kv_cache_usage_perc x gpu capacity")
    out[("kvoffload_tier_hit_tokens_total", "gpu")] = (v.sum("vllm:prefix_cache_hits_total"),
                                                       "vllm:prefix_cache_hits_total")
    out[("kvoffload_tier_requested_tokens_total", "gpu")] = (v.sum("vllm:prefix_cache_queries_total"),
                                                             "vllm:prefix_cache_queries_total")
    if connector:
        out[("kvoffload_tier_hit_tokens_total", "external")] = (v.sum("vllm:external_prefix_cache_hits_total"),
                                                                "vllm:external_prefix_cache_hits_total")
        out[("kvoffload_tier_requested_tokens_total", "external")] = (
            v.sum("vllm:external_prefix_cache_queries_total"), "vllm:external_prefix_cache_queries_total")
    if connector and SERVER_STATUS in sources:
        total, used, engines = _server_figures(read.server)
        out[("kvoffload_tier_capacity_bytes", "cpu")] = (total, "server /status l1_manager.memory_total_bytes")
        out[("kvoffload_tier_used_bytes", "cpu")] = (used, "server /status l1_manager.memory_used_bytes")
        out[("kvoffload_lmcache_server_engines", "")] = (engines, "server /status registered_gpu_ids + non_cuda ids")
    if connector and VLLM_OFFLOAD in sources:
        out[("kvoffload_offload_transfer_bytes_total", "direction=store")] = (
            v.sum("vllm:kv_offload_store_bytes_total"), "vllm:kv_offload_store_bytes_total")
        out[("kvoffload_offload_transfer_bytes_total", "direction=load")] = (
            v.sum("vllm:kv_offload_load_bytes_total"), "vllm:kv_offload_load_bytes_total")
    if connector and LMCACHE_METRICS in sources:
        cfg = lmcache_config or {}
        if cfg.get("local_cpu", True):
            out[("kvoffload_tier_capacity_bytes", "cpu")] = (float(cfg.get("max_local_cpu_size", 5.0)) * GiB * tp,
                                                             "LMCache max_local_cpu_size x TP")
        if cfg.get("local_disk"):
            out[("kvoffload_tier_capacity_bytes", "disk")] = (float(cfg.get("max_local_disk_size", 0.0)) * GiB * tp,
                                                              "LMCache max_local_disk_size x TP")
        out[("kvoffload_tier_used_bytes", "cpu")] = (lm.sum("lmcache:local_cache_usage"),
                                                     "sum lmcache:local_cache_usage")
        out[("kvoffload_tier_used_bytes", "disk")] = (lm.sum("lmcache:local_storage_usage"),
                                                      "sum lmcache:local_storage_usage")
        out[("kvoffload_tier_evictions_total", "cpu")] = (lm.sum("lmcache:local_cpu_evict_keys_count_total"),
                                                          "sum lmcache:local_cpu_evict_keys_count_total")
    if read.disk_bytes is not None:
        out[("kvoffload_disk_bytes", "")] = (float(read.disk_bytes), "bytes of regular files in the disk dir")
        out[("kvoffload_disk_files", "")] = (float(read.disk_files or 0), "regular files in the disk dir")
        out[("kvoffload_disk_free_bytes", "")] = (None if read.disk_free is None else float(read.disk_free),
                                                  "statvfs f_bavail x f_frsize")
        stored = lm.sum("lmcache:local_storage_usage")
        # Without LMCache's metrics the exporter counts files older than vLLM: not an engine figure.
        if LMCACHE_METRICS in sources:
            out[("kvoffload_disk_orphaned_bytes", "")] = (
                None if stored is None else float(max(0, read.disk_bytes - stored)),
                "disk dir bytes - sum lmcache:local_storage_usage (floor 0)")
    out[("kvoffload_offload_active", "")] = (float(connector and served),
                                             "1 iff the connector is on and served traffic")
    return out


# Absolute tolerance per metric (bytes free move with other writers; floats round).
TOLERANCE = {"kvoffload_disk_free_bytes": 256 * 2**20}


def _labels(tier: str) -> dict[str, str]:
    if not tier:
        return {}
    k, _, v = tier.partition("=")
    return {k: v} if v else {"tier": tier}


def _exporter_value(page: Page, metric: str, tier: str) -> float | None:
    return page.get(metric, **_labels(tier))


def compare(exporter_text: str, before: EngineRead, after: EngineRead, *, kv_bytes_per_token: int,
            lmcache_config: dict[str, Any] | None, tp: int, connector: bool, served: bool,
            backend: str = backends.DEFAULT) -> list[Check]:
    """One Check per kvoffload_* figure: the exporter's value vs the engine's two reads around it."""
    page = Page(exporter_text)
    kw = dict(kv_bytes_per_token=kv_bytes_per_token, lmcache_config=lmcache_config, tp=tp, connector=connector,
              served=served, backend=backend)
    a, b = engine_figures(before, **kw), engine_figures(after, **kw)
    checks: list[Check] = []
    for (metric, tier), (va, source) in a.items():
        vb = b.get((metric, tier), (None, source))[0]
        got = _exporter_value(page, metric, tier)
        vals = [x for x in (va, vb) if x is not None]
        lo, hi = (min(vals), max(vals)) if vals else (None, None)
        if lo is None:
            ok = None
        elif got is None:
            ok = False
        else:
            tol = TOLERANCE.get(metric, 0.0) + 1e-6 * max(abs(hi), 1.0) + 0.5
            ok = lo - tol <= got <= hi + tol
        label = ",".join(f"{k}={x}" for k, x in _labels(tier).items())
        checks.append(Check(metric, label, got, lo, hi, source, ok))
    # Whatever else the exporter publishes under kvoffload_*: reported, with the rule it must meet.
    seen = {(c.metric, c.labels) for c in checks}
    by_key: dict[tuple[str, str], float] = defaultdict(float)
    for name, lab, value in page.samples:
        if not name.startswith("kvoffload_"):
            continue
        key = (name, ",".join(f"{k}={lab[k]}" for k in sorted(lab)))
        if key not in seen:
            by_key[key] += value
    for (name, labels), value in sorted(by_key.items()):
        if name == "kvoffload_source_up":
            # LMCache's source label (its metrics or its server's /status): down without an LMCache connector.
            want = 0.0 if labels == f"source={LMCACHE_METRICS.label}" and not connector else 1.0
            checks.append(Check(name, labels, value, want, want,
                                "source read without error" if want else "no LMCache without the connector",
                                value == want))
        elif name == "kvoffload_scrape_errors_total":
            checks.append(Check(name, labels, value, None, None, "failed reads so far (reported)", None))
        else:
            checks.append(Check(name, labels, value, None, None, "no engine counter to compare with", None))
    return checks


def disagreements(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.ok is False]


def table(checks: list[Check]) -> str:
    """Markdown table of the checks."""
    def f(x: float | None) -> str:
        if x is None:
            return "-"
        return f"{x:,.0f}" if abs(x) >= 1000 or x == int(x) else f"{x:.4g}"
    rows = ["| figure | exporter | engine (before..after) | engine source | agrees |", "|---|---|---|---|---|"]
    for c in checks:
        eng = "-" if c.engine_lo is None else (f(c.engine_lo) if c.engine_lo == c.engine_hi
                                               else f"{f(c.engine_lo)}..{f(c.engine_hi)}")
        verdict = {True: "yes", False: "**NO**", None: "n/a"}[c.ok]
        rows.append(f"| `{c.metric}{{{c.labels}}}` | {f(c.exporter)} | {eng} | {c.source} | {verdict} |")
    return "\n".join(rows)
