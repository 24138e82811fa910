"""api/pod_status: the one way the router's workers, the resource's conditions and `kubectl kvs why` read a pod."""

from __future__ import annotations

import pytest

from kvoffload.api import pod_status


def pod(*conditions: tuple[str, str]) -> dict:
    return {"metadata": {"name": "p"}, "status": {"conditions": [{"type": t, "status": s} for t, s in conditions]}}


@pytest.mark.parametrize(("p", "ready"), [
    (pod(("PodScheduled", "True"), ("Ready", "True")), True),
    (pod(("Ready", "False")), False),
    (pod(("Ready", "Unknown")), False),
    (pod(("PodScheduled", "True"), ("ContainersReady", "True")), False),  # not reported yet is not Ready
    ({"metadata": {"name": "p"}}, False),  # a pod just created: no status at all
    ({"metadata": {"name": "p"}, "status": {"conditions": None}}, False),
])
def test_ready_is_the_ready_condition_true(p, ready):
    assert pod_status.ready(p) is ready


def test_condition_returns_the_one_asked_for():
    p = pod(("PodScheduled", "False"), ("Ready", "False"))
    assert pod_status.condition(p, "PodScheduled") == {"type": "PodScheduled", "status": "False"}
    assert pod_status.condition(p, "Initialized") is None
