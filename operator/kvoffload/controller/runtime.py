"""The operator's running state, in one object: the reconcile queue, the resources seen, the resync
loop and leadership.

kopf is edge-triggered; this makes it level-based: CR events, child events and a slow resync all
kick the same per-resource queue, which coalesces bursts (a rollout emits dozens of pod events)
into one reconcile at a time per resource and retries failures with backoff. With leader election,
a follower watches (to know what exists) but never acts; on taking the Lease it catches up on
everything seen.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Callable

from ..api.settings import Settings
from . import events, leader
from .kube import Kube
from .reconcile import reconcile as reconcile_one

log = logging.getLogger("kvoffload.operator")

Key = tuple[str, str]  # (namespace, name)


class Runtime:
    """At most one reconcile per resource in flight; kicks during one mark it dirty for one more pass."""

    def __init__(self, kube: Kube, settings: Settings, reconcile: Callable[..., str] | None = None) -> None:
        # One Events recorder, and so one token bucket, for the whole operator.
        recorder = events.Recorder(lambda ns, body: kube.request("POST", f"/api/v1/namespaces/{ns}/events", body))
        self.kube, self.settings = kube, settings
        self.reconcile = reconcile or functools.partial(reconcile_one, recorder=recorder)
        self.running: dict[Key, bool] = {}  # key -> dirty
        self.tasks: set[asyncio.Task[None]] = set()
        self.known: set[Key] = set()  # resources seen in watch events, for the resync and a new leader
        self.leading = True  # standalone; with leader election only while this replica holds the Lease
        self.elector: leader.Elector | None = None

    def start(self, lease: leader.LeaseConfig | None = None, lease_kube: Kube | None = None) -> None:
        """Start the resync loop and, given a Lease, the election (acting only while leading)."""
        self._spawn(self._resync_forever(self.settings.resync_seconds))
        if lease is not None:
            self.leading = False
            self.elector = leader.Elector(lease_kube or self.kube, lease, self._on_leadership)
            self._spawn(self.elector.run())

    async def stop(self) -> None:
        """On shutdown: give the Lease up so a follower need not wait for it to expire."""
        if self.elector is not None:
            await self.elector.release()

    def seen(self, namespace: str, name: str) -> None:
        self.known.add((namespace, name))
        self.kick(namespace, name)

    def gone(self, namespace: str, name: str) -> None:
        self.known.discard((namespace, name))

    def kick(self, namespace: str | None, name: str | None) -> None:
        if not namespace or not name or not self.leading:
            return
        key = (namespace, name)
        if key in self.running:
            self.running[key] = True
            return
        self.running[key] = False
        self._spawn(self._drain(key))

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _drain(self, key: Key) -> None:
        delay = 0.5
        try:
            while True:
                self.running[key] = False
                try:
                    outcome = await asyncio.to_thread(self.reconcile, self.kube, key[0], key[1], self.settings)
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

    def _kick_known(self) -> None:
        for namespace, name in sorted(self.known):
            self.kick(namespace, name)

    def _on_leadership(self, leading: bool) -> None:
        self.leading = leading
        if leading:  # catch up on everything the watches saw while following
            self._kick_known()

    async def _resync_forever(self, interval: float) -> None:
        """Level-based safety net: re-reconcile every known resource now and then (writes only on drift)."""
        while True:
            await asyncio.sleep(interval)
            self._kick_known()
