"""Read the LMCache server's /status (backend lmcache-server).

LMCache 0.5.3's `lmcache server` serves no /metrics: its OpenTelemetry meters reach Prometheus only
through an OTLP collector (--otlp-endpoint) or the standalone `python -m lmcache.v1.multiprocess.server`
(no HTTP API). Its HTTP frontend's GET /status is always there and says what the exporter needs: L1
bytes used and total, and which engines registered their KV caches (proof that vLLM is connected)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..api.fetch import SourceError, fetch_text


@dataclass(frozen=True)
class ServerSnapshot:
    healthy: bool
    l1_used_bytes: int
    l1_total_bytes: int
    engines: int  # KV-cache registrations: GPU workers (CUDA IPC) + non-CUDA/engine-driven instances
    sessions: int


def parse_status(doc: Any) -> ServerSnapshot:
    """Figures from one /status document; SourceError when it is not LMCache's."""
    try:
        l1 = doc["storage_manager"]["l1_manager"]
        engines = len(doc.get("registered_gpu_ids") or []) + len(doc.get("registered_non_cuda_instance_ids") or [])
        return ServerSnapshot(healthy=bool(doc["is_healthy"]), l1_used_bytes=int(l1["memory_used_bytes"]),
                              l1_total_bytes=int(l1["memory_total_bytes"]), engines=engines,
                              sessions=int(doc.get("active_sessions") or 0))
    except (KeyError, TypeError, ValueError):
        raise SourceError("not an LMCache server /status document") from None


def fetch_status(url: str, timeout: float) -> ServerSnapshot:
    try:
        doc = json.loads(fetch_text(url, timeout))
    except ValueError:
        raise SourceError(f"unparsable JSON from {url}") from None
    return parse_status(doc)
