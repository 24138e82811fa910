"""The operator's running state, in one object (kopf's memo holds it): the caches, the reconcile
queue, the resync loop, leadership, metrics and health.

kopf's handlers (handlers.py) keep KVOffloadServes, their children and pods in the caches (cache.py)
and kick the owning resource on every change; a slow resync kicks every resource. Kicks land in one
priority queue served by WORKERS threads: at most one reconcile per resource at a time, a kick during
one marks it for one more pass, and a burst of kicks (a rollout emits dozens of pod events) is one
queued entry. Failures retry with backoff. With leader election, a follower keeps its caches warm
(to know what exists) but never acts; on taking the Lease it catches up on everything cached.

Why a queue of our own next to kopf's per-object workers: kopf serialises the events of one *object*,
while a reconcile is per *owner* and fed by eight or nine kinds of objects. Reconciling from kopf's handlers
would run one full reconcile per child or pod event, several at once for one owner, on kopf's event
loop with a synchronous client; the queue runs one pass per owner however many events came, orders
progress before first passes, bounds the API calls in flight to WORKERS, and retries with backoff.

Every task the Runtime starts is watched: one that ends (a worker that died) is logged as an error,
counted, and makes `health` raise, which fails kopf's liveness probe (handlers.py), so the kubelet
restarts the operator instead of leaving it half-alive.

Order: a resource whose children or pods moved (PROGRESS: usually a no-op or one status write) is
served before resources that changed themselves (CHANGE: a new resource's first pass applies five
children), and both before the resync (RESYNC). So during a rollout of a thousand, a resource whose
pod became Running is reported Ready at once, not after every other resource's first pass.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import json
import logging
import random
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..api import crd
from ..api.settings import Settings
from ..rendering import render
from . import discovery, events, leader
from .cache import Cache, CachedKube
from .kube import Kube
from .metrics import Metrics
from .reconcile import CHILD_REFUSED, IDLE_SERVERS, REFUSED, SHARED_RECHECK_S, STATUS_SPACING, Memos
from .reconcile import reconcile as reconcile_one

log = logging.getLogger("kvoffload.operator")

Key = tuple[str, str]  # (namespace, name)

PROGRESS, CHANGE, RESYNC = 0, 1, 2
# Reconciles in flight at once (threads: the Kubernetes client is synchronous). The scale benchmark's
# floor mode uses the same number of client threads.
WORKERS = 8
REPORT_SECONDS = 10


class Runtime:
    def __init__(self, kube: Kube | None, settings: Settings, reconcile: Callable[..., str] | None = None,
                 namespaces: list[str] | None = None, workers: int = WORKERS,
                 child_kinds: tuple[tuple[str, str], ...] = render.CHILD_KINDS) -> None:
        """`child_kinds`: the kinds kopf watches (handlers.watch_optional_kinds).

        They are cached and the only ones reconciled."""
        self.discovered = discovery.Discovered()  # refreshed on the resync timer (_discover_forever)
        if reconcile is None:
            # One Events recorder, and so one token bucket, for the whole operator
            # (posts go to the API server, not the cache).
            assert kube is not None
            recorder = events.recorder(settings, lambda ns,
                                       body: kube.request("POST", f"/api/v1/namespaces/{ns}/events", body))
            reconcile = functools.partial(reconcile_one, recorder=recorder, memos=Memos(), child_kinds=child_kinds,
                                          discovered=self.discovered)
        self.settings, self.reconcile, self.workers = settings, reconcile, workers
        self.cache = Cache(namespaces, self._kicked, child_kinds=child_kinds)
        self.kube = CachedKube(kube, self.cache) if kube is not None else None
        self.heap: list[tuple[int, int, Key]] = []
        self.queued: dict[Key, int] = {}  # key -> priority of its live heap entry
        self.running: dict[Key, int | None] = {}  # key -> priority of a kick that came during the run
        self.backoff: dict[Key, float] = {}
        self.seq = itertools.count()
        self.wakeup = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.died: list[str] = []  # tasks that ended: each "name: why"
        self.stopping = False
        self.serving = False
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="reconcile")
        self.counts: Counter[str] = Counter()  # reconcile outcomes since start (logged every REPORT_SECONDS)
        self.metrics = Metrics()
        self.leading = True  # standalone; with leader election only while this replica holds the Lease
        self.elector: leader.Elector | None = None

    def start(self, lease: leader.LeaseConfig | None = None, lease_kube: Kube | None = None) -> None:
        """Start the resync loop and, given a Lease, the election (acting only while leading). The
        workers start once the caches are filled (`filled`)."""
        self._spawn(self._resync_forever(self.settings.resync_seconds), "resync")
        if self.kube is not None:
            self._spawn(self._discover_forever(self.settings.resync_seconds), "autoscaling discovery")
        self._spawn(self._report_forever(REPORT_SECONDS), "report")
        if lease is not None:
            self.leading = False
            self.elector = leader.Elector(lease_kube or self.kube, lease, self._on_leadership)  # type: ignore[arg-type]
            self._spawn(self.elector.run(), "leader election")

    def filled(self) -> None:
        """kopf released its first event handler: every kind is listed and stored; reconcile from now on."""
        log.info("caches filled: %s", ", ".join(f"{s.kind} {len(s)}" for s in self.cache.by_kind.values()))
        self._serve()

    async def stop(self) -> None:
        """On shutdown: give the Lease up so a follower need not wait for it to expire."""
        self.stopping = True
        if self.elector is not None:
            await self.elector.release()

    def health(self) -> dict[str, object]:
        """For kopf's liveness probe: the reconcile totals, or an error when a task of the Runtime died."""
        if self.died:
            raise RuntimeError("operator tasks died: " + "; ".join(self.died))
        return {"leading": self.leading, "queued": len(self.queued), "running": len(self.running),
                "reconciles": dict(self.counts)}

    # ------------------------------------------------------------------ the queue
    def _kicked(self, namespace: str, name: str, kind: str) -> None:
        self.kick(namespace, name, CHANGE if kind == crd.KIND else PROGRESS)

    def kick(self, namespace: str | None, name: str | None, priority: int = CHANGE) -> None:
        if not namespace or not name or not self.leading:
            return
        key = (namespace, name)
        if key in self.running:
            before = self.running[key]
            self.running[key] = priority if before is None else min(before, priority)
            return
        if key in self.queued and self.queued[key] <= priority:
            return
        self.queued[key] = priority  # a higher priority supersedes the queued entry (left in the heap, skipped)
        heapq.heappush(self.heap, (priority, next(self.seq), key))
        self.wakeup.set()

    async def _next(self) -> Key:
        while True:
            while self.heap:
                priority, _, key = heapq.heappop(self.heap)
                if self.queued.get(key) == priority:
                    del self.queued[key]
                    return key
            self.wakeup.clear()
            await self.wakeup.wait()

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            key = await self._next()
            if not self.leading:
                continue
            self.running[key] = None
            try:
                outcome = await loop.run_in_executor(self.executor, self.reconcile, self.kube, key[0], key[1],
                                                     self.settings)
                self._count(outcome)
                if outcome == REFUSED:  # reconcile logged it and recorded an Event; try again later
                    self.metrics.status_refused.inc()
                    self._retry(key)
                elif outcome == CHILD_REFUSED:  # ConfigValid says why; the cause may go away (quota, other owner)
                    self._retry(key)
                else:
                    self.backoff.pop(key, None)
                if outcome == "deferred":  # a progress-only status write waits for the spacing
                    loop.call_later(STATUS_SPACING, self.kick, key[0], key[1], PROGRESS)
                if outcome == IDLE_SERVERS:  # a shared server without replicas goes when its grace period ends
                    loop.call_later(min(SHARED_RECHECK_S, max(1.0, self.settings.shared_server_grace_seconds)),
                                    self.kick, key[0], key[1], PROGRESS)
                log.debug("reconciled %s/%s: %s", *key, outcome)
            except Exception as exc:  # API down, timeouts: level-based, so just try again later
                self._count("failed")
                delay = self._retry(key)
                log.warning("reconcile %s/%s failed (retry in %.1fs): %s", *key, delay, exc)
            finally:
                again = self.running.pop(key)
                if again is not None:
                    self.kick(key[0], key[1], again)
                self.metrics.queued.set(len(self.queued))

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        self.metrics.reconciles.labels(outcome).inc()

    def _retry(self, key: Key) -> float:
        """Kick `key` again after its backoff (0.5 s, doubling to 30 s); return the delay."""
        delay = self.backoff.get(key, 0.5)
        self.backoff[key] = min(delay * 2, 30)
        asyncio.get_running_loop().call_later(delay * (1 + random.random() / 2), self.kick, key[0], key[1], CHANGE)
        return delay

    def _serve(self) -> None:
        """Start the workers (once)."""
        if not self.serving:
            self.serving = True
            for i in range(self.workers):
                self._spawn(self._work(), f"worker {i}")

    def _spawn(self, coro, name: str) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """Every task runs until shutdown: one that ends earlier died. Say so loudly; `health` fails."""
        self.tasks.discard(task)
        if task.cancelled() or self.stopping or (self.elector is not None and self.elector.stopped):
            return  # shutting down (the event loop cancels what is left)
        why = repr(task.exception()) if task.exception() else "returned"
        self.died.append(f"{task.get_name()}: {why}")
        self.metrics.dead_tasks.set(len(self.died))
        log.error("operator task %s died (%s): the liveness probe fails from now on", task.get_name(), why,
                  exc_info=task.exception())

    # ------------------------------------------------------------------ resync and leadership
    def known(self) -> list[Key]:
        return sorted(self.cache.serves())

    def _kick_known(self, priority: int) -> None:
        for namespace, name in self.known():
            self.kick(namespace, name, priority)

    def _on_leadership(self, leading: bool) -> None:
        self.leading = leading
        if leading:  # catch up on everything the caches saw while following
            self._kick_known(CHANGE)

    async def _resync_forever(self, interval: float) -> None:
        """Level-based safety net: re-reconcile every known resource now and then (writes only on drift)."""
        while True:
            await asyncio.sleep(interval)
            log.info("resync %d resources", len(self.known()))
            self._kick_known(RESYNC)

    async def _discover_forever(self, interval: float) -> None:
        """What the API server serves for autoscaling (discovery.py): now, then every resync period. A change
        (KEDA or an adapter installed, an APIService gone) re-evaluates every resource's AutoscalingReady."""
        assert self.kube is not None
        get = functools.partial(self.kube.request, "GET")
        while True:
            if await asyncio.to_thread(self.discovered.refresh, get):
                log.info("autoscaling discovery: %s", self.discovered.apis)
                self._kick_known(CHANGE)
            await asyncio.sleep(interval)

    async def _report_forever(self, interval: float) -> None:
        """One log line when the totals moved: reconciles by outcome since start (the scale benchmark reads it)."""
        last: dict[str, int] = {}
        while True:
            await asyncio.sleep(interval)
            now = dict(sorted(self.counts.items()))
            if now != last:
                log.info("reconciles so far: %s", json.dumps(now))
                last = now
