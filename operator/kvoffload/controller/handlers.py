"""kopf registrations and one startup, nothing else: kopf runs the process and watches; the Runtime
(runtime.py) queues and reconciles.

kopf watches the KVOffloadServes, each child kind and the pods (pods filtered by the API server on the
owner label; the child kinds whole, so the cache knows who holds every name a child may take: reconcile's
NameConflict check): for each kind an index handler stores what kopf sees and kicks the owner, and an event
handler handles deletions and relists (cache.py). kopf holds every event handler
until each kind has been listed and indexed, so the first one to run tells the Runtime its caches are
filled. Only index and event handlers: kopf adds no finalizer and writes no progress or diff-base
annotation on any object. The liveness probe fails once a task of the Runtime died.

What `kvoffload run` decided (settings with the autoscaler resolved, namespaces, metrics address, Lease)
reaches the handlers once, as one `Decided` in kopf's memo (`kopf.operator(memo=kopf.Memo(decided=...))`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kopf
import urllib3

from ..api import crd
from ..api.settings import Settings, resolve_autoscaler
from ..rendering import autoscaling, render
from . import leader
from .cache import CR_API_VERSION, KINDS
from .kube import ApiError, Kube, collection, load_api_client
from .runtime import Runtime

log = logging.getLogger("kvoffload.operator")


@dataclass(frozen=True)
class Decided:
    """What `kvoffload run` decided before kopf starts, handed to the startup handler in kopf's memo."""

    settings: Settings  # the operator config, autoscaler `auto` resolved (watch_optional_kinds)
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    metrics_listen: str = ""  # ADDR:PORT of the operator's /metrics; empty: none
    lease: leader.LeaseConfig | None = None  # leader election on this Lease; None: standalone


class Forever:
    """Backoffs that never run out (1 s doubling to 10 s): kopf's LISTs and WATCHes retry an API server
    that is down for as long as it is down, instead of giving up (and stopping the operator) after
    kopf's default 54 s. Not a Sized iterable, so kopf counts no last attempt; a fresh iterator per request."""

    def __iter__(self) -> Iterator[float]:
        delay = 1.0
        while True:
            yield delay
            delay = min(delay * 2, 10.0)


