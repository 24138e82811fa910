"""The README's quick start, command by command, on the real control plane."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from kvtest import ROOT, OperatorProcess
from kvtest.readme import commands

pytestmark = pytest.mark.cluster
QUICK_START = [c for c in commands() if c.startswith(("kubectl ", "helm "))]


def test_quick_start(cluster):
    env = {**cluster.env, "PATH": f"{cluster.bin}{os.pathsep}{ROOT / '.venv/bin'}{os.pathsep}{cluster.env['PATH']}"}
    # Tests before this one may have applied crds/ (crd_installed); let the release adopt the CRD as a user
    # who did the same would (Helm's documented adoption labels), so `helm install` runs as written.
    c, crd = cluster.client, "kvoffloadserves.kvoffload.io"
    if c.exists("crd", crd):
        c.patch("crd", crd, {"metadata": {
            "labels": {"app.kubernetes.io/managed-by": "Helm"},
            "annotations": {"meta.helm.sh/release-name": "kvoffload",
                            "meta.helm.sh/release-namespace": "kvoffload-system"}}})
    operator = OperatorProcess(cluster.env, ["kvoffload-demo"])  # kwok runs no container: the operator runs here
    try:
        for command in QUICK_START:  # kubectl under test (and helm): the README's commands, as written
            res = subprocess.run(shlex.split(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
            assert res.returncode == 0, f"{command}\n{res.stdout}\n{res.stderr}\n{operator.output()[-3000:]}"
            if command.startswith("kubectl get kvs"):
                assert "cpu-tier-qwen25-7b" in res.stdout and "True" in res.stdout
            if command.startswith("kubectl explain"):
                assert "reclaimPolicy" in res.stdout and "allowed roots" in res.stdout
    finally:
        operator.stop()
        cluster.helm("uninstall", "kvoffload", "--namespace", "kvoffload-system", check=False)
        for ns in ("kvoffload-demo", "kvoffload-system"):
            c.delete("namespace", ns, missing_ok=True)
