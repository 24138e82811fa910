"""The operator's own Prometheus metrics (`kvoffload run --metrics-listen ADDR:PORT` serves them).

One registry per Runtime (not prometheus_client's global one), passed where it is counted.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter("kvoffload_operator_reconciles", "Reconciles by outcome (updated, unchanged, "
                                  "deferred, invalid, conflict, gone, failed, status-refused).", ["outcome"],
                                  registry=self.registry)
        self.status_refused = Counter("kvoffload_operator_status_writes_refused",
                                      "Status writes the API server refused (422 "
                                      "Invalid): the status a reader sees is stale.",
                                      registry=self.registry)
        self.queued = Gauge("kvoffload_operator_queue_depth", "Resources waiting for a reconcile.",
                            registry=self.registry)
        self.dead_tasks = Gauge("kvoffload_operator_dead_tasks",
                                "Runtime tasks (workers, resync, leader election) that "
                                "died; the liveness probe fails while it is above 0.", registry=self.registry)

    def serve(self, listen: str) -> None:
        """Serve /metrics on `listen` ("ADDR:PORT") from a background thread."""
        addr, _, port = listen.rpartition(":")
        start_http_server(int(port), addr or "127.0.0.1", registry=self.registry)
