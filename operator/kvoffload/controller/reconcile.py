"""One idempotent, level-based reconcile of a KVOffloadServe: I/O at the two ends of the pure pipeline.

read CR -> desired (pure) -> apply what differs -> prune -> read children -> status (pure)
-> write if changed -> events for what changed (pure transitions, rate-limited).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..api import crd
from ..api.conditions import APPLY_REFUSED, NAME_CONFLICT
from ..api.errors import ConfigError
from ..api.rules import SHARED
from ..api.settings import Settings
from ..rendering import autoscaling, render, shared_cache
from ..rendering import routing as render_routing
from . import conditions, events, pipeline, probe
from .discovery import AutoscalingApis, Discovered
from .kube import ApiError, Kube, collection

log = logging.getLogger("kvoffload.reconcile")


def cr_path(namespace: str, name: str = "") -> str:
    base = f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{namespace}/{crd.PLURAL}"
    return f"{base}/{name}" if name else base


def covers(desired: Any, live: Any) -> bool:
    """True when every field we set has that value in the live object (others' fields and server defaults ignored)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(covers(v, live.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(covers(d, x) for d, x in zip(desired, live))
    return desired == live


class Covered:
    """The last positive `covers` per live child: (its rendered hash, its resourceVersion). A child whose
    desired hash and live version both stayed is covered without walking it again. Thread-safe enough for
    worker threads: one dict get and one set per check."""

    def __init__(self, size: int = 50_000) -> None:
        self.size = size
        self.seen: dict[str, tuple[str, str]] = {}

    def __call__(self, desired: dict[str, Any], live: dict[str, Any]) -> bool:
        meta = live["metadata"]
        uid, version = meta.get("uid", ""), meta.get("resourceVersion", "")
        want = desired["metadata"]["annotations"][pipeline.RENDERED_HASH_ANNOTATION]
        if uid and self.seen.get(uid) == (want, version):
            return True
        if not covers(desired, live):  # the hash annotation is part of `desired`: a removed field fails here
            return False
        if len(self.seen) > self.size:
            self.seen.clear()
        if uid:
            self.seen[uid] = (want, version)
        return True


@dataclass
class Memos:
    """What reconciles remember between runs (one per Runtime, passed to each reconcile): the desired
    state per spec, and which live children were already found covered."""
    desired: pipeline.DesiredCache = field(default_factory=pipeline.DesiredCache)
    covered: Covered = field(default_factory=Covered)


def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


def _live_children(kube: Kube, namespace: str, name: str,
                   kinds: tuple[tuple[str, str], ...]) -> dict[tuple[str, str, str], dict[str, Any]]:
    selector = f"{render.OWNER_LABEL}={name}"
    live = {}
    for api_version, kind in kinds:
        for obj in kube.list(collection(api_version, kind, namespace), selector):
            obj.setdefault("apiVersion", api_version)
            obj.setdefault("kind", kind)
            live[_key(obj)] = obj
    return live


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    refs = obj["metadata"].get("ownerReferences", []) or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)


class Refused(ConfigError):
    """A valid spec whose children the operator may not write (reason APPLY_REFUSED or NAME_CONFLICT). Nothing
    after the refused child is written; the Runtime retries with backoff, as the cause may go away (a quota
    raised, the other owner deleted)."""

    def __init__(self, reason: str, child: dict[str, Any], message: str) -> None:
        super().__init__(f"{child['kind']} {child['metadata']['name']}", message)
        self.reason = reason


def _refused(child: dict[str, Any], exc: ApiError) -> ConfigError:
    """The API server's refusal of a rendered child, whatever its code, as the condition that says why."""
    if exc.status in (400, 422):  # invalid: a pass-through spec field the CRD schema cannot check
        return ConfigError("spec", f"the API server refused the rendered {child['kind']}: {exc.message} "
                                   "(spec.scheduling and spec.engine.env are passed to the pod unchanged)")
    return Refused(APPLY_REFUSED, child, f"the API server refused to apply it ({exc.status} {exc.reason}): "
                                                   f"{exc.message[:1000]}")


