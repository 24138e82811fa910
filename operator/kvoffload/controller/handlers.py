"""kopf registrations and one startup, nothing else: every event kicks the Runtime (runtime.py),
which ends in the one idempotent `reconcile`.

Handlers keep no state in the resource: only event handlers are registered, so kopf adds no
finalizer and writes no progress or diff-base annotations. (A kopf timer would add a finalizer
to every resource, so the resync is a plain task of the Runtime.) The Runtime lives in kopf's
operator memo; each resource's memo is a shallow copy of it, so every handler sees the same one.
"""

from __future__ import annotations

import kopf

from ..api import crd
from ..api.settings import load
from ..rendering import render
from . import leader
from .kube import Kube, load_api_client
from .runtime import Runtime


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: object) -> None:
    settings.watching.server_timeout = 300  # watches never go idle silently
    settings.watching.client_timeout = 310
    # No cluster-wide CRD/namespace scanning: the chart's least-privilege RBAC (a Role per watched
    # namespace) grants neither, and the operator knows its one resource and its namespaces.
    settings.scanning.disabled = True
    settings.posting.enabled = False  # no kopf event per handler run; ours are per transition (events.py)
    settings.execution.max_workers = 8
    memo.runtime = Runtime(Kube(load_api_client()), load())
    lease = leader.config_from_env()  # `run --leader-election`: act only while holding the Lease
    memo.runtime.start(lease, Kube(load_api_client(), timeout=5) if lease else None)


@kopf.on.cleanup()
async def release_lease(memo: kopf.Memo, **_: object) -> None:
    if "runtime" in memo:  # startup may have failed before it made one
        await memo.runtime.stop()


@kopf.on.event(crd.GROUP, crd.VERSION, crd.PLURAL)
async def serve_event(type: str | None, namespace: str | None, name: str | None, memo: kopf.Memo, **_: object) -> None:
    if not namespace or not name:
        return
    if type == "DELETED":
        memo.runtime.gone(namespace, name)
    else:
        memo.runtime.seen(namespace, name)


async def _child_event(labels: dict[str, str], namespace: str | None, memo: kopf.Memo, **_: object) -> None:
    memo.runtime.kick(namespace, labels.get(render.OWNER_LABEL))


# Handlers are async: they only kick the Runtime, on the event loop. Child events: pods drive
# Scheduled/Ready; the rest catches drift (a child deleted or edited by hand).
for _resource in (("v1", "pods"), ("apps", "v1", "statefulsets"), ("v1", "configmaps"), ("v1", "services"),
                  ("policy", "v1", "poddisruptionbudgets"), ("networking.k8s.io", "v1", "networkpolicies")):
    kopf.on.event(*_resource, labels={render.OWNER_LABEL: kopf.PRESENT})(_child_event)
