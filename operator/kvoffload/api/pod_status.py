"""What the operator reads from a pod's status: its conditions, and whether it is Ready (the serving pods the
router is started with, the conditions the resource reports, and `kubectl kvs why` all ask the same way)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def condition(pod: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    """The pod's condition of that type, or None while the kubelet has not reported it."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


def ready(pod: Mapping[str, Any]) -> bool:
    """The pod's Ready condition is True: every container passed its readiness probe."""
    return (condition(pod, "Ready") or {}).get("status") == "True"