def _holder(obj: dict[str, Any]) -> str:
    refs = obj["metadata"].get("ownerReferences") or []
    ref = next((r for r in refs if r.get("controller")), refs[0] if refs else None)
    if ref is None:
        return "no owner (created by someone else)"
    return f"{ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})"


def _check_names(kube: Kube, namespace: str, uid: str, changed: list[dict[str, Any]],
                 live: dict[tuple[str, str, str], dict[str, Any]]) -> None:
    """Never take over an object another owner holds: every child about to be written must be absent or
    controlled by this resource (uid). Names cannot be made collision-free (a resource `foo-pods` renders the
    Service that `foo` renders as its headless one), so the second comer is refused, before anything is written.
    An object of ours is in `live`; anything else is read with `kube.get`: the operator's cache watches the child
    kinds whole (handlers.tune), so that is no request there."""
    for child in changed:
        key = _key(child)
        current = live.get(key)
        if current is not None and _owned_by(current, uid):
            continue
        current = kube.get(f"{collection(key[0], key[1], namespace)}/{key[2]}")
        if current is not None and not _owned_by(current, uid):
            raise Refused(NAME_CONFLICT, child, f"{key[1]} {namespace}/{key[2]} already exists and is held by "
                                                           f"{_holder(current)}: kvoffload never takes over another "
                                                           "owner's object; rename this resource or remove that object")


def _unserved(child: dict[str, Any]) -> ConfigError:
    # Only KEDA's ScaledObject can be missing (render.child_kinds): its CRD comes with KEDA, and kopf watches
    # only the kinds served when the operator started (handlers.watch_optional_kinds).
    return ConfigError("spec.autoscaling", f"the operator's autoscaler is keda, but the API server served no "
                                           f"{child['apiVersion']} {child['kind']} when the operator started: install "
                                           "KEDA (its CRDs) and restart the operator, "
                                           "or set the operator's autoscaler to hpa")


def _to_validate(changed: list[dict[str, Any]], unchecked: bool) -> list[dict[str, Any]]:
    """All or nothing, at the price of a dry run only where the API server can refuse: the StatefulSet,
    when it carries spec fields the CRD schema does not check (`pipeline.unchecked`) and another
    changed child would be written before it. Everything else is rendered from checked fields."""
    return [c for i, c in enumerate(changed) if unchecked and c["kind"] == "StatefulSet" and i > 0]


def _dry_run(kube: Kube, children: list[dict[str, Any]]) -> None:
    """The API server validates these children before any child is written, so a pass-through field it
    refuses (tolerations, affinity, env valueFrom) is a ConfigValid=False, not a half-apply."""
    for child in children:
        try:
            kube.apply(child, dry_run=True)
        except ApiError as exc:
            raise _refused(child, exc) from None


