"""A STAND-IN for one vLLM replica's /metrics: a real vLLM capture (tests/fixtures, h200 runs) served as captured,
with the load-bearing series moved by the test: vllm:num_requests_waiting, vllm:kv_cache_usage_perc and the
vllm:request_queue_time_seconds histogram (observations arrive at `starts_per_second`, each having waited
`queue_seconds`). Every other line, and every label and bucket boundary, is the real engine's.

It replays a page, it does not model an engine: the test sets what a loaded replica would show.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

from .exporter import FakeVllm

_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})?\s+(?P<value>\S+)$')
_LE = re.compile(r'le="([^"]+)"')
QUEUE = "vllm:request_queue_time_seconds"


class VllmReplay:
    def __init__(self, capture: Path) -> None:
        self.lines = capture.read_text().splitlines()
        self.bounds = sorted({float(m.group(1).replace("+Inf", "inf")) for line in self.lines
                              if line.startswith(QUEUE + "_bucket") for m in [_LE.search(line)] if m})
        assert self.bounds and self.bounds[-1] == float("inf"), f"{capture}: no {QUEUE} histogram"
        self.waiting, self.kv_usage = 0.0, 0.0
        self.queue_seconds, self.starts_per_second = 0.0, 0.0
        self.buckets = dict.fromkeys(self.bounds, 0.0)
        self.count = self.sum = 0.0
        self.last = time.monotonic()
        self.lock = threading.Lock()
        self.server = FakeVllm(self._page())
        self.url = self.server.url
        self.target = self.url.split("//", 1)[1].split("/", 1)[0]
        self._stop = threading.Event()
        threading.Thread(target=self._refresh, daemon=True).start()

    def _observe(self) -> None:
        """Requests that started since the last call, each after queue_seconds in the queue (cumulative buckets)."""
        now = time.monotonic()
        n, self.last = self.starts_per_second * (now - self.last), now
        for le in self.bounds:
            if self.queue_seconds <= le:
                self.buckets[le] += n
        self.count += n
        self.sum += n * self.queue_seconds

    def _page(self) -> str:
        with self.lock:
            self._observe()
            out = []
            for line in self.lines:
                m = _LINE.match(line)
                if m is None:
                    out.append(line)
                    continue
                name, labels = m.group("name"), m.group("labels") or ""
                value = {"vllm:num_requests_waiting": self.waiting, "vllm:kv_cache_usage_perc": self.kv_usage,
                         QUEUE + "_count": self.count, QUEUE + "_sum": self.sum}.get(name)
                if name == QUEUE + "_bucket":
                    le = _LE.search(labels)
                    assert le is not None
                    value = self.buckets[float(le.group(1).replace("+Inf", "inf"))]
                out.append(line if value is None else f"{name}{labels} {value!r}")
            return "\n".join(out) + "\n"

    def _refresh(self) -> None:
        while not self._stop.wait(0.2):
            self.server.body = self._page()

    def close(self) -> None:
        self._stop.set()
        self.server.close()
