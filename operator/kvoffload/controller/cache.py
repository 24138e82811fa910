"""The caches the reconcile reads: KVOffloadServes, their children and pods, in memory, fed by kopf.

kopf watches every kind (handlers.py: one LIST, then a WATCH from its resourceVersion, reconnects,
server and client timeouts, a fresh LIST after 410 Gone). For every object kopf sees, its index
handler calls `Cache.put` (store it, kick the owning KVOffloadServe) and its event handler
`Cache.event` (deletions, relists). kopf holds every event handler until each kind has been listed
and every listed object indexed, so the first event handler call means the caches are filled; the
Runtime starts reconciling then.

Why a Store of our own and not kopf's index values: a kopf index (1) keeps an object that a fresh
LIST no longer lists (kopf replays the LIST as events; nothing tells an index what it lacked), and
(2) cannot take the answer to our own write. So:
- After a relist (objects listed again once the caches were filled), every object of that kind and
  scope that the relist did not touch within RELIST_SETTLE seconds of its last listed object is
  dropped and its owner kicked: a DELETE the broken watch never delivered cannot drive a decision.
- Objects are never mutated in place: the store holds each version as received, and a version
  older than the one held (by resourceVersion) never replaces it, so the result of our own write
  (`observe`, read-your-writes) is not undone by a late watch event of the version before it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..api import crd
from ..rendering import render
from .kube import Kube, collection

log = logging.getLogger("kvoffload.cache")

Obj = dict[str, Any]
ObjKey = tuple[str, str]  # (namespace, name)
Kick = Callable[[str, str, str], None]  # (namespace, owner name, kind)

CR_API_VERSION = f"{crd.GROUP}/{crd.VERSION}"
Kinds = tuple[tuple[str, str], ...]  # (apiVersion, kind) pairs


def kinds(child_kinds: Kinds = render.CHILD_KINDS) -> Kinds:
    """What the reconcile reads: its KVOffloadServe, the child kinds and the pods."""
    return ((CR_API_VERSION, crd.KIND), *child_kinds, ("v1", "Pod"))


KINDS = kinds()
RELIST_SETTLE = 2.0  # seconds after a relist's last object before what it did not list is dropped

_PATH = re.compile(r"^(?P<base>/api/v1|/apis/[^/]+/[^/]+)/namespaces/(?P<ns>[^/]+)"
                   r"/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?$")


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


# What the cache keeps of an object of a child kind that is not labelled as any KVOffloadServe's: enough to say who
# holds its name (reconcile's NameConflict check), nothing of its content.
HOLDER_FIELDS = ("name", "namespace", "uid", "resourceVersion", "ownerReferences")


def slim(obj: Obj, api_version: str, kind: str) -> Obj:
    """What the cache keeps of an object: no managedFields (a third of a child's bytes, never read);
    of a pod, only its metadata, spec.nodeName and status (its spec is the StatefulSet's template);
    of another owner's object of a child kind (no owner label), only who holds its name (HOLDER_FIELDS)."""
    meta = {k: v for k, v in obj.get("metadata", {}).items() if k != "managedFields"}
    if kind not in (crd.KIND, "Pod") and render.OWNER_LABEL not in (meta.get("labels") or {}):
        return {"apiVersion": api_version, "kind": kind, "metadata": {k: meta[k] for k in HOLDER_FIELDS if k in meta}}
    out = {**obj, "apiVersion": api_version, "kind": kind, "metadata": meta}
    if kind == "Pod":
        out["spec"] = {"nodeName": (obj.get("spec") or {}).get("nodeName")}
    return out


class Store:
    """The objects of one kind, by (namespace, name), with an index by owner label. Thread-safe:
    kopf's handlers write on the event loop, reconciles read from worker threads."""

    def __init__(self, kind: str, owner_of: Callable[[Obj], str | None]) -> None:
        self.kind, self.owner_of = kind, owner_of
        self.objects: dict[ObjKey, Obj] = {}
        self.by_owner: dict[ObjKey, set[str]] = {}
        self.touched: dict[ObjKey, int] = {}  # key -> when (a tick of _TICKS) it was last stored or listed
        self.lock = threading.Lock()

    def _put(self, key: ObjKey, obj: Obj | None) -> set[ObjKey]:
        """Set or remove one object (lock held); return the owners touched."""
        old = self.objects.pop(key, None)
        owners = set()
        if old is not None and (o := self.owner_of(old)):
            owners.add((key[0], o))
            self.by_owner.get((key[0], o), set()).discard(key[1])
        self.touched.pop(key, None)
        if obj is not None:
            self.objects[key] = obj
            self.touched[key] = next(_TICKS)
            if o := self.owner_of(obj):
                owners.add((key[0], o))
                self.by_owner.setdefault((key[0], o), set()).add(key[1])
        return owners

    def apply_event(self, type_: str, obj: Obj) -> set[ObjKey]:
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        with self.lock:
            if key not in self.objects and type_ == "DELETED":
                return set()
            old = self.objects.get(key)
            if not newer(obj, old):
                return set()  # older than what we hold (a late event, or the end of an earlier incarnation)
            if old is not None and type_ != "DELETED" and _rv(obj) is not None and _rv(obj) == _rv(old):
                self.touched[key] = next(_TICKS)  # the same version again (a relist): nothing moved
                return set()
            return self._put(key, None if type_ == "DELETED" else obj)

    def observe(self, obj: Obj) -> None:
        """Read-your-writes: the answer to our own write, unless the watch already brought something newer."""
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        with self.lock:
            if newer(obj, self.objects.get(key)):
                self._put(key, obj)

    def touch(self, key: ObjKey) -> None:
        """The object was listed again (a relist): it still exists."""
        with self.lock:
            if key in self.objects:
                self.touched[key] = next(_TICKS)

    def drop_untouched(self, namespace: str | None, since: int) -> set[ObjKey]:
        """After a relist of `namespace` (None: every namespace) that began at tick `since`: drop what it
        did not list and nobody stored since. Returns the owners of what was dropped."""
        touched: set[ObjKey] = set()
        with self.lock:
            for key in [k for k, t in self.touched.items() if t < since and (namespace is None or k[0] == namespace)]:
                touched |= self._put(key, None)
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


_TICKS = itertools.count(1)


def now_tick() -> int:
    return next(_TICKS)


def _owner_label(obj: Obj) -> str | None:
    return (obj.get("metadata", {}).get("labels") or {}).get(render.OWNER_LABEL)


def _self(obj: Obj) -> str | None:
    return obj.get("metadata", {}).get("name")


@dataclass
class _Relist:
    since: int  # the tick it began at
    objects: int = 0
    timer: asyncio.TimerHandle | None = None


class Cache:
    """The stores of every kind the reconcile reads, fed by kopf's handlers (`put`, `event`)."""

    def __init__(self, namespaces: list[str] | None, kick: Kick, settle: float = RELIST_SETTLE,
                 child_kinds: Kinds = render.CHILD_KINDS) -> None:
        self.namespaces, self.kick, self.settle = namespaces, kick, settle
        self.stores: dict[tuple[str, str], Store] = {}  # (collection base, plural) -> store
        self.by_kind: dict[str, Store] = {}
        for api_version, kind in kinds(child_kinds):
            store = Store(kind, _self if kind == crd.KIND else _owner_label)
            m = _PATH.match(collection(api_version, kind, "_"))
            assert m
            self.stores[(m["base"], m["plural"])] = store
            self.by_kind[kind] = store
        self.filled = False  # kopf released its first event handler: every kind was listed and stored
        # Objects stored before that whose event handler has not run yet: their "listed" event is the
        # initial LIST's, released by kopf only now, not a relist.
        self.unreleased: set[tuple[str, str, str]] = set()
        self.relists: dict[tuple[str, str | None], _Relist] = {}
        self.dropped = 0  # objects a relist showed gone

    def _touch(self, kind: str, owners: set[ObjKey]) -> None:
        for ns, name in owners:
            self.kick(ns, name, kind)

    def put(self, api_version: str, kind: str, body: Obj) -> None:
        """kopf's index handler: an object as listed, added or modified."""
        obj = slim(body, api_version, kind)
        if not self.filled:
            self.unreleased.add((kind, obj["metadata"].get("namespace", ""), obj["metadata"]["name"]))
        self._touch(kind, self.by_kind[kind].apply_event("MODIFIED", obj))

    def event(self, api_version: str, kind: str, type_: str | None, body: Obj) -> bool:
        """kopf's event handler (after `put` for anything but a deletion). Returns True on the first call:
        the caches are filled."""
        first, self.filled = not self.filled, True
        meta = body.get("metadata", {})
        initial = (kind, meta.get("namespace", ""), meta.get("name", "")) in self.unreleased
        self.unreleased.discard((kind, meta.get("namespace", ""), meta.get("name", "")))
        if type_ == "DELETED":
            self._touch(kind, self.by_kind[kind].apply_event("DELETED", slim(body, api_version, kind)))
        elif type_ is None and not initial:  # listed again once the caches were filled: kopf relists this kind
            self._listed(kind, body)
        return first

    def _listed(self, kind: str, body: Obj) -> None:
        meta = body.get("metadata", {})
        namespace = None if self.namespaces is None else meta.get("namespace", "")
        relist = self.relists.get((kind, namespace))
        if relist is None:
            relist = self.relists[(kind, namespace)] = _Relist(since=now_tick())
        self.by_kind[kind].touch((meta.get("namespace", ""), meta.get("name", "")))
        relist.objects += 1
        if relist.timer is not None:
            relist.timer.cancel()
        relist.timer = asyncio.get_running_loop().call_later(self.settle, self.relisted, kind, namespace)

    def relisted(self, kind: str, namespace: str | None) -> None:
        """A relist is over: what it did not list is gone."""
        relist, store = self.relists.pop((kind, namespace)), self.by_kind[kind]
        before = len(store)
        owners = store.drop_untouched(namespace, relist.since)
        dropped = before - len(store)
        self.dropped += dropped
        log.info("relisted %s %s: %d objects, %d no longer listed were dropped", kind,
                 namespace or "(all namespaces)", relist.objects, dropped)
        self._touch(kind, owners)

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
