"""What the real GitOps checkers read before the operator's first full status: kstatus (the library Helm v4
--wait and Flux wait with, tests/gitops/kstatus-check) and the Argo CD health check on gopher-lua.

The operator once wrote a "Reconciling=True, everything else Unknown" status the moment it saw a new resource,
before the first child was applied. The CRD's status default (observedGeneration: 0, which the API server applies:
tests/integration/test_gitops.py checks the object as created reads exactly {"observedGeneration": 0}) already
makes every checker read such a resource as in progress. This table proves the write changed no verdict in any
state a resource can be in before the operator has written to it, which is why the operator no longer makes it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvoffload.api.conditions import TYPES
from kvtest import gitops as gt


def initial(body: dict[str, Any]) -> dict[str, Any]:
    """The first-sight status the operator used to write (`conditions.initial` before this test dropped it):
    Reconciling=True, every other condition Unknown (reason Pending), observedGeneration left at 0."""
    meta = body["metadata"]
    generation = meta.get("generation", 1)
    waiting = f"the operator has seen generation {generation} and is working on it"

    def cond(type_: str, status: str) -> dict[str, Any]:
        return {"type": type_, "status": status, "reason": "Pending", "message": waiting,
                "lastTransitionTime": gt.PLACEHOLDER_TIME, "observedGeneration": generation}
    conds = [cond(t, "Unknown") for t in TYPES if t not in ("Reconciling", "Stalled")]
    conds += [cond("Reconciling", "True"), cond("Stalled", "Unknown")]
    return {"observedGeneration": 0, "conditions": conds, "replicas": 0, "readyReplicas": 0,
            "selector": f"kvoffload.io/serve={meta['name']}"}


def created(generation: int = 1, spec: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    """A resource as the API server serves it before the operator wrote anything: the captured just-created
    object (status: the CRD's default only), at `generation`, with `spec` merged over its spec."""
    obj = copy.deepcopy(gt.read_fixture("just-created"))
    obj["metadata"].update({"generation": generation, **meta})
    obj["spec"].update(spec or {})
    assert obj["status"] == {"observedGeneration": 0}
    return obj


# state -> (the object before the operator's first write, what kstatus reads, what Argo CD reads)
STATES = {
    "just created": (created(), "InProgress", "Progressing"),
    # Changed twice before the operator first saw it (the operator was down or busy).
    "changed before seen": (created(3), "InProgress", "Progressing"),
    "scaled to zero": (created(spec={"replicas": 0}), "InProgress", "Progressing"),
    "invalid spec": (created(spec={"offload": {"cpu": {"size": "16Gi"}, "disk": {"path": "/etc", "size": "1Gi"}}}),
                     "InProgress", "Progressing"),
    "being deleted": (created(deletionTimestamp=gt.PLACEHOLDER_TIME, finalizers=["example.com/hold"]),
                      "Terminating", "Progressing"),
}


@pytest.mark.parametrize("state", sorted(STATES))
def test_the_first_sight_write_changes_no_verdict(gitops_tools, state):
    before, kstatus, argocd = STATES[state]
    written = {**before, "status": initial(before)}
    assert [v["status"] for v in (gt.kstatus_file(before), gt.kstatus_file(written))] == [kstatus, kstatus]
    assert [v["status"] for v in gt.lua_health([before, written])] == [argocd, argocd]


def test_without_the_crd_default_kstatus_would_read_current(gitops_tools):
    """Why the default matters: an object with no status at all is Current to kstatus (Helm --wait would return)."""
    bare = {k: v for k, v in created().items() if k != "status"}
    assert gt.kstatus_file(bare)["status"] == "Current"
