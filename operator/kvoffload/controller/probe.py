"""Proof that offloading really works: ask each ready pod's exporter for kvoffload_offload_active.

The I/O half of the OffloadActive condition; conditions.py turns the answers into the verdict.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from ..api.fetch import SourceError, fetch_text

# pod name -> 1.0 / 0.0 from the exporter, or an error string.
Probes = dict[str, "float | str"]


def _ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions", []) or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds) and bool(pod.get("status", {}).get("podIP"))


def _read(url: str, timeout: float) -> float | str:
    try:
        text = fetch_text(url, timeout)
        for family in text_string_to_metric_families(text):
            if family.name == "kvoffload_offload_active":
                return float(family.samples[0].value)
        return "kvoffload_offload_active missing from the exporter's /metrics"
    except (SourceError, OSError, ValueError) as exc:
        return f"{url}: {exc}"


def probe_offload(pods: list[dict[str, Any]], port: int, timeout: float = 1.0) -> Probes:
    targets = {p["metadata"]["name"]: f"http://{p['status']['podIP']}:{port}/metrics" for p in pods if _ready(p)}
    if not targets:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(targets))) as pool:
        results = pool.map(lambda url: _read(url, timeout), targets.values())
        return dict(zip(targets, results))
