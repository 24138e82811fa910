"""The node janitor: `kvoffload clean-disk` over and over, with metrics of what it reclaimed.

One sweep reads the live KVOffloadServes (a failure to read them skips the sweep: an unreadable
live set never reads as "nothing is live"), cleans every root with disk_cleaner.clean, and
rewrites the state file (unless dry-run). `loop` repeats sweeps every `interval` seconds and
counts bytes and directories reclaimed (or, in dry-run mode, the bytes it would reclaim) in a
prometheus_client registry that the chart's DaemonSet serves on the pod IP.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from ..api.errors import ConfigError
from .disk_cleaner import Key, Report, clean, load_state, next_state

log = logging.getLogger("kvoffload.janitor")
LiveFn = Callable[[], Mapping[Key, str]]


@dataclass(frozen=True)
class SweepConfig:
    roots: tuple[str, ...]
    state: str | None = None
    unknown_policy: str = "Retain"
    min_age: float = 600.0
    dry_run: bool = False


def read_state(path: str | None) -> dict[Key, str]:
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError("--state", f"cannot read {path} as JSON: {exc}") from None
    return load_state(data)


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


def sweep(cfg: SweepConfig, live: Mapping[Key, str]) -> list[Report]:
    """Clean every root once against `live`; remember policies in the state file (not in dry-run)."""
    remembered = read_state(cfg.state)
    reports = [clean(root, live, remembered=remembered, unknown_policy=cfg.unknown_policy, dry_run=cfg.dry_run,
                     min_age=cfg.min_age) for root in cfg.roots]
    if cfg.state and not cfg.dry_run:
        write_state(cfg.state, next_state(remembered, live, set().union(*(r.present for r in reports))))
    return reports


class JanitorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reclaimed = Counter("kvoffload_janitor_reclaimed_bytes", "Bytes of regular files removed from disk-tier roots",
                                 ["root"], registry=r)
        self.removed = Counter("kvoffload_janitor_removed_directories", "Pod directories of deleted KVOffloadServes removed",
                               ["root"], registry=r)
        self.reclaimable = Gauge("kvoffload_janitor_reclaimable_bytes",
                                 "Bytes the last dry-run sweep would have removed (0 when not in dry-run)", ["root"], registry=r)
        self.errors = Counter("kvoffload_janitor_errors", "Entries the janitor could not remove or enter", ["root"], registry=r)
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


def loop(cfg: SweepConfig, live_fn: LiveFn, metrics: JanitorMetrics, interval: float, stop: threading.Event,
         on_sweep: Callable[[list[Report]], object] = lambda _reports: None) -> None:
    """Sweep every `interval` seconds until `stop` is set. A sweep that fails (API down, root missing) is
    counted and retried at the next interval; it never removes anything."""
    while not stop.is_set():
        try:
            reports = sweep(cfg, live_fn())
        except Exception as exc:  # noqa: BLE001 - keep the DaemonSet running; the metric and the log say why
            log.warning("sweep failed, nothing removed: %s", exc)
            metrics.sweeps.labels("failed").inc()
        else:
            metrics.record(reports, cfg.dry_run)
            on_sweep(reports)
        stop.wait(interval)
