"""Stand-in vLLM engines for a KVOffloadServe's pods: kwok runs no containers, so for each of its Running pods
one FakeVllm on 127.0.0.1 serves vLLM-shaped /metrics (vllm:num_requests_waiting, vllm:kv_cache_usage_perc and
vllm:prompt_tokens_by_source_total) and a file_sd target list tells a real Prometheus to scrape it with the
labels the chart's PodMonitor gives (namespace, pod, kvoffload_io_serve). The test drives the load: the total
queue is spread evenly over the engines that run, as a load balancer would."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from .client import Client
from .exporter import FakeVllm

MODEL = 'engine="0",model_name="stand-in"'


class StandInEngines:
    def __init__(self, client: Client, namespace: str, name: str, targets: Path) -> None:
        self.client, self.namespace, self.name, self.targets = client, namespace, name, targets
        self.waiting = 0.0  # requests queued over all engines
        self.kv_usage = 0.1  # GPU KV-cache usage of each engine (0..1)
        self.engines: dict[str, FakeVllm] = {}
        self.prompt_tokens = {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0}
        self._stop = threading.Event()
        self._write_targets()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def page(self) -> str:
        n = max(1, len(self.engines))
        lines = ["# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{MODEL}}} {self.waiting / n}",
                 "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{MODEL}}} {self.kv_usage}",
                 "# TYPE vllm:prompt_tokens_by_source_total counter"]
        lines += [f'vllm:prompt_tokens_by_source_total{{{MODEL},source="{s}"}} {v}' for s, v in self.prompt_tokens.items()]
        return "\n".join(lines) + "\n"

    def _running(self) -> set[str]:
        pods = self.client.list("pods", self.namespace, labels={"kvoffload.io/serve": self.name})
        return {p["metadata"]["name"] for p in pods
                if (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")}

    def sync(self) -> None:
        running = self._running()
        for pod in set(self.engines) - running:
            self.engines.pop(pod).close()
        for pod in running - set(self.engines):
            self.engines[pod] = FakeVllm("")
        page = self.page()
        for engine in self.engines.values():
            engine.body = page
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
