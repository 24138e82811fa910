"""For the exporter's tests and benchmarks/exporter_bench.py: stand-ins for vLLM (a tiny HTTP server on
127.0.0.1 serving a fixed /metrics page) and LMCache (a writer of its multiprocess files), and a
launcher that runs the exporter as a subprocess on a free loopback port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType


class FakeVllm:
    """Serves `body` on http://127.0.0.1:<free port>/metrics; `status`, `delay` (seconds before
    answering) and `body` may be changed while it runs."""

    def __init__(self, body: str, status: int = 200, delay: float = 0.0) -> None:
        self.body, self.status, self.delay = body, status, delay
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if fake.delay:
                    time.sleep(fake.delay)
                data = fake.body.encode()
                self.send_response(fake.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a scrape that gave up (a timeout test's client) hung up first: what a real vLLM sees too

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeVllm:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


_WRITER = """
import json, os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]  # before the import: selects mmap values
from prometheus_client import Counter, Gauge
spec = json.loads(sys.argv[2])
labels = spec["labels"]
for name, value in spec["counters"].items():
    Counter(name, name, list(labels)).labels(**labels).inc(value)
for name, value in spec["gauges"].items():
    Gauge(name, name, list(labels), multiprocess_mode="sum").labels(**labels).set(value)
"""


def write_lmcache_metrics(directory: str, counters: dict[str, float] | None = None,
                          gauges: dict[str, float] | None = None, worker_id: str = "0") -> None:
    """Write LMCache-named metrics the way LMCache does (prometheus_client multiprocess mode, in a
    child process, so this process's value class is untouched). Counters are given without
    `_total` (e.g. `lmcache:num_stored_tokens`); each call adds one process's files, and the
    multiprocess collector sums counters and `sum` gauges over processes."""
    spec = {
        "labels": {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "role": "worker",
                   "served_model_name": "llama-8b", "worker_id": worker_id},
        "counters": counters or {},
        "gauges": gauges or {},
    }
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    subprocess.run([sys.executable, "-c", _WRITER, directory, json.dumps(spec)], check=True, env=env)


class ExporterProcess:
    """`python -m kvoffload.exporter --listen 127.0.0.1:0 ARGS...` (or `kvoffload exporter ...`),
    waiting for its "listening on" log line to learn the port. Log lines are kept in `log_lines`."""

    def __init__(self, args: Sequence[str], start_timeout: float = 20.0, via_cli: bool = False) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        # via_cli: `kvoffload exporter`, through the CLI that also imports the other sub-commands
        command = ["kvoffload.cli", "exporter"] if via_cli else ["kvoffload.exporter"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *command, "--listen", "127.0.0.1:0", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.log_lines: list[str] = []
        self._listening = threading.Event()
        self.port = 0
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._listening.wait(start_timeout):
            self.stop()
            raise RuntimeError("exporter did not start:\n" + "".join(self.log_lines))
        self.url = f"http://127.0.0.1:{self.port}"

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log_lines.append(line)
            if "listening on http://" in line and not self._listening.is_set():
                self.port = int(line.rsplit(":", 1)[1].split("/", 1)[0])
                self._listening.set()

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> ExporterProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
