"""What the API server serves for autoscaling, read from discovery: the custom metrics API (a metrics adapter such
as prometheus-adapter behind the APIService v1beta1.custom.metrics.k8s.io), the external metrics API (KEDA's
metrics server) and KEDA's ScaledObject.

Discovery (`GET /apis/GROUP/VERSION`) is readable by every authenticated client (system:discovery), so this needs no
RBAC; it answers 404 when no APIService or CRD registers the group, 503 when an APIService is registered but its
backend is not Available, and else lists what is served (an adapter lists each metric it serves, `pods/NAME`).
Read once at start and again on the slow resync timer (runtime.py): three GETs per resync period for the whole
operator, not one per reconcile. `read` does the I/O; what it returns is plain data that conditions.py judges.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .kube import ApiError

log = logging.getLogger("kvoffload.discovery")

CUSTOM_METRICS = "custom.metrics.k8s.io/v1beta1"
EXTERNAL_METRICS = "external.metrics.k8s.io/v1beta1"
KEDA = "keda.sh/v1alpha1"
SERVED, NOT_REGISTERED, UNAVAILABLE = "Served", "NotRegistered", "Unavailable"


@dataclass(frozen=True)
class Api:
    state: str  # SERVED | NOT_REGISTERED | UNAVAILABLE
    resources: frozenset[str] = frozenset()  # names discovery lists ("pods/vllm_num_requests_waiting", "scaledobjects")
    detail: str = ""  # the API server's message when not served


@dataclass(frozen=True)
class AutoscalingApis:
    custom_metrics: Api
    external_metrics: Api
    keda: Api


def _api(get: Callable[[str], Any], group_version: str) -> Api:
    try:
        found = get(f"/apis/{group_version}") or {}
    except ApiError as exc:
        if exc.status == 404:
            return Api(NOT_REGISTERED)
        if exc.status in (502, 503):  # registered, but the aggregated server behind it does not answer
            return Api(UNAVAILABLE, detail=exc.message)
        raise
    return Api(SERVED, frozenset(r.get("name", "") for r in found.get("resources", []) or []))


def read(get: Callable[[str], Any]) -> AutoscalingApis:
    """`get(path)`: a GET that returns the decoded body or raises ApiError (Kube.request bound to GET)."""
    return AutoscalingApis(_api(get, CUSTOM_METRICS), _api(get, EXTERNAL_METRICS), _api(get, KEDA))


class Discovered:
    """The latest reading, shared by the Runtime (which refreshes it) and every reconcile (which reads it).
    None until the first reading: the condition then says Unknown rather than guess."""

    def __init__(self) -> None:
        self.apis: AutoscalingApis | None = None

    def refresh(self, get: Callable[[str], Any]) -> bool:
        """Read again; True when what is served changed (the Runtime then re-reconciles every resource)."""
        try:
            now = read(get)
        except Exception as exc:  # the API server down: keep the last reading, the next timer tries again
            log.warning("autoscaling discovery failed (kept the last reading): %s", exc)
            return False
        changed, self.apis = now != self.apis, now
        return changed