def sync_children(kube: Kube, namespace: str, name: str, uid: str, children: list[dict[str, Any]],
                  unchecked: bool = True, covered: Covered | None = None,
                  kinds: tuple[tuple[str, str], ...] = render.CHILD_KINDS,
                  ) -> tuple[dict[str, Any] | None, list[str], dict[tuple[str, str, str], dict[str, Any]]]:
    """Apply children (each stamped with its rendered hash: `pipeline.stamped`) that differ from the
    cluster, prune ours that are no longer wanted; return the StatefulSet, what was applied ("Kind name")
    and the live objects of `kinds` with the owner label as read before (KEDA's HorizontalPodAutoscaler too)."""
    covered = covered or Covered()
    for child in children:
        if (child["apiVersion"], child["kind"]) not in kinds:
            raise _unserved(child)
    live = _live_children(kube, namespace, name, kinds)
    wanted = {_key(c) for c in children}
    changed = [c for c in children if _key(c) not in live or not covered(c, live[_key(c)])]
    _check_names(kube, namespace, uid, changed, live)
    _dry_run(kube, _to_validate(changed, unchecked))
    sts = live.get(("apps/v1", "StatefulSet", render.names(name)["statefulset"]))
    for child in changed:
        log.info("apply %s %s/%s", child["kind"], namespace, child["metadata"]["name"])
        try:
            current = kube.apply(child)
        except ApiError as exc:
            raise _refused(child, exc) from None  # a StatefulSet refused as invalid was validated above
        if child["kind"] == "StatefulSet":
            sts = current
    for key, obj in live.items():
        if key not in wanted and _owned_by(obj, uid):
            log.info("prune %s %s/%s", key[1], namespace, key[2])
            kube.delete(f"{collection(key[0], key[1], namespace)}/{key[2]}")
    return sts, [f"{c['kind']} {c['metadata']['name']}" for c in changed], live


# Progress details (Scheduled, replica counts, OffloadActive, messages) are written at most this often
# per resource, so a pod's way from Pending to Running is one status write, not four; what a reader
# waits for (the first status, Ready, ConfigValid, observedGeneration) is written at once.
STATUS_SPACING = 5.0
URGENT_CONDITIONS = ("Ready", "ConfigValid")


