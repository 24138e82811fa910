"""Where replicas go: spread over nodes by default, so one node failure or drain never takes every
replica, and replicas do not compete for one node's NVMe."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the GPU host imports this without the API client
    from ..api.spec import Spec


HOSTNAME = "kubernetes.io/hostname"


def topology_spread(spec: Spec, selector: dict[str, str]) -> list[dict[str, Any]]:
    """spec.scheduling.topologySpreadConstraints when set (an empty list turns spreading off), else a soft
    spread over hostnames: ScheduleAnyway, so replicas still schedule when there are fewer nodes than replicas."""
    if spec.scheduling.topology_spread_constraints is not None:
        return [dict(c) for c in spec.scheduling.topology_spread_constraints]
    return [{"maxSkew": 1, "topologyKey": HOSTNAME, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": dict(selector)}}]
