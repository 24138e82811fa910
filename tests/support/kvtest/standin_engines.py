"""Stand-in vLLM engines for a KVOffloadServe's pods: kwok runs no containers, so for each of its Running pods
one FakeVllm on 127.0.0.1 serves vLLM-shaped /metrics (vllm:num_requests_waiting, vllm:kv_cache_usage_perc,
vllm:prompt_tokens_by_source_total and the histogram vllm:request_queue_time_seconds with vLLM's own buckets) and
a file_sd target list tells a real Prometheus to scrape it with the labels the chart's PodMonitor gives
(namespace, pod, kvoffload_io_serve). The test drives the load: the total queue is spread evenly over the engines
that run, as a load balancer would; so is the queueing work: with `queue_seconds` Q and n engines, each engine
sees `REQUESTS_PER_TICK` requests a tick that waited Q/n s."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from .client import Client
from .exporter import FakeVllm

MODEL = 'engine="0",model_name="stand-in"'
# vllm:request_queue_time_seconds' buckets in vLLM 0.26.0 and 0.33.0 (tests/fixtures' captured pages).
QUEUE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                 960.0, 1920.0, 7680.0)
REQUESTS_PER_TICK = 4  # per engine and 0.5 s tick while queue_seconds > 0


class StandInEngines:
    def __init__(self, client: Client, namespace: str, name: str, targets: Path) -> None:
        self.client, self.namespace, self.name, self.targets = client, namespace, name, targets
        self.waiting = 0.0  # requests queued over all engines
        self.kv_usage = 0.1  # GPU KV-cache usage of each engine (0..1)
        self.queue_seconds = 0.0  # queueing work over all engines: each request waits queue_seconds / engines
        self._queued: dict[str, list[float]] = {}  # per engine: the histogram's bucket counts (+Inf last), its sum
        self.engines: dict[str, FakeVllm] = {}
        self.prompt_tokens = {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0}
        self._stop = threading.Event()
        self._write_targets()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def page(self, pod: str) -> str:
        n = max(1, len(self.engines))
        lines = ["# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{MODEL}}} {self.waiting / n}",
                 "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{MODEL}}} {self.kv_usage}",
                 "# TYPE vllm:prompt_tokens_by_source_total counter"]
        lines += [f'vllm:prompt_tokens_by_source_total{{{MODEL},source="{s}"}} {v}'
                  for s, v in self.prompt_tokens.items()]
        counts = self._counts(pod)
        lines.append("# TYPE vllm:request_queue_time_seconds histogram")
        lines += [f'vllm:request_queue_time_seconds_bucket{{{MODEL},le="{le}"}} {c}'
                  for le, c in zip([*map(str, QUEUE_BUCKETS), "+Inf"], counts)]
        lines += [f"vllm:request_queue_time_seconds_count{{{MODEL}}} {counts[-2]}",
                  f"vllm:request_queue_time_seconds_sum{{{MODEL}}} {counts[-1]}"]
        return "\n".join(lines) + "\n"

    def _counts(self, pod: str) -> list[float]:
        """`pod`'s queue-time histogram: a count per bucket, +Inf (the total count), then the sum."""
        return self._queued.setdefault(pod, [0.0] * (len(QUEUE_BUCKETS) + 2))

    def _observe(self) -> None:
        """One tick's requests on each engine, each having waited queue_seconds / engines."""
        if self.queue_seconds <= 0:
            return
        wait = self.queue_seconds / max(1, len(self.engines))
        for pod in self.engines:
            counts = self._counts(pod)
            for i, le in enumerate([*QUEUE_BUCKETS, float("inf")]):
                counts[i] += REQUESTS_PER_TICK if wait <= le else 0
            counts[-1] += REQUESTS_PER_TICK * wait

    def _running(self) -> set[str]:
        pods = self.client.list("pods", self.namespace, labels={"kvoffload.io/serve": self.name})
        return {p["metadata"]["name"] for p in pods
                if (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")}

    def sync(self) -> None:
        running = self._running()
        for pod in set(self.engines) - running:
            self.engines.pop(pod).close()
            self._queued.pop(pod, None)  # a pod that comes back is a new process: its counters start at 0
        for pod in running - set(self.engines):
            self.engines[pod] = FakeVllm("")
        self._observe()
        for pod, engine in self.engines.items():
            engine.body = self.page(pod)
        self._write_targets()

    def _write_targets(self) -> None:
        groups = [{"targets": [e.url.split("//", 1)[1].split("/", 1)[0]],
                   "labels": {"namespace": self.namespace, "pod": pod, "kvoffload_io_serve": self.name}}
                  for pod, e in sorted(self.engines.items())]
        tmp = self.targets.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets)  # Prometheus re-reads file_sd files when they change

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.sync()
            except Exception:  # noqa: BLE001 - the API server restarting under the test: next round
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for engine in self.engines.values():
            engine.close()
        self.engines = {}