class NoDiffBase(kopf.DiffBaseStorage):
    """No change-detecting handlers here, so no diff base: kopf skips its per-event copy of every body."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return {}  # type: ignore[return-value]

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        pass


def _resource(api_version: str, kind: str) -> tuple[str, str, str]:
    """(group, version, plural), as kopf selects a resource ("" is the core group)."""
    group, _, version = api_version.rpartition("/")
    return group, version, collection(api_version, kind, "_").rsplit("/", 1)[1]


async def _served(kube: Kube, api_version: str, kind: str) -> bool:
    """The API server serves this kind (discovery, which every authenticated client may read: no CRD access)."""
    try:
        found = await asyncio.to_thread(kube.request, "GET", f"/apis/{api_version}")
    except ApiError as exc:
        if exc.status != 404:
            raise
        return False
    return any(r.get("name") == _resource(api_version, kind)[2] for r in (found or {}).get("resources", []))


async def _wait_for_crd(kube: Kube) -> None:
    """kopf resolves the watched kinds once at start (scanning is off): wait until the CRD is served."""
    for attempt in itertools.count():
        if await _served(kube, CR_API_VERSION, crd.KIND):
            return
        if attempt % 10 == 0:
            log.info("waiting for the %s CRD to be served at /apis/%s", crd.KIND, CR_API_VERSION)
        await asyncio.sleep(1)


# The child kinds kopf watches: render.CHILD_KINDS, and those `watch_optional_kinds` registered handlers for.
_watched: list[tuple[str, str]] = list(render.CHILD_KINDS)


@dataclass(frozen=True)
class Watched:
    settings: Settings  # autoscaler `auto` resolved to hpa or keda (settings.resolve_autoscaler)
    missing: tuple[tuple[str, str], ...] = ()  # optional kinds `settings` render that the API server does not serve


async def watch_optional_kinds(kube: Kube, settings: Settings) -> Watched:
    """Before kopf starts (its watched kinds are fixed then; kopf takes no handlers later): watch the child kinds
    beyond render.CHILD_KINDS that `settings` render (KEDA's ScaledObject with autoscaler keda) where the API
    server serves them. One it does not serve is not watched, and the operator runs on: a KVOffloadServe that
    would render it is refused (ConfigValid False naming spec.autoscaling, reconcile.sync_children) until KEDA is
    installed and the operator restarted. Returns the settings with `auto` resolved and the kinds not served.
    Retries while the API server is down."""
    optional = [k for k in render.child_kinds(settings) if k not in _watched]
    delays = iter(Forever())
    while True:
        try:
            served = [k for k in optional if await _served(kube, *k)]
            break
        except (ApiError, urllib3.exceptions.HTTPError) as exc:
            delay = next(delays)
            log.warning("discovery of %s failed (retry in %.0fs): %s", optional, delay, exc)
            await asyncio.sleep(delay)
    resolved = resolve_autoscaler(settings, autoscaling.SCALED_OBJECT in served)
    if settings.autoscaler == "auto":
        log.info("autoscaler auto: %s (KEDA's ScaledObject %s, prometheusAddress %s)", resolved.autoscaler,
                 "served" if autoscaling.SCALED_OBJECT in served else "not served",
                 "set" if settings.prometheus_address else "not set")
        if resolved.autoscaler == "hpa":
            return Watched(resolved)  # nothing optional to watch: the HPA is a CHILD_KIND
    for api_version, kind in served:
        _register(api_version, kind)
        _watched.append((api_version, kind))
    missing = tuple(k for k in optional if k not in served)
    for api_version, kind in missing:
        log.warning("the API server serves no %s %s (is KEDA installed?): not watched; KVOffloadServes with "
                    "spec.autoscaling are refused until it is and the operator is restarted", api_version, kind)
    return Watched(resolved, missing)


def tune(settings: kopf.OperatorSettings) -> None:
    """All of kopf's settings, in one place."""
    # No cluster-wide CRD/namespace scanning: the chart's least-privilege RBAC (a Role per watched
    # namespace) grants neither, and the operator knows its one resource and its namespaces.
    settings.scanning.disabled = True
    settings.posting.enabled = False  # no kopf event per handler run; ours are per transition (events.py)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.watching.server_timeout = 300  # watches never go idle; the client gives the server 10 s more
    settings.watching.client_timeout = 310
    settings.networking.error_backoffs = Forever()
    # Only our pods: the API server filters them on the owner label. The child kinds are watched whole, so a name
    # another owner holds is known before a child takes it, with no GET per new child (cache.slim keeps only who
    # holds such an object). Pods need no such check: the StatefulSet names them, and pods are never applied.
    settings.watching.label_selectors[_resource("v1", "Pod")] = render.OWNER_LABEL


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: object) -> None:
    tune(settings)
    kube = Kube(load_api_client())
    await _wait_for_crd(kube)
    decided: Decided = memo.decided  # from `kvoffload run`: kopf.operator(memo=kopf.Memo(decided=...))
    memo.runtime = Runtime(kube, decided.settings, namespaces=list(decided.namespaces) or None,
                           child_kinds=tuple(_watched))
    if decided.metrics_listen:
        memo.runtime.metrics.serve(decided.metrics_listen)
    lease = decided.lease  # `run --leader-election`: act only while holding the Lease
    memo.runtime.start(lease, Kube(load_api_client(), timeout=5) if lease else None)


@kopf.on.cleanup()
async def release_lease(memo: kopf.Memo, **_: object) -> None:
    if "runtime" in memo:  # startup may have failed before it made one
        await memo.runtime.stop()


@kopf.on.probe(id="runtime")
def runtime_health(memo: kopf.Memo, **_: object) -> dict[str, object]:
    """Liveness: fails (kopf answers 500) once a worker or another task of the Runtime died."""
    if "runtime" not in memo:
        return {"starting": True}
    try:
        return memo.runtime.health()
    except RuntimeError as exc:
        raise kopf.PermanentError(str(exc)) from None


def _register(api_version: str, kind: str) -> None:
    # async: kopf runs them on its event loop (a plain def would go through a thread pool per event).
    group, version, plural = _resource(api_version, kind)

    @kopf.index(group, version, plural, id=f"cache-{plural}")
    async def put(body: kopf.Body, memo: kopf.Memo, **_: object) -> None:
        memo.runtime.cache.put(api_version, kind, body)

    @kopf.on.event(group, version, plural, id=f"event-{plural}")
    async def event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: object) -> None:
        if memo.runtime.cache.event(api_version, kind, type, body):
            memo.runtime.filled()


for _api_version, _kind in KINDS:
    _register(_api_version, _kind)
