"""Per-source health: error counting, `up`, and logging once per change of error state."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("kvoffload.exporter")


class SourceHealth:
    """What the exporter knows about one input (`vllm`, `lmcache` or `disk`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.errors = 0
        self.up = False
        self._reason: str | None = None  # None: last look succeeded (or no look yet)
        self._looked = False
        self._lock = threading.Lock()  # the disk source is updated from its own thread

    def ok(self) -> None:
        with self._lock:
            if self._reason is not None:
                log.info("source %s recovered", self.name)
            elif not self._looked:
                log.info("source %s is up", self.name)
            self._reason, self._looked, self.up = None, True, True

    def fail(self, reason: str) -> None:
        with self._lock:
            self.errors += 1
            self.up = False
            if reason != self._reason:
                log.warning("source %s failing: %s (logged once until the error changes)", self.name, reason)
            self._reason, self._looked = reason, True
