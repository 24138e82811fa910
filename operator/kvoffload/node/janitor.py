"""The node janitor: `kvoffload clean-disk` over and over, with metrics of what it reclaimed.

Which incarnations are live, and the reclaimPolicy each one had when it was deleted, come from a watch on
KVOffloadServes (`Incarnations`): the DELETED event carries the object's final spec, so a policy changed just
before the deletion (Delete -> Retain, then deleted within one interval) is the one that counts, and it is
written to the state file at once, keyed by metadata.uid. A deletion the watch did not see (the janitor was
down, the watch expired) has no recorded policy: the unknown policy (Retain by default) keeps its files.
One sweep cleans every root with disk_cleaner.clean against that view; a view that is not in sync (the API
cannot be read) skips the sweep: an unreadable live set never reads as "nothing is live". `loop` repeats
sweeps every `interval` seconds and counts bytes and directories reclaimed (or, in dry-run mode, the bytes it
would reclaim) in a prometheus_client registry that the chart's DaemonSet serves on the pod IP.

The state file must lie where no tenant path reaches (outside every allowed root, clean_disk checks): a spec
path below a root could otherwise turn it into a directory and stop every sweep.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from ..api import crd
from ..api.errors import ConfigError
from .disk_cleaner import Key, Report, clean, dump_state, load_state, policy_of

log = logging.getLogger("kvoffload.janitor")


@dataclass(frozen=True)
class SweepConfig:
    roots: tuple[str, ...]
    state: str | None = None
    unknown_policy: str = "Retain"
    min_age: float = 600.0
    dry_run: bool = False


@dataclass(frozen=True)
class View:
    live: Mapping[Key, str | None]  # (namespace, name) -> uid of the live incarnation (None: not known)
    deleted: Mapping[str, str] = field(default_factory=dict)  # uid -> reclaimPolicy of its final spec


class Source(Protocol):
    def view(self) -> View: ...

    def swept(self, view: View, reports: list[Report]) -> None: ...


def _read_json(path: str | None) -> Any:
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError("--state", f"cannot read {path} as JSON: {exc}") from None


def read_state(path: str | None) -> dict[str, str]:
    """uid -> final reclaimPolicy, as the watching janitor recorded them."""
    data = _read_json(path)
    return load_state(data) if data is not None else {}


def write_state(path: str, state: dict[str, Any]) -> None:
    """Atomically: a crash mid-write leaves the old state, never half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".kvoffload-cleaner-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(state, fh, indent=1, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def sweep(cfg: SweepConfig, view: View) -> list[Report]:
    """Clean every root once against `view`."""
    return [clean(root, view.live, deleted=view.deleted, unknown_policy=cfg.unknown_policy, dry_run=cfg.dry_run,
                  min_age=cfg.min_age) for root in cfg.roots]


@dataclass
class Listed:
    """A one-shot source: a live listing (from a file or the API) and the state file the watching janitor wrote."""
    list_fn: Callable[[], Mapping[Key, str | None]]
    state: str | None = None

    def view(self) -> View:
        return View(self.list_fn(), read_state(self.state))

    def swept(self, view: View, reports: list[Report]) -> None:
        pass  # only the watcher records and forgets policies


