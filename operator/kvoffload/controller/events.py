"""Kubernetes Events on a KVOffloadServe: the transitions a person looks for in `kubectl describe`.

Events are derived from what one reconcile changed (pure: `transitions`), never from the mere fact
that it ran: a no-op reconcile or a resync emits nothing, and a condition that stays put is told
once. A token bucket per operator caps the rate, so 1,000 resources changing at once cannot flood
the API server; an event the bucket refuses is dropped and counted (the conditions stay the truth).
Core v1 Events (the group `kubectl describe` lists and the RBAC grants: events, create only).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

from ..api.settings import Settings

log = logging.getLogger("kvoffload.events")

COMPONENT = "kvoffload-operator"
MAX_MESSAGE = 1024  # the API server's limit for an Event note is 1 kB


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def _by_type(conditions: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    return {c.get("type", ""): c for c in conditions or []}


def _moved(old: dict[str, Any] | None, new: dict[str, Any], *, message: bool = False) -> bool:
    """The condition changed status or reason (or, for refusals, what is refused)."""
    if old is None:
        return True
    fields = ("status", "reason", "message") if message else ("status", "reason")
    return any(old.get(f) != new.get(f) for f in fields)


def transitions(previous: list[dict[str, Any]] | None, current: list[dict[str, Any]],
                applied: tuple[str, ...] | list[str] = ()) -> list[Event]:
    """Events for going from `previous` to `current` conditions, and for the children just applied."""
    before, after = _by_type(previous), _by_type(current)
    out: list[Event] = []

    def changed(type_: str, *, message: bool = False) -> dict[str, Any] | None:
        new = after.get(type_)
        return new if new is not None and _moved(before.get(type_), new, message=message) else None

    if (c := changed("ConfigValid", message=True)) is not None:
        if c["status"] == "False":
            out.append(Event("Warning", "SpecRefused", c.get("message", "")))
        elif c["status"] == "True" and before.get("ConfigValid", {}).get("status") == "False":
            out.append(Event("Normal", "SpecAccepted", c.get("message", "")))
    if applied:
        out.append(Event("Normal", "Applied", "applied " + ", ".join(applied)))
    if (c := changed("Scheduled")) is not None:
        if c["status"] == "False":
            out.append(Event("Warning", "Unschedulable", c.get("message", "")))
        elif c["status"] == "True" and c.get("reason") == "AllPodsScheduled":
            out.append(Event("Normal", "Scheduled", c.get("message", "")))
    if (c := changed("Ready")) is not None:
        if c["status"] == "True":
            out.append(Event("Normal", "Ready", c.get("message", "")))
        elif c.get("reason") == "PodsFailing":
            out.append(Event("Warning", "PodsFailing", c.get("message", "")))
    if (c := changed("OffloadActive")) is not None and c["status"] == "True":
        out.append(Event("Normal", "OffloadProven", c.get("message", "")))
    if (c := changed("EngineVerified")) is not None and c["status"] == "False":
        out.append(Event("Warning", "EngineVersionMismatch", c.get("message", "")))
    return out


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; `take` never blocks (reconciles run in threads)."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.stamp = float(burst), clock()
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= 1:
                self.tokens -= 1
                return True
            return False


def recorder(settings: Settings, post: Callable[[str, dict[str, Any]], Any]) -> Recorder:
    """The operator's one Recorder, its bucket from the settings (0 events per second: no Events)."""
    rate = settings.events_per_second
    return Recorder(post, TokenBucket(rate, settings.event_burst if rate > 0 else 0))


def event_body(owner: dict[str, Any], event: Event, now: datetime) -> dict[str, Any]:
    meta = owner["metadata"]
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": owner.get("apiVersion", ""), "kind": owner.get("kind", ""),
                           "name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
                           "resourceVersion": meta.get("resourceVersion", "")},
        "type": event.type, "reason": event.reason, "message": event.message[:MAX_MESSAGE],
        "source": {"component": COMPONENT, "host": os.environ.get("HOSTNAME", "")},
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


class Recorder:
    """Posts Events through `post(namespace, body)` while the operator-wide bucket allows."""

    def __init__(self, post: Callable[[str, dict[str, Any]], Any], bucket: TokenBucket | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.post, self.clock = post, clock
        self.bucket = bucket or TokenBucket(rate=5, burst=50)
        self.sent = self.dropped = 0

    def record(self, owner: dict[str, Any], events: list[Event]) -> None:
        for event in events:
            if not self.bucket.take():
                self.dropped += 1
                log.debug("event dropped (rate limit): %s %s", event.reason, owner["metadata"]["name"])
                continue
            try:
                self.post(owner["metadata"]["namespace"], event_body(owner, event, self.clock()))
                self.sent += 1
            except Exception as exc:  # an event is a courtesy: never fail a reconcile for one
                log.warning("event %s for %s not recorded: %s", event.reason, owner["metadata"]["name"], exc)
