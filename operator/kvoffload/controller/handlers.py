"""kopf registrations, and nothing else: every event ends in the one idempotent `reconcile`.

kopf is edge-triggered; this makes it level-based: CR events, child events and a slow timer
all kick the same per-resource queue, which coalesces bursts (a rollout emits dozens of pod
events) into one reconcile at a time per resource and retries failures with backoff.
Handlers keep no state in the resource: no finalizer, no progress annotations. (A kopf timer
would add a finalizer to every resource, so the resync is a plain task over the resources seen.)
"""

from __future__ import annotations

import asyncio
import logging
import random

import kopf

from . import leader
from ..api import crd
from ..rendering import render
from .kube import Kube, load_api_client
from .reconcile import reconcile
from ..api.settings import Settings, load

log = logging.getLogger("kvoffload.operator")


class Queue:
    """At most one reconcile per resource in flight; kicks during one mark it dirty for one more pass."""

    def __init__(self, kube: Kube, settings: Settings) -> None:
        self.kube, self.settings = kube, settings
        self.running: dict[tuple[str, str], bool] = {}  # key -> dirty
        self.tasks: set[asyncio.Task[None]] = set()
        self.leading = True  # standalone; with leader election only while this replica holds the Lease

    def kick(self, namespace: str, name: str) -> None:
        if not self.leading:  # a follower watches (to know what exists) but never acts
            return
        key = (namespace, name)
        if key in self.running:
            self.running[key] = True
            return
        self.running[key] = False
        task = asyncio.get_running_loop().create_task(self._drain(key))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _drain(self, key: tuple[str, str]) -> None:
        delay = 0.5
        try:
            while True:
                self.running[key] = False
                try:
                    outcome = await asyncio.to_thread(reconcile, self.kube, key[0], key[1], self.settings)
                    log.debug("reconciled %s/%s: %s", *key, outcome)
                    delay = 0.5
                except Exception as exc:  # API down, timeouts: level-based, so just try again later
                    log.warning("reconcile %s/%s failed (retry in %.1fs): %s", *key, delay, exc)
                    await asyncio.sleep(delay * (1 + random.random() / 2))
                    delay = min(delay * 2, 30)
                    self.running[key] = True
                if not self.running[key] or not self.leading:
                    return
        finally:
            self.running.pop(key, None)


QUEUE: Queue | None = None
SETTINGS: Settings = Settings()
KNOWN: set[tuple[str, str]] = set()  # resources seen in watch events, for the resync
ELECTOR: leader.Elector | None = None


def _kick(namespace: str | None, name: str | None) -> None:
    if QUEUE is not None and namespace and name:
        QUEUE.kick(namespace, name)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: object) -> None:
    global QUEUE, SETTINGS, ELECTOR
    SETTINGS = load()
    QUEUE = Queue(Kube(load_api_client()), SETTINGS)
    settings.persistence.finalizer = f"{crd.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=crd.GROUP, key="last-handled-configuration")
    settings.watching.server_timeout = 300  # watches never go idle silently
    settings.watching.client_timeout = 310
    # No cluster-wide CRD/namespace scanning: the chart's least-privilege RBAC (a Role per watched
    # namespace) grants neither, and the operator knows its one resource and its namespaces.
    settings.scanning.disabled = True
    settings.posting.enabled = False  # conditions carry the story; no event per reconcile
    settings.execution.max_workers = 8
    QUEUE.tasks.add(asyncio.get_running_loop().create_task(_resync_forever(SETTINGS.resync_seconds)))
    lease = leader.config_from_env()
    if lease is not None:  # `run --leader-election`: act only while holding the Lease
        QUEUE.leading = False
        ELECTOR = leader.Elector(Kube(load_api_client(), timeout=5), lease, _on_leadership)
        QUEUE.tasks.add(asyncio.get_running_loop().create_task(ELECTOR.run()))


def _on_leadership(leading: bool) -> None:
    if QUEUE is not None:
        QUEUE.leading = leading
        if leading:  # catch up on everything the watches saw while following
            for namespace, name in sorted(KNOWN):
                _kick(namespace, name)


@kopf.on.cleanup()
async def release_lease(**_: object) -> None:
    if ELECTOR is not None:
        await ELECTOR.release()


async def _resync_forever(interval: float) -> None:
    """Level-based safety net: re-reconcile every known resource now and then (writes only on drift)."""
    while True:
        await asyncio.sleep(interval)
        for namespace, name in sorted(KNOWN):
            _kick(namespace, name)


@kopf.on.event(crd.GROUP, crd.VERSION, crd.PLURAL)
async def serve_event(type: str | None, namespace: str | None, name: str | None, **_: object) -> None:
    if not namespace or not name:
        return
    if type == "DELETED":
        KNOWN.discard((namespace, name))
        return
    KNOWN.add((namespace, name))
    _kick(namespace, name)


async def _child_event(labels: dict[str, str], namespace: str | None, **_: object) -> None:
    _kick(namespace, labels.get(render.OWNER_LABEL))


# Handlers are async: they only kick the queue, on the event loop. Child events: pods drive Scheduled/Ready; the rest catches drift (a child deleted or edited by hand).
for _resource in (("v1", "pods"), ("apps", "v1", "statefulsets"), ("v1", "configmaps"), ("v1", "services"),
                  ("policy", "v1", "poddisruptionbudgets"), ("networking.k8s.io", "v1", "networkpolicies")):
    kopf.on.event(*_resource, labels={render.OWNER_LABEL: kopf.PRESENT})(_child_event)