def urgent(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """The change from `old` to `new` status is one a reader waits for."""
    if old.get("observedGeneration") != new.get("observedGeneration") or not old.get("conditions"):
        return True
    before = {c["type"]: c.get("status") for c in old.get("conditions", [])}
    return any(before.get(c["type"]) != c["status"] for c in new["conditions"] if c["type"] in URGENT_CONDITIONS)


REFUSED = "status-refused"  # the outcome of a reconcile whose status write the API server refused
# The outcome of a reconcile that left a PerNode server without replicas in its grace period: the Runtime reconciles
# it again soon (SHARED_RECHECK_S), so the server goes when its grace ends, not at the next resync.
IDLE_SERVERS = "idle-servers"
SHARED_RECHECK_S = 15.0
CHILD_REFUSED = "child-refused"  # the outcome of a reconcile that wrote a Refused condition: retried with backoff


class StatusRefused(Exception):
    """The API server refused the status the operator computed (422 Invalid): readers see a stale status."""

    def __init__(self, exc: ApiError) -> None:
        super().__init__(exc.message)
        self.message = exc.message


def _write_status(kube: Kube, namespace: str, name: str, status: dict[str, Any],
                  resource_version: str) -> dict[str, Any] | None:
    """The object after the write, or None when it is gone or changed under us (the next event reconciles
    again). A refusal (422) is not the same: it raises StatusRefused."""
    try:
        return kube.replace_status(cr_path(namespace, name), status, resource_version)
    except ApiError as exc:
        if exc.status == 422 and exc.causes:  # the status broke the schema: the API server names the fields
            raise StatusRefused(exc) from None
        if exc.status in (404, 409, 422):  # gone, or changed under us (our resourceVersion test failed: 422, no causes)
            return None
        raise


def _refused_status(body: dict[str, Any], exc: StatusRefused, recorder: events.Recorder | None) -> str:
    log.error("status of %s/%s refused by the API server: %s", body["metadata"]["namespace"], body["metadata"]["name"],
              exc.message)
    if recorder is not None:
        recorder.record(body, [events.Event("Warning", "StatusRefused", "the API server refused "
                                                                        f"the status: {exc.message}")])
    return REFUSED


def reconcile(kube: Kube, namespace: str, name: str, settings: Settings, clock: datetime | None = None,
              recorder: events.Recorder | None = None, memos: Memos | None = None,
              child_kinds: tuple[tuple[str, str], ...] | None = None, discovered: Discovered | None = None) -> str:
    """Bring one KVOffloadServe's children and status in line with its spec. Returns a short outcome
    (REFUSED, with an error logged and a Warning Event, when the API server refused the status).
    `child_kinds`: the kinds the operator watches (default: every kind `settings` render). `discovered`: what the
    API server serves for autoscaling, as the Runtime last read it (AutoscalingReady)."""
    body = kube.get(cr_path(namespace, name))
    if body is None or body["metadata"].get("deletionTimestamp"):
        return "gone"  # children go through garbage collection (ownerReferences)
    try:
        return _reconcile(kube, body, settings, clock, recorder, memos or Memos(),
                          render.child_kinds(settings) if child_kinds is None else child_kinds,
                          discovered.apis if discovered else None)
    except StatusRefused as exc:
        return _refused_status(body, exc, recorder)


def _reconcile(kube: Kube, body: dict[str, Any], settings: Settings, clock: datetime | None,
               recorder: events.Recorder | None, memos: Memos, child_kinds: tuple[tuple[str, str], ...],
               apis: AutoscalingApis | None) -> str:
    outcome, desired = _reconcile_once(kube, body, settings, clock, recorder, memos, child_kinds, apis)
    if desired is not None and any(n.idle_since for n in desired.nodes) and outcome in ("unchanged", "updated"):
        return IDLE_SERVERS
    return outcome


def _wants_shared(body: dict[str, Any]) -> bool:
    """spec.offload.server PerNode as written (before parsing: what to read for it comes first)."""
    return ((body.get("spec") or {}).get("offload") or {}).get("server") == SHARED


def _shared_servers(kube: Kube, namespace: str, name: str, uid: str, pods: list[dict[str, Any]],
                    settings: Settings, clock: datetime | None) -> tuple[tuple[shared_cache.Node, ...], str]:
    """PerNode: the nodes that get a server (from the serving pods' nodes and the live servers' idle times, both from
    the operator's caches) and the ClusterIP of the resource's node-local Service ("" until it has one)."""
    deployments = kube.list(collection("apps/v1", "Deployment", namespace), f"{render.OWNER_LABEL}={name}")
    now = (clock or datetime.now(timezone.utc)).astimezone(timezone.utc).replace(tzinfo=None)
    wanted = shared_cache.nodes(shared_cache.serving_nodes(pods, render.serving_labels(render.Owner(name, namespace))),
                                shared_cache.live_servers([d for d in deployments if _owned_by(d, uid)]), now,
                                settings.shared_server_grace_seconds)
    svc = kube.get(f"{collection('v1', 'Service', namespace)}/{shared_cache.service_name(name)}")
    return wanted, _cluster_ip(svc, uid)


def _cluster_ip(svc: dict[str, Any] | None, uid: str) -> str:
    if svc is None or not _owned_by(svc, uid):
        return ""
    ip = (svc.get("spec") or {}).get("clusterIP") or ""
    return "" if ip == "None" else ip


def _create_service(kube: Kube, desired: pipeline.Desired, namespace: str, name: str, uid: str) -> str:
    """PerNode's Service applied ahead of the other children when it does not exist yet, so the StatefulSet is
    rendered with its ClusterIP from the first write (no cluster DNS needed). One that exists and is not ours is left
    alone: sync_children refuses it (NameConflict)."""
    svc_name = shared_cache.service_name(name)
    child = next(c for c in desired.applied if c["kind"] == "Service" and c["metadata"]["name"] == svc_name)
    if kube.get(f"{collection('v1', 'Service', namespace)}/{svc_name}") is not None:
        return ""
    log.info("apply Service %s/%s (the shared servers' address, first)", namespace, svc_name)
    try:
        return _cluster_ip(kube.apply(child), uid)
    except ApiError as exc:
        raise _refused(child, exc) from None


def _reconcile_once(kube: Kube, body: dict[str, Any], settings: Settings, clock: datetime | None,
                    recorder: events.Recorder | None, memos: Memos, child_kinds: tuple[tuple[str, str], ...],
                    apis: AutoscalingApis | None) -> tuple[str, pipeline.Desired | None]:
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    # No "working on it" status on first sight: the CRD's status default (observedGeneration 0) already makes kstatus
    # and Argo CD read a resource the operator has not written to as in progress (tests/unit/test_first_status.py).
    meta = body["metadata"]
    desired: pipeline.Desired | None = None
    error: ConfigError | None = None
    pods: list[dict[str, Any]] | None = None
    workers: tuple[str, ...] = ()
    if (body.get("spec") or {}).get("routing"):  # kv_aware's router is rendered with the Ready serving pods
        pods = kube.list(collection("v1", "Pod", namespace), f"{render.OWNER_LABEL}={name}")
        workers = render_routing.workers(pods, render.serving_labels(render.Owner(name, namespace, meta["uid"])))
    nodes: tuple[shared_cache.Node, ...] = ()
    address = ""
    if _wants_shared(body):
        if pods is None:
            pods = kube.list(collection("v1", "Pod", namespace), f"{render.OWNER_LABEL}={name}")
        nodes, address = _shared_servers(kube, namespace, name, meta["uid"], pods, settings, clock)
    try:
        desired = memos.desired.get(name, namespace, meta["uid"], body.get("spec") or {}, settings, workers, nodes,
                                    address)
        if desired.spec.offload.shared and not address:
            address = _create_service(kube, desired, namespace, name, meta["uid"])
            if address:
                desired = memos.desired.get(name, namespace, meta["uid"], body.get("spec") or {}, settings, workers,
                                            nodes, address)
    except ConfigError as exc:
        error = exc  # no child is created or changed while the spec is invalid
    applied: list[str] = []
    live: dict[tuple[str, str, str], dict[str, Any]] = {}
    sts, probes = None, None
    if desired is not None:
        try:
            sts, applied, live = sync_children(kube, namespace, name, meta["uid"], desired.applied,
                                               pipeline.unchecked(desired.spec), memos.covered, child_kinds)
        except ConfigError as exc:
            desired, error = None, exc
    if desired is None or not desired.spec.replicas:
        pods = []
    elif pods is None:
        pods = kube.list(collection("v1", "Pod", namespace), f"{render.OWNER_LABEL}={name}")
    if desired is not None:
        if settings.probe_exporters and desired.spec.metrics_enabled:
            probes = probe.probe_exporters(pods, desired.spec.metrics_port)
    hpa = (live.get((*autoscaling.HPA, autoscaling.name(name, settings)))
           if desired and desired.spec.autoscaling else None)
    router = (live.get(("apps/v1", "Deployment", render.names(name)["router"]))
              if desired and desired.spec.routing else None)
    servers = tuple(o for (_, kind, _), o in live.items() if kind == "Deployment" and
                    (o["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == shared_cache.COMPONENT)
    new_status = conditions.status(body, desired, error,
                                   conditions.Observed(sts, pods, probes, hpa, router, apis, servers), clock)
    previous = (body.get("status") or {}).get("conditions")
    if new_status == (body.get("status") or {}):
        if applied and recorder is not None:  # drift repaired: children changed, status did not
            recorder.record(body, events.transitions(previous, new_status["conditions"], applied))
        return (CHILD_REFUSED if isinstance(error, Refused) else "unchanged"), desired
    if not urgent(body.get("status") or {},
                  new_status) and kube.status_written_within(cr_path(namespace, name), STATUS_SPACING):
        return "deferred", desired  # the Runtime reconciles it again once the spacing has passed
    written = _write_status(kube, namespace, name, new_status, meta["resourceVersion"])
    if written is None:
        return "conflict", desired
    if recorder is not None:
        recorder.record(written, events.transitions(previous, new_status["conditions"], applied))
    if isinstance(error, Refused):
        return CHILD_REFUSED, desired
    return ("invalid" if error else "updated"), desired
