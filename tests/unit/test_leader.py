"""Leader election: the pure decision, the Lease bodies, one election round against a fake API, the Runtime gate."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from kvoffload.api.settings import Settings
from kvoffload.controller import leader, runtime
from kvoffload.controller.kube import ApiError
from kvtest.operator import drain

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
CFG = leader.LeaseConfig(namespace="ops", name="kvoffload-operator", identity="me")


def lease(holder: str | None, renewed_ago: float | None, duration: int | None = 15, **spec: Any) -> dict[str, Any]:
    s: dict[str, Any] = dict(spec)
    if holder is not None:
        s["holderIdentity"] = holder
    if renewed_ago is not None:
        s["renewTime"] = leader.format_time(NOW - timedelta(seconds=renewed_ago))
    if duration is not None:
        s["leaseDurationSeconds"] = duration
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "kvoffload-operator", "namespace": "ops", "resourceVersion": "42"}, "spec": s}


@pytest.mark.parametrize("current, expected", [
    (None, True),                                   # no Lease yet: create it
    (lease("me", 1), True),                         # ours: renew
    (lease("me", 100), True),                       # ours, even expired
    (lease("", 1), True),                           # released on shutdown
    (lease(None, 1), True),                         # never held
    (lease("other", 1), False),                     # held and fresh
    (lease("other", 14.9), False),                  # held, 0.1 s left
    (lease("other", 15), True),                     # expired exactly now
    (lease("other", 60), True),                     # long expired: take over
    (lease("other", -3), False),                    # renewTime a little in our future (clock skew): still held
    (lease("other", None), True),                   # no renewTime: nothing to honour
    (lease("other", 20, duration=30), False),       # the holder's own duration counts
    (lease("other", 1, duration=None), True),       # no duration: expires at renewTime
    ({"spec": {"holderIdentity": "other", "renewTime": "garbage", "leaseDurationSeconds": 15}}, True),
    ({"spec": {"holderIdentity": "other", "acquireTime": leader.format_time(NOW), "leaseDurationSeconds": 15}}, False),
])
def test_should_hold(current, expected):
    assert leader.should_hold(current, "me", NOW) is expected


def test_time_round_trip_is_microtime():
    text = leader.format_time(NOW + timedelta(microseconds=7))
    assert text == "2026-01-02T03:04:05.000007Z"
    assert leader.parse_time(text) == NOW + timedelta(microseconds=7)
    assert leader.parse_time("2026-01-02T03:04:05Z") == NOW
    assert leader.parse_time(None) is None and leader.parse_time("nope") is None


def test_claim_new_lease():
    body = leader.claimed(None, CFG, NOW)
    assert body["metadata"] == {"name": "kvoffload-operator", "namespace": "ops"}  # no resourceVersion: a create
    assert body["spec"] == {"holderIdentity": "me", "leaseDurationSeconds": 15, "acquireTime": leader.format_time(NOW),
                            "renewTime": leader.format_time(NOW), "leaseTransitions": 0}


def test_renew_keeps_acquire_time_and_transitions():
    old = lease("me", 5, acquireTime="2026-01-01T00:00:00.000000Z", leaseTransitions=3)
    body = leader.claimed(old, CFG, NOW)
    assert body["metadata"]["resourceVersion"] == "42"  # conditional update
    assert body["spec"]["acquireTime"] == "2026-01-01T00:00:00.000000Z"
    assert body["spec"]["renewTime"] == leader.format_time(NOW)
    assert body["spec"]["leaseTransitions"] == 3


def test_take_over_counts_a_transition():
    body = leader.claimed(lease("other", 60, acquireTime="2026-01-01T00:00:00.000000Z", leaseTransitions=3), CFG, NOW)
    assert body["spec"]["holderIdentity"] == "me"
    assert body["spec"]["acquireTime"] == leader.format_time(NOW)
    assert body["spec"]["leaseTransitions"] == 4


def test_released_lease_is_free_for_anyone():
    out = leader.released(lease("me", 1), NOW)
    assert out["spec"]["holderIdentity"] == "" and out["metadata"]["resourceVersion"] == "42"
    assert leader.should_hold(out, "someone-else", NOW)


def test_lease_config(monkeypatch):
    cfg = leader.lease_config("ops", "my-lease", ["a", "b"], "me")
    assert (cfg.namespace, cfg.name, cfg.identity) == ("ops", "my-lease", "me")
    assert cfg.path == "/apis/coordination.k8s.io/v1/namespaces/ops/leases/my-lease"
    assert cfg.renew_deadline < cfg.lease_seconds
    monkeypatch.setattr(leader, "_SA_NAMESPACE", "/nonexistent/namespace")  # not in a pod
    cfg = leader.lease_config(None, None, ["team"], "me")
    assert (cfg.namespace, cfg.name) == ("team", leader.DEFAULT_LEASE_NAME)
    assert leader.lease_config(None, None, [], "me").namespace == "default"
    assert leader.default_identity() != leader.default_identity()  # unique per process start


def test_default_namespace():
    assert leader.default_namespace(["team-a"]) in ("team-a", _pod_namespace())
    assert leader.default_namespace([]) in ("default", _pod_namespace())


def _pod_namespace() -> str | None:
    try:
        with open(leader._SA_NAMESPACE) as fh:
            return fh.read().strip()
    except OSError:
        return None


class FakeKube:
    """Just enough of Kube for one election round: a Lease store with resourceVersion checks."""

    def __init__(self, stored: dict[str, Any] | None = None, fail: Exception | None = None) -> None:
        self.stored, self.fail, self.calls = stored, fail, []

    def get(self, path: str) -> dict[str, Any] | None:
        self.calls.append(("GET", path))
        if self.fail:
            raise self.fail
        return self.stored

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.calls.append((method, path))
        if method == "POST" and self.stored is not None:
            raise ApiError(409, "Conflict", '{"message": "exists"}')
        if method == "PUT" and body["metadata"].get("resourceVersion") != self.stored["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", '{"message": "changed"}')
        self.stored = {**body, "metadata": {**body["metadata"], "resourceVersion": "43"}}
        return self.stored


def test_round_creates_renews_and_respects_a_holder():
    changes: list[bool] = []
    kube = FakeKube()
    el = leader.Elector(kube, CFG, changes.append, clock=lambda: NOW)
    assert el.try_hold() is True
    assert kube.calls[-1] == ("POST", "/apis/coordination.k8s.io/v1/namespaces/ops/leases")
    assert kube.stored["spec"]["holderIdentity"] == "me"
    assert el.try_hold() is True and kube.calls[-1][0] == "PUT"  # renew
    other = leader.Elector(kube, leader.LeaseConfig("ops", "kvoffload-operator", "other"), changes.append,
                           clock=lambda: NOW)
    assert other.try_hold() is False and kube.calls[-1][0] == "GET"  # held and fresh: no write at all


def test_round_loses_a_write_race():
    kube = FakeKube()
    el = leader.Elector(kube, CFG, lambda _: None, clock=lambda: NOW)
    kube.get = lambda path: None  # read says "absent", but another replica creates it first
    kube.stored = lease("other", 0)
    assert el.try_hold() is False


def test_release_hands_over_and_reports():
    changes: list[bool] = []
    kube = FakeKube(lease("me", 1))
    el = leader.Elector(kube, CFG, changes.append, clock=lambda: NOW)
    el._set(True)
    asyncio.run(el.release())
    assert changes == [True, False] and kube.stored["spec"]["holderIdentity"] == ""
    asyncio.run(el.release())  # not leading any more: no call
    assert kube.calls.count(("PUT", CFG.path)) == 1
    asyncio.run(asyncio.wait_for(el.run(), 1))  # stopped: the loop returns at once, takes nothing back
    assert kube.stored["spec"]["holderIdentity"] == "" and changes == [True, False]


def test_leader_steps_down_when_it_cannot_renew(monkeypatch):
    changes: list[bool] = []
    cfg = leader.LeaseConfig("ops", "l", "me", retry_seconds=0.01, renew_seconds=0.01, renew_deadline=0.05)
    kube = FakeKube()
    el = leader.Elector(kube, cfg, changes.append, clock=lambda: NOW)

    async def scenario() -> None:
        task = asyncio.create_task(el.run())
        while not el.leading:
            await asyncio.sleep(0.005)
        kube.fail = ConnectionError("apiserver down")
        while el.leading:
            await asyncio.sleep(0.005)
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 5))
    assert changes == [True, False]


def serve(name: str) -> dict[str, Any]:
    return {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe",
            "metadata": {"namespace": "ns", "name": name, "resourceVersion": "1"}}


def test_queue_ignores_kicks_while_following():
    seen: list[tuple[str, str]] = []

    def reconcile(kube, ns, name, settings):
        seen.append((ns, name))
        return "unchanged"

    async def scenario() -> None:
        q = runtime.Runtime(kube=None, settings=Settings(), reconcile=reconcile)
        q.leading = False
        q.kick("ns", "a")
        assert not q.queued and not q.running
        q.leading = True
        q.kick("ns", "b")
        await drain(q)

    asyncio.run(scenario())
    assert seen == [("ns", "b")]


def test_new_leader_catches_up_on_what_it_saw_while_following():
    seen: list[tuple[str, str]] = []

    async def scenario() -> None:
        rt = runtime.Runtime(kube=None, settings=Settings(), workers=1,
                             reconcile=lambda kube, ns, name, settings: seen.append((ns, name)) or "unchanged")
        rt.leading = False
        serves = rt.cache.by_kind["KVOffloadServe"]
        for name in ("b", "a", "gone"):
            serves.apply_event("ADDED", serve(name))  # what kopf stores while following
        serves.apply_event("DELETED", serve("gone"))
        assert not rt.queued
        rt._on_leadership(True)
        await drain(rt)

    asyncio.run(scenario())
    assert seen == [("ns", "a"), ("ns", "b")]
