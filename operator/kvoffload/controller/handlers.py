"""kopf registrations and one startup, nothing else: kopf runs the process (start-up, shutdown,
liveness endpoint, logging); the Runtime (runtime.py) watches, queues and reconciles.

No kopf resource handler is registered: the Runtime's own informers (informer.py) watch the
KVOffloadServes, their children and pods once each and keep them in memory, so reconciles read
nothing from the API server; kopf watching the same kinds would double every watch stream. So kopf
adds no finalizer and writes no progress or diff-base annotations. (A kopf timer would add a
finalizer to every resource, so the resync is a plain task of the Runtime.) The Runtime lives in
kopf's operator memo.
"""

from __future__ import annotations

import os

import kopf

from ..api.settings import load
from . import leader
from .kube import Kube, load_api_client
from .runtime import Runtime

NAMESPACES_ENV = "KVOFFLOAD_NAMESPACES"  # comma-separated; empty: every namespace. Set by `kvoffload run`.


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: object) -> None:
    # No cluster-wide CRD/namespace scanning: the chart's least-privilege RBAC (a Role per watched
    # namespace) grants neither, and the operator knows its one resource and its namespaces.
    settings.scanning.disabled = True
    settings.posting.enabled = False  # no kopf event per handler run; ours are per transition (events.py)
    namespaces = [ns for ns in os.environ.get(NAMESPACES_ENV, "").split(",") if ns]
    memo.runtime = Runtime(Kube(load_api_client()), load(), namespaces=namespaces or None)
    lease = leader.config_from_env()  # `run --leader-election`: act only while holding the Lease
    memo.runtime.start(lease, Kube(load_api_client(), timeout=5) if lease else None)


@kopf.on.cleanup()
async def release_lease(memo: kopf.Memo, **_: object) -> None:
    if "runtime" in memo:  # startup may have failed before it made one
        await memo.runtime.stop()
