"""The operator as a real subprocess (`python -m kvoffload.cli run`), its output in a log file.

One class for the integration tests, the leader-election test (`leader_election=`), the chart-RBAC test
(its own kubeconfig in `env`, the chart's settings file, run outside the repository) and the scale and
latency benchmarks (`namespaces=None`: every namespace). `drain` runs an in-process Runtime's queue dry (unit tests).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from .paths import ROOT
from .procs import wait_until


class OperatorProcess:
    def __init__(self, env: dict[str, str], namespaces: Sequence[str] | None, config: dict | str | None = None,
                 log_path: Path | None = None, leader_election: tuple[str, str] | None = None,
                 cwd: Path = ROOT, extra_args: Sequence[str] = ()) -> None:
        """Watch `namespaces` (None: all of them) with operator settings `config` (a dict, or a settings
        file's text; default resyncSeconds 20); `leader_election` = (namespace, name) of the Lease; `extra_args`
        appended to `kvoffload run`'s."""
        if log_path is None:
            log_path = Path(tempfile.mkdtemp(prefix="kvo-operator-")) / "operator.log"
        self.log_path = log_path
        self.config_path = log_path.with_suffix(".yaml")
        if config is None:
            config = {"resyncSeconds": 20}
        self.config_path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
        args = [sys.executable, "-m", "kvoffload.cli", "run", "--liveness", "", "--log-level", "INFO",
                "--operator-config", str(self.config_path), *extra_args]
        if namespaces is None:
            args.append("--all-namespaces")
        for ns in namespaces or ():
            args += ["--namespace", ns]
        if leader_election:
            args += ["--leader-election", "--leader-election-namespace", leader_election[0],
                     "--lease-name", leader_election[1]]
        self.args = args
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd,
                                     start_new_session=True)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_started(self, timeout: float = 60) -> None:
        """Until it serves: its caches are filled (it reconciles nothing before). kopf says so with the
        first event it releases, after listing every kind: on a cluster with nothing of ours, create a
        `sentinel` first."""
        wait_until(lambda: "caches filled" in self.output() or self.proc.poll() is not None,
                   timeout=timeout, message="operator started")
        if self.proc.poll() is not None:
            raise RuntimeError("operator exited:\n" + self.output()[-3000:])

    def identity(self) -> str | None:
        """With leader election: the identity it runs under (from its first log line about the Lease)."""
        for line in self.output().splitlines():
            if "leader election on Lease" in line:
                return line.rsplit(" as ", 1)[1].strip()
        return None

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM (kopf's cleanup runs), SIGKILL to the group if that takes longer than `timeout`."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()

    def kill(self) -> None:
        """SIGKILL, no cleanup: a crash."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


async def drain(rt: Any) -> None:
    """Run a kvoffload.controller.runtime.Runtime's workers until nothing is queued or running."""
    rt._serve()
    for _ in range(500):
        await asyncio.sleep(0.01)
        if not rt.queued and not rt.running:
            return
    raise AssertionError("queue did not drain")


SENTINEL = "kvo-sentinel"


def sentinel(client, namespace: str) -> None:  # type: ignore[no-untyped-def]
    """One ConfigMap labelled as a child of a KVOffloadServe that does not exist: kopf lists it, so the
    operator's first event (and its "caches filled" line) comes once every kind is listed. Its reconcile
    finds no owner and sends nothing."""
    client.create({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": SENTINEL, "labels": {"kvoffload.io/serve": SENTINEL}}}, namespace)
