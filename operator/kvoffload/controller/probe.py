"""Proof from the pods: ask each running pod's exporter for kvoffload_offload_active,
kvoffload_external_hits_unloaded_tokens and kvoffload_engine_info (the versions the serving image
really holds).

The I/O half of the OffloadActive and EngineVerified conditions; conditions.py turns the answers
into the verdicts.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ..api.fetch import SourceError, fetch_text


@dataclass(frozen=True)
class Reading:
    """What one pod's exporter answered."""
    active: float  # kvoffload_offload_active
    engine: dict[str, str] | None = None  # kvoffload_engine_info's labels (vllm, lmcache, torch); None: not served
    unloaded: float = 0.0  # kvoffload_external_hits_unloaded_tokens (0 when absent: not judged)


# pod name -> the exporter's answer, or an error string.
Probes = dict[str, "Reading | str"]


def _running(pod: dict[str, Any]) -> bool:
    # Running, not only Ready: a pod whose vLLM cannot start (e.g. a wrong engine pair) still has an
    # exporter that tells which versions the image holds.
    st = pod.get("status", {}) or {}
    return st.get("phase") == "Running" and bool(st.get("podIP")) and not pod["metadata"].get("deletionTimestamp")


def parse_page(text: str) -> Reading | str:
    """The families the operator reads from an exporter's /metrics page."""
    active, engine, unloaded = None, None, 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "kvoffload_offload_active" and family.samples:
            active = float(family.samples[0].value)
        elif family.name == "kvoffload_engine_info" and family.samples:
            engine = dict(family.samples[0].labels)
        elif family.name == "kvoffload_external_hits_unloaded_tokens" and family.samples:
            unloaded = float(family.samples[0].value)
    if active is None:
        return "kvoffload_offload_active missing from the exporter's /metrics"
    return Reading(active, engine, unloaded)


def _read(url: str, timeout: float) -> Reading | str:
    try:
        return parse_page(fetch_text(url, timeout))
    except (SourceError, OSError, ValueError) as exc:
        return f"{url}: {exc}"


def probe_exporters(pods: list[dict[str, Any]], port: int, timeout: float = 1.0) -> Probes:
    targets = {p["metadata"]["name"]: f"http://{p['status']['podIP']}:{port}/metrics" for p in pods if _running(p)}
    if not targets:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(targets))) as pool:
        results = pool.map(lambda url: _read(url, timeout), targets.values())
        return dict(zip(targets, results))
