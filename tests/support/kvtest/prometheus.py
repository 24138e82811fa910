"""A REAL Prometheus (/usr/bin/prometheus, the Debian package) as a subprocess on 127.0.0.1, and its HTTP API."""

from __future__ import annotations

import http.client
import json
import subprocess
import time
import urllib.parse
from pathlib import Path
from types import TracebackType
from typing import Any

from .procs import LOOPBACK, free_ports

PROMETHEUS = Path("/usr/bin/prometheus")


class PromAPI:
    def __init__(self, port: int) -> None:
        self.port = port

    def get(self, path: str, **params: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=10)
        try:
            conn.request("GET", f"{path}?{urllib.parse.urlencode(params)}" if params else path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()

    def query(self, promql: str) -> list[dict[str, Any]]:
        status, body = self.get("/api/v1/query", query=promql)
        doc = json.loads(body)
        assert status == 200 and doc["status"] == "success", f"{promql}: {body}"
        return doc["data"]["result"]

    def by(self, promql: str, label: str) -> dict[str, float]:
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in self.query(promql)}

    def scalar(self, promql: str) -> float:
        result = self.query(promql)
        assert len(result) == 1, f"{promql}: {result}"
        return float(result[0]["value"][1])

    def wait_for(self, promql: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.query(promql):
                    return
            except (OSError, AssertionError, ValueError):
                pass
            time.sleep(0.3)
        raise AssertionError(f"no result for {promql} within {timeout}s")

    def ready(self) -> bool:
        try:
            return self.get("/-/ready")[0] == 200
        except OSError:
            return False


class Prometheus:
    """Prometheus with `scrape_configs`, scraping every second, its files in `workdir`."""

    def __init__(self, workdir: Path, scrape_configs: list[dict[str, Any]]) -> None:
        self.workdir = workdir
        self.port = free_ports(1)[0]
        self.url = f"http://{LOOPBACK}:{self.port}"
        (workdir / "prometheus.yml").write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": scrape_configs}))
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address={LOOPBACK}:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir)
        self.api = PromAPI(self.port)
        deadline = time.monotonic() + 30
        while not self.api.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("Prometheus did not start:\n" + self.log_path.read_text())
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
