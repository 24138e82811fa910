"""Read the LMCache server's /status (backend lmcache-server).

LMCache 0.5.3's `lmcache server` serves no /metrics: its OpenTelemetry meters reach Prometheus only
through an OTLP collector (--otlp-endpoint) or the standalone `python -m lmcache.v1.multiprocess.server`
(no HTTP API). Its HTTP frontend's GET /status is always there and says what the exporter needs: L1
bytes used and total, which engines registered their KV caches (proof that vLLM is connected), and, for an L2 adapter
with an `eviction` block (the operator renders one), its bytes used and capacity.

/status counts no hits (LMCache 0.5.3 and 0.5.6: its lookup module reports only `active_prefetch_jobs`; the
`lmcache_mp.*` lookup counters leave the server only through OTLP). A replica's hits are vLLM's own counters.
Registrations carry no name a pod could recognise: each vLLM worker registers under a random 63-bit id
(`uuid.uuid4()` in LMCache's vllm_multi_process_adapter.py), so /status says how many engines a server has, not
which."""

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
    # The L2 adapters' bytes used and capacity (summed), from storage_manager.l2_eviction_controller.adapters
    # (total_bytes_used / total_capacity_bytes: eviction_controller.py, LMCache 0.5.3 and 0.5.6); None where no
    # adapter is listed there (no L2, or one without an `eviction` block, which LMCache never tracks).
    l2_used_bytes: int | None = None
    l2_capacity_bytes: int | None = None


def parse_status(doc: Any) -> ServerSnapshot:
    """Figures from one /status document; SourceError when it is not LMCache's."""
    try:
        l1 = doc["storage_manager"]["l1_manager"]
        engines = len(doc.get("registered_gpu_ids") or []) + len(doc.get("registered_non_cuda_instance_ids") or [])
        l2 = (doc["storage_manager"].get("l2_eviction_controller") or {}).get("adapters") or []
        return ServerSnapshot(healthy=bool(doc["is_healthy"]), l1_used_bytes=int(l1["memory_used_bytes"]),
                              l1_total_bytes=int(l1["memory_total_bytes"]), engines=engines,
                              sessions=int(doc.get("active_sessions") or 0),
                              l2_used_bytes=sum(int(a["total_bytes_used"]) for a in l2) if l2 else None,
                              l2_capacity_bytes=sum(int(a["total_capacity_bytes"]) for a in l2) if l2 else None)
    except (KeyError, TypeError, ValueError):
        raise SourceError("not an LMCache server /status document") from None


def fetch_status(url: str, timeout: float) -> ServerSnapshot:
    try:
        doc = json.loads(fetch_text(url, timeout))
    except ValueError:
        raise SourceError(f"unparsable JSON from {url}") from None
    return parse_status(doc)
