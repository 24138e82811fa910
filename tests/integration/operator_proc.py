"""Run the operator as a real subprocess (`kvoffload run`), scoped to namespaces."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


class OperatorProcess:
    def __init__(self, env: dict[str, str], namespaces: list[str], config: dict | None = None, log_path: Path | None = None):
        self.tmp = Path(tempfile.mkdtemp(prefix="kvo-operator-"))
        self.config_path = self.tmp / "operator.yaml"
        self.config_path.write_text(yaml.safe_dump(config or {"resyncSeconds": 20}))
        self.log_path = log_path or self.tmp / "operator.log"
        args = [sys.executable, "-m", "kvoffload.cli", "run", "--liveness", "", "--log-level", "INFO",
                "--operator-config", str(self.config_path)]
        for ns in namespaces:
            args += ["--namespace", ns]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(5)
        self.log.close()
