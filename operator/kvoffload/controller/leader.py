"""Leader election on a coordination.k8s.io/v1 Lease: with several replicas, only the holder reconciles.

The decision is pure (`should_hold`, `claimed`, `released`); the loop (`Elector.run`) reads the Lease,
decides, writes it with optimistic concurrency (create, or update at the resourceVersion it read) and
reports changes of leadership. A conflict means someone else wrote first: this replica does not lead.

Timing (client-go's shape): the Lease lasts 15 s, the leader renews every 5 s, followers look every 2 s.
A leader that cannot renew for 10 s (API down) stops reconciling before anyone may take over (15 s),
so two replicas never act at once, provided the replicas' clocks agree to within a few seconds (renewTime
is written by one replica and judged by another, as with every Lease-based election that reads it).

RBAC: leases (coordination.k8s.io) get, create, update in the Lease's namespace.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from .kube import ApiError, Kube

log = logging.getLogger("kvoffload.leader")

DEFAULT_LEASE_NAME = "kvoffload-operator"
_SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True)
class LeaseConfig:
    namespace: str
    name: str
    identity: str
    lease_seconds: int = 15
    renew_seconds: float = 5.0
    retry_seconds: float = 2.0
    renew_deadline: float = 10.0  # < lease_seconds: step down before others may take over

    @property
    def path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/{self.name}"


def default_identity() -> str:
    """Pod name (the hostname in a pod), pid and a random suffix: unique even for two processes on one host."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def default_namespace(watched: list[str]) -> str:
    """The pod's own namespace in a cluster; else the one watched namespace; else `default`."""
    try:
        with open(_SA_NAMESPACE, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return watched[0] if len(watched) == 1 else "default"


def lease_config(namespace: str | None, name: str | None, watched: list[str], identity: str) -> LeaseConfig:
    """The Lease `kvoffload run --leader-election` holds: the namespace and name given, else the defaults."""
    return LeaseConfig(namespace=namespace or default_namespace(watched), name=name or DEFAULT_LEASE_NAME,
                       identity=identity)


# ---------------------------------------------------------------------------- pure decisions
def format_time(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # MicroTime


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def expires_at(lease: dict[str, Any]) -> datetime | None:
    spec = lease.get("spec") or {}
    renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
    if renewed is None:
        return None
    return renewed + timedelta(seconds=spec.get("leaseDurationSeconds") or 0)


def should_hold(lease: dict[str, Any] | None, me: str, now: datetime) -> bool:
    """May `me` hold (take or renew) the Lease now? Absent, unheld, ours, or expired: yes."""
    if lease is None:
        return True
    holder = (lease.get("spec") or {}).get("holderIdentity") or ""
    if holder in ("", me):
        return True
    expiry = expires_at(lease)
    return expiry is None or now >= expiry


def claimed(lease: dict[str, Any] | None, cfg: LeaseConfig, now: datetime) -> dict[str, Any]:
    """The Lease as `cfg.identity` writes it to take or renew it (resourceVersion kept: the write is conditional)."""
    old_meta = (lease or {}).get("metadata") or {}
    old = (lease or {}).get("spec") or {}
    taking = old.get("holderIdentity") != cfg.identity
    stamp = format_time(now)
    meta: dict[str, Any] = {"name": cfg.name, "namespace": cfg.namespace}
    if old_meta.get("resourceVersion"):
        meta["resourceVersion"] = old_meta["resourceVersion"]
    return {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
        "spec": {
            "holderIdentity": cfg.identity,
            "leaseDurationSeconds": cfg.lease_seconds,
            "acquireTime": stamp if taking or not old.get("acquireTime") else old["acquireTime"],
            "renewTime": stamp,
            "leaseTransitions": (old.get("leaseTransitions") or 0) + (1 if taking and lease is not None else 0),
        },
    }


def released(lease: dict[str, Any], now: datetime) -> dict[str, Any]:
    """The Lease given up on shutdown: no holder, so a follower takes it at its next look."""
    out = {**lease, "spec": {**(lease.get("spec") or {})}}
    out["spec"].update(holderIdentity="", leaseDurationSeconds=1, renewTime=format_time(now))
    return out


# ---------------------------------------------------------------------------- the loop
def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Elector:
    """Keeps trying to hold the Lease; calls on_change(True/False) when leadership changes."""

    def __init__(self, kube: Kube, cfg: LeaseConfig, on_change: Callable[[bool], None],
                 clock: Callable[[], datetime] = _utcnow) -> None:
        self.kube, self.cfg, self.on_change, self.clock = kube, cfg, on_change, clock
        self.leading = False
        self.stopped = False
        self.last_renew = float("-inf")  # time.monotonic() of the last successful write
        self._round = asyncio.Lock()

    def try_hold(self) -> bool:
        """One round: read, decide, write. True if this replica holds the Lease now (blocking I/O)."""
        lease = self.kube.get(self.cfg.path)
        now = self.clock()
        if not should_hold(lease, self.cfg.identity, now):
            return False
        body = claimed(lease, self.cfg, now)
        try:
            if lease is None:
                self.kube.request("POST", self.cfg.path.rsplit("/", 1)[0], body)
            else:
                self.kube.request("PUT", self.cfg.path, body)
        except ApiError as exc:
            if exc.status == 409:  # another replica wrote first
                return False
            raise
        return True

    def _set(self, leading: bool) -> None:
        if leading != self.leading:
            self.leading = leading
            log.info("%s Lease %s/%s as %s", "acquired" if leading else "lost", self.cfg.namespace, self.cfg.name,
                     self.cfg.identity)
            self.on_change(leading)

    async def run(self) -> None:
        log.info("leader election on Lease %s/%s as %s", self.cfg.namespace, self.cfg.name, self.cfg.identity)
        while not self.stopped:
            async with self._round:  # release() waits for a round in flight, so none renews after it
                if self.stopped:
                    return
                try:
                    held: bool | None = await asyncio.to_thread(self.try_hold)
                except Exception as exc:  # API down: keep leading only until the renew deadline
                    log.warning("Lease %s/%s: %s", self.cfg.namespace, self.cfg.name, exc)
                    held = None
                    if self.leading and time.monotonic() - self.last_renew > self.cfg.renew_deadline:
                        self._set(False)
                if held is not None:
                    if held:
                        self.last_renew = time.monotonic()
                    self._set(held)
            await asyncio.sleep(self.cfg.renew_seconds if held else self.cfg.retry_seconds)

    async def release(self) -> None:
        """Stop, and give the Lease up (on shutdown) so a follower need not wait for it to expire."""
        self.stopped = True
        async with self._round:
            if not self.leading:
                return
            self._set(False)
            try:
                await asyncio.to_thread(self._give_up)
                log.info("released Lease %s/%s on shutdown", self.cfg.namespace, self.cfg.name)
            except Exception as exc:  # it expires on its own
                log.warning("releasing Lease %s/%s: %s", self.cfg.namespace, self.cfg.name, exc)

    def _give_up(self) -> None:
        lease = self.kube.get(self.cfg.path)
        if lease and (lease.get("spec") or {}).get("holderIdentity") == self.cfg.identity:
            self.kube.request("PUT", self.cfg.path, released(lease, self.clock()))