class Incarnations:
    """The watch's view of KVOffloadServes, shared by the watch thread and the sweeps."""

    def __init__(self, state: str | None, dry_run: bool = False) -> None:
        self._lock = threading.Lock()
        self._state, self._dry_run = state, dry_run
        data = _read_json(state)
        entries = (data or {}).get("deleted", {}) if isinstance(data, dict) else {}
        valid = load_state(data) if data is not None else {}
        self._deleted: dict[str, dict[str, str]] = {uid: dict(entries[uid]) for uid in valid}
        self._live: dict[str, Key] = {}
        self.synced = False

    def _persist(self) -> None:
        if self._state and not self._dry_run:
            write_state(self._state, dump_state(self._deleted))

    def relisted(self, items: list[dict[str, Any]]) -> None:
        """A fresh listing. Incarnations that vanished without a DELETED event get no recorded policy."""
        with self._lock:
            self._live = {}
            for item in items:
                meta = item.get("metadata") or {}
                if meta.get("uid"):
                    self._live[meta["uid"]] = (meta.get("namespace", ""), meta.get("name", ""))
            self.synced = True

    def event(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid = meta.get("uid")
        if not uid:
            return
        with self._lock:
            if kind in ("ADDED", "MODIFIED"):
                self._live[uid] = (meta.get("namespace", ""), meta.get("name", ""))
            elif kind == "DELETED":
                self._live.pop(uid, None)
                # The final spec decides, and is on disk before anything can act on it.
                self._deleted[uid] = {"namespace": meta.get("namespace", ""), "name": meta.get("name", ""),
                                      "reclaimPolicy": policy_of(obj)}
                self._persist()

    def lost(self) -> None:
        with self._lock:
            self.synced = False

    def view(self) -> View:
        with self._lock:
            if not self.synced:
                raise ConfigError("--in-cluster", f"the watch on {crd.PLURAL}.{crd.GROUP} is not in sync; "
                                                  "nothing was removed")
            return View({key: uid for uid, key in self._live.items()},
                        {uid: e["reclaimPolicy"] for uid, e in self._deleted.items()})

    def swept(self, view: View, reports: list[Report]) -> None:
        """Forget deleted incarnations that no marker on this node names any more (those the sweep saw)."""
        referenced = set().union(*(r.referenced for r in reports)) if reports else set()
        with self._lock:
            gone = [uid for uid in view.deleted if uid not in referenced and uid in self._deleted]
            for uid in gone:
                del self._deleted[uid]
            if gone:
                self._persist()


class JanitorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reclaimed = Counter("kvoffload_janitor_reclaimed_bytes",
                                 "Bytes of regular files removed from disk-tier roots",
                                 ["root"], registry=r)
        self.removed = Counter("kvoffload_janitor_removed_directories",
                               "Pod directories of deleted KVOffloadServes removed",
                               ["root"], registry=r)
        self.reclaimable = Gauge("kvoffload_janitor_reclaimable_bytes",
                                 "Bytes the last dry-run sweep would have removed (0 when not in dry-run)", ["root"],
                                 registry=r)
        self.errors = Counter("kvoffload_janitor_errors", "Entries the janitor could not remove or enter", ["root"],
                              registry=r)
        self.sweeps = Counter("kvoffload_janitor_sweeps", "Sweeps by result (failed: the live set could not be read)",
                              ["result"], registry=r)
        self.last_success = Gauge("kvoffload_janitor_last_success_timestamp_seconds", "When the last sweep finished",
                                  registry=r)
        self.dry_run = Gauge("kvoffload_janitor_dry_run", "1 when the janitor only reports", registry=r)
        for result in ("ok", "errors", "failed"):
            self.sweeps.labels(result)

    def record(self, reports: list[Report], dry_run: bool) -> None:
        self.dry_run.set(1 if dry_run else 0)
        for rep in reports:
            if dry_run:
                self.reclaimable.labels(rep.root).set(rep.bytes_freed)
            else:
                self.reclaimed.labels(rep.root).inc(rep.bytes_freed)
                self.removed.labels(rep.root).inc(sum(1 for r in rep.removed if r["complete"]))
                self.reclaimable.labels(rep.root).set(0)
            self.errors.labels(rep.root).inc(len(rep.errors))
        self.sweeps.labels("errors" if any(r.errors for r in reports) else "ok").inc()
        self.last_success.set_to_current_time()


def loop(cfg: SweepConfig, source: Source, metrics: JanitorMetrics, interval: float, stop: threading.Event,
         on_sweep: Callable[[list[Report]], object] = lambda _reports: None) -> None:
    """Sweep every `interval` seconds until `stop` is set. A sweep that fails (API down, watch not in sync,
    root missing) is counted and retried at the next interval; it never removes anything."""
    while not stop.is_set():
        try:
            view = source.view()
            reports = sweep(cfg, view)
            source.swept(view, reports)
        except Exception as exc:  # noqa: BLE001 - keep the DaemonSet running; the metric and the log say why
            log.warning("sweep failed, nothing removed: %s", exc)
            metrics.sweeps.labels("failed").inc()
        else:
            metrics.record(reports, cfg.dry_run)
            on_sweep(reports)
        stop.wait(interval)


def watch(store: Incarnations, stop: threading.Event, api: Any, timeout_seconds: int = 300) -> None:
    """Keep `store` in sync with the cluster's KVOffloadServes until `stop` (run it in a daemon thread).
    A watch that ends is resumed from its last resourceVersion, so no event is skipped; one that expired
    (410) or failed is relisted, and deletions in that gap are unknown (the unknown policy decides)."""
    from kubernetes import client
    from kubernetes import watch as kwatch

    objs = client.CustomObjectsApi(api)
    rv: str | None = None
    while not stop.is_set():
        try:
            if rv is None:
                listed: Any = objs.list_cluster_custom_object(crd.GROUP, crd.VERSION, crd.PLURAL)
                body: dict[str, Any] = listed
                store.relisted(body.get("items") or [])
                rv = body["metadata"]["resourceVersion"]
            stream = kwatch.Watch().stream(objs.list_cluster_custom_object, crd.GROUP, crd.VERSION, crd.PLURAL,
                                           resource_version=rv, timeout_seconds=timeout_seconds,
                                           allow_watch_bookmarks=True, _request_timeout=timeout_seconds + 30)
            for ev in stream:
                obj, kind = ev["object"], ev["type"]
                if kind == "ERROR":
                    raise client.ApiException(status=obj.get("code"), reason=obj.get("message"))
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                if kind != "BOOKMARK":
                    store.event(kind, obj)
                if stop.is_set():
                    return
        except Exception as exc:  # noqa: BLE001 - the watch must outlive any API trouble
            expired = isinstance(exc, client.ApiException) and exc.status == 410
            log.log(logging.INFO if expired else logging.WARNING, "watch on %s: %s; relisting", crd.PLURAL, exc)
            rv = None
            if not expired:
                store.lost()
                stop.wait(5)
