"""Watch-fed caches (informers): the operator reads children, pods and KVOffloadServes from memory.

One Informer per kind and namespace (or cluster-wide) LISTs once, then WATCHes from the list's
resourceVersion. Every change of an object kicks the KVOffloadServe it belongs to, so a reconcile
always runs again after the cache moved; reconciles themselves read only from here.

Why a cache cannot serve a stale decision for long:
- A watch that breaks (API server restart, timeout) resumes from the last resourceVersion seen;
  if the server no longer has that history (410 Gone, or any other refusal) the informer LISTs
  again and *replaces* its store: objects missing from the new list are dropped (a DELETE the
  watch never delivered) and objects that differ are replaced, and every owner touched is kicked.
- Objects are never mutated in place: the store holds each version as received, and a version
  older than the one held (by resourceVersion) never replaces it, so the result of our own write
  (`observe`, read-your-writes) is not undone by a late watch event of the version before it.
- Until every informer has listed once (`synced`), no reconcile runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp

from ..api import crd
from ..rendering import render
from .kube import Kube, collection

log = logging.getLogger("kvoffload.informer")

Obj = dict[str, Any]
ObjKey = tuple[str, str]  # (namespace, name)
Kick = Callable[[str, str, str], None]  # (namespace, owner name, kind)

CR_API_VERSION = f"{crd.GROUP}/{crd.VERSION}"
# What the reconcile reads: its KVOffloadServe, the four child kinds and the pods.
KINDS = ((CR_API_VERSION, crd.KIND), *render.CHILD_KINDS, ("v1", "Pod"))

_PATH = re.compile(r"^(?P<base>/api/v1|/apis/[^/]+/[^/]+)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?$")


def _rv(obj: Obj) -> int | None:
    try:
        return int(obj["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return None


def newer(new: Obj, old: Obj | None) -> bool:
    """`new` may replace `old`: it is not an older version (resourceVersions compared as etcd revisions)."""
    if old is None:
        return True
    a, b = _rv(new), _rv(old)
    return a is None or b is None or a >= b


def slim(obj: Obj, api_version: str, kind: str) -> Obj:
    """What the cache keeps of an object: no managedFields (a third of a child's bytes, never read);
    of a pod, only its metadata, spec.nodeName and status (its spec is the StatefulSet's template)."""
    meta = {k: v for k, v in obj.get("metadata", {}).items() if k != "managedFields"}
    out = {**obj, "apiVersion": api_version, "kind": kind, "metadata": meta}
    if kind == "Pod":
        out["spec"] = {"nodeName": (obj.get("spec") or {}).get("nodeName")}
    return out


class Store:
    """The objects of one kind, by (namespace, name), with an index by owner label. Thread-safe:
    informers write on the event loop, reconciles read from worker threads."""

    def __init__(self, kind: str, owner_of: Callable[[Obj], str | None]) -> None:
        self.kind, self.owner_of = kind, owner_of
        self.objects: dict[ObjKey, Obj] = {}
        self.by_owner: dict[ObjKey, set[str]] = {}
        self.lock = threading.Lock()

    def _put(self, key: ObjKey, obj: Obj | None) -> set[ObjKey]:
        """Set or remove one object (lock held); return the owners touched."""
        old = self.objects.pop(key, None)
        owners = set()
        if old is not None and (o := self.owner_of(old)):
            owners.add((key[0], o))
            self.by_owner.get((key[0], o), set()).discard(key[1])
        if obj is not None:
            self.objects[key] = obj
            if o := self.owner_of(obj):
                owners.add((key[0], o))
                self.by_owner.setdefault((key[0], o), set()).add(key[1])
        return owners

    def apply_event(self, type_: str, obj: Obj) -> set[ObjKey]:
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        with self.lock:
            if key not in self.objects and type_ == "DELETED":
                return set()
            if not newer(obj, self.objects.get(key)):
                return set()  # older than what we hold (a late event, or the end of an earlier incarnation)
            return self._put(key, None if type_ == "DELETED" else obj)

    def observe(self, obj: Obj) -> None:
        """Read-your-writes: the answer to our own write, unless the watch already brought something newer."""
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        with self.lock:
            if newer(obj, self.objects.get(key)):
                self._put(key, obj)

    def replace(self, namespace: str | None, objs: Iterable[Obj], list_rv: str | None) -> set[ObjKey]:
        """A fresh LIST of `namespace` (None: every namespace): drop what it lacks, take what changed.

        An object we wrote after the list's snapshot (a higher resourceVersion than the list's) is kept.
        Returns the owners of everything added, changed or dropped."""
        fresh = {(o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objs}
        snapshot = {"metadata": {"resourceVersion": list_rv}}
        touched: set[ObjKey] = set()
        with self.lock:
            for key in [k for k in self.objects if namespace is None or k[0] == namespace]:
                if key not in fresh and newer(snapshot, self.objects[key]):
                    touched |= self._put(key, None)
            for key, obj in fresh.items():
                old = self.objects.get(key)
                if old is None or (_rv(obj) != _rv(old) and newer(obj, old)):
                    touched |= self._put(key, obj)
        return touched

    def get(self, namespace: str, name: str) -> Obj | None:
        with self.lock:
            return self.objects.get((namespace, name))

    def owned(self, namespace: str, owner: str) -> list[Obj]:
        with self.lock:
            return [self.objects[(namespace, n)] for n in sorted(self.by_owner.get((namespace, owner), ()))]

    def keys(self) -> list[ObjKey]:
        with self.lock:
            return list(self.objects)

    def __len__(self) -> int:
        return len(self.objects)


class Informer:
    """LIST + WATCH of one kind in one namespace (or every namespace), feeding a Store."""

    def __init__(self, kube: Kube, api_version: str, kind: str, namespace: str | None, store: Store,
                 kick: Kick, label_selector: str | None, page: int = 500) -> None:
        self.kube, self.api_version, self.kind, self.namespace = kube, api_version, kind, namespace
        self.store, self.kick, self.selector, self.page = store, kick, label_selector, page
        self.path = collection(api_version, kind, namespace) if namespace else _cluster_collection(api_version, kind)
        self.synced = asyncio.Event()
        self.lists = 0  # LISTs made (1 at start, +1 per watch that could not resume)

    def _touch(self, owners: set[ObjKey]) -> None:
        for ns, name in owners:
            self.kick(ns, name, self.kind)

    async def _list(self, session: aiohttp.ClientSession) -> str:
        items: list[Obj] = []
        params: dict[str, str] = {"limit": str(self.page)}
        if self.selector:
            params["labelSelector"] = self.selector
        while True:
            body = await self.kube.aio_get(session, self.path, params)
            items += [slim(o, self.api_version, self.kind) for o in body.get("items", [])]
            cont = body.get("metadata", {}).get("continue")
            if not cont:
                break
            params["continue"] = cont
        rv = body["metadata"]["resourceVersion"]
        self._touch(self.store.replace(self.namespace, items, rv))
        self.lists += 1
        if self.lists > 1:
            log.info("relisted %s %s: %d objects at resourceVersion %s", self.kind, self.namespace or "(all namespaces)",
                     len(items), rv)
        return rv

    async def _watch(self, session: aiohttp.ClientSession, rv: str) -> str:
        """Stream events from `rv`; return the last resourceVersion seen. Raises _Expired on 410."""
        params = {"watch": "true", "allowWatchBookmarks": "true", "resourceVersion": rv, "timeoutSeconds": "300"}
        if self.selector:
            params["labelSelector"] = self.selector
        async with self.kube.aio_stream(session, self.path, params, timeout=310) as resp:
            async for line in resp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                type_, obj = event.get("type"), event.get("object") or {}
                if type_ == "ERROR":
                    raise _Expired(obj.get("message", "")) if obj.get("code") == 410 else RuntimeError(f"watch error: {obj}")
                rv = obj.get("metadata", {}).get("resourceVersion") or rv
                if type_ in ("ADDED", "MODIFIED", "DELETED"):
                    self._touch(self.store.apply_event(type_, slim(obj, self.api_version, self.kind)))
        return rv

    async def run(self) -> None:
        """Forever: list, then watch; a watch that ends on the server's timeout resumes where it left
        off, and one that breaks for any other reason (API server down, 410 Gone) is followed by a fresh
        LIST, so whatever the break hid is seen."""
        delay = 0.5
        rv: str | None = None
        async with self.kube.aio_session() as session:
            while True:
                try:
                    if rv is None:
                        rv = await self._list(session)
                        self.synced.set()
                    rv = await self._watch(session, rv)
                    delay = 0.5
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - refused, reset, timed out, expired: relist
                    rv = None
                    if not isinstance(exc, _Expired):
                        log.warning("watch %s %s: %s (relist in %.1fs)", self.kind, self.namespace or "(all namespaces)",
                                    f"{type(exc).__name__}: {exc}"[:300], delay)
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 4)


class _Expired(Exception):
    pass


def _cluster_collection(api_version: str, kind: str) -> str:
    return collection(api_version, kind, "_").replace("/namespaces/_", "")


def _owner_label(obj: Obj) -> str | None:
    return (obj.get("metadata", {}).get("labels") or {}).get(render.OWNER_LABEL)


def _self(obj: Obj) -> str | None:
    return obj.get("metadata", {}).get("name")


class Cache:
    """The stores of every kind the reconcile reads, the informers that fill them, and the reads and
    writes of a reconcile served through them (`CachedKube`)."""

    def __init__(self, kube: Kube, namespaces: list[str] | None, kick: Kick) -> None:
        self.kube = kube
        self.stores: dict[tuple[str, str], Store] = {}  # (collection base, plural) -> store
        self.by_kind: dict[str, Store] = {}
        self.informers: list[Informer] = []
        for api_version, kind in KINDS:
            is_cr = kind == crd.KIND
            store = Store(kind, _self if is_cr else _owner_label)
            m = _PATH.match(collection(api_version, kind, "_"))
            assert m
            self.stores[(m["base"], m["plural"])] = store
            self.by_kind[kind] = store
            selector = None if is_cr else render.OWNER_LABEL  # only objects labelled as ours
            scopes: list[str | None] = [*namespaces] if namespaces else [None]
            for ns in scopes:
                self.informers.append(Informer(kube, api_version, kind, ns, store, kick, selector))

    async def wait_synced(self) -> None:
        await asyncio.gather(*(i.synced.wait() for i in self.informers))

    def store_for(self, path: str) -> tuple[Store, str, str | None] | None:
        m = _PATH.match(path.split("?", 1)[0])
        if not m:
            return None
        store = self.stores.get((m["base"], m["plural"]))
        return (store, m["ns"], m["name"]) if store is not None else None

    def serves(self) -> list[ObjKey]:
        return self.by_kind[crd.KIND].keys()


def _matches(obj: Obj, selector: str) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class CachedKube(Kube):
    """The reconcile's Kube: GETs and LISTs of cached kinds come from the stores (no request); writes go
    to the API server and their answers into the stores. Anything else goes to the API server."""

    def __init__(self, kube: Kube, cache: Cache) -> None:
        super().__init__(kube.api, kube.timeout)
        self.inner, self.cache = kube, cache
        self.status_writes: dict[str, float] = {}  # path -> monotonic time of our last status write

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
                content_type: str = "application/json") -> Any:
        return self.inner.request(method, path, body, query=query, content_type=content_type)

    def get(self, path: str) -> Obj | None:
        hit = self.cache.store_for(path)
        if hit is None or hit[2] is None:
            return super().get(path)
        store, ns, name = hit
        return store.get(ns, name) if name is not None else None

    def list(self, path: str, label_selector: str) -> list[Obj]:
        hit = self.cache.store_for(path)
        if hit is None or hit[2] is not None:
            return super().list(path, label_selector)
        store, ns, _ = hit
        key, _, value = label_selector.partition("=")
        if key == render.OWNER_LABEL and "," not in label_selector and store.owner_of is _owner_label:
            return store.owned(ns, value)
        with store.lock:
            return [o for (n, _), o in sorted(store.objects.items()) if n == ns and _matches(o, label_selector)]

    def apply(self, obj: Obj, *, dry_run: bool = False) -> Obj:
        out = super().apply(obj, dry_run=dry_run)
        if not dry_run:
            self._observe(out, obj["apiVersion"], obj["kind"])
        return out

    def replace_status(self, path: str, status: dict[str, Any], resource_version: str) -> Obj:
        out = super().replace_status(path, status, resource_version)
        self._observe(out, CR_API_VERSION, crd.KIND)
        now = time.monotonic()
        if len(self.status_writes) > 100_000:
            self.status_writes = {p: t for p, t in self.status_writes.items() if now - t < 60}
        self.status_writes[path] = now
        return out

    def status_written_within(self, path: str, seconds: float) -> bool:
        return time.monotonic() - self.status_writes.get(path, -1e9) < seconds

    def _observe(self, obj: Obj | None, api_version: str, kind: str) -> None:
        store = self.cache.by_kind.get(kind)
        if store is not None and obj and obj.get("metadata", {}).get("name"):
            store.observe(slim(obj, api_version, kind))
