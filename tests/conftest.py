"""Session fixtures for tests that need the local Kubernetes cluster (tests/cluster/).

Fixtures:
  cluster    session-scoped. Reuses a running healthy cluster in .cluster/ or starts one
             (never stops a cluster it reused; stops one it started unless
             KVO_KEEP_CLUSTER=1). Yields a ClusterHandle: .kubeconfig (Path), .env (dict),
             .client (kvtest.client.Client: the one API client tests use),
             .kubectl(*args, check=True, input=None) -> CompletedProcess (text; only for tests
             about what kubectl shows), .helm(...), .bin (Path of etcd/kube-*/kwok/helm),
             .api_client() (the kubernetes ApiClient the operator's own code takes, for tests that
             run operator code in-process), .wait_until(fn, timeout, message), .cluster (the
             kvtest.Cluster).
  crd_installed  module-scoped: the project's CRD applied (crds/, server-side) and Established.
  namespace  a fresh namespace per test (unique name, label kvoffload.io/test=true, its
             `default` ServiceAccount present), deleted after the test (not awaited).

Marker `cluster`: the test needs the cluster. Without binaries (tests/cluster/build.sh)
those tests skip, unless KVO_REQUIRE_CLUSTER is set (CI), in which case they fail.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import kvtest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cluster: needs the local Kubernetes control plane (kvtest.Cluster)")


class ClusterHandle:
    """What the `cluster` fixture yields."""

    def __init__(self, c: kvtest.Cluster, started: bool):
        self.cluster = c
        self.started = started
        self.kubeconfig: Path = c.kubeconfig
        self.bin: Path = c.bin
        self.env: dict[str, str] = c.env

    @property
    def client(self) -> kvtest.Client:
        return self.cluster.client

    def kubectl(self, *args, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        return self.cluster.kubectl(*args, check=check, input=input, timeout=timeout)

    def helm(self, *args, check: bool = True, input: str | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
        return self.cluster.helm(*args, check=check, input=input, timeout=timeout)

    def api_client(self):
        return self.cluster.api_client()

    def token_kubeconfig(self, path: Path, token: str, namespace: str, user: str) -> Path:
        return self.cluster.token_kubeconfig(path, token, namespace, user)

    @staticmethod
    def wait_until(fn, timeout: float = 60, interval: float = 0.2, message: str = "condition"):
        return kvtest.wait_until(fn, timeout=timeout, interval=interval, message=message)

    def __repr__(self) -> str:
        return f"ClusterHandle(kubeconfig={self.kubeconfig}, started={self.started})"


@pytest.fixture(scope="session")
def cluster():
    missing = kvtest.missing_binaries()
    if missing:
        msg = (f"local cluster binaries missing in {kvtest.bin_dir()}: {', '.join(missing)}; "
               f"build them with tests/cluster/build.sh")
        if os.environ.get("KVO_REQUIRE_CLUSTER"):
            pytest.fail(msg + " (KVO_REQUIRE_CLUSTER is set)", pytrace=False)
        pytest.skip(msg)
    c, started = kvtest.Cluster.ensure()
    handle = ClusterHandle(c, started)
    try:
        yield handle
    finally:
        if started and os.environ.get("KVO_KEEP_CLUSTER") != "1":
            problems = c.down()
            if problems:
                print(f"cluster teardown problems: {problems}", file=sys.stderr)


@pytest.fixture
def namespace(cluster, request):
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")
    name = f"t-{base[:40].strip('-')}-{uuid.uuid4().hex[:6]}"
    cluster.client.namespace(name, labels={"kvoffload.io/test": "true"})
    try:
        yield name
    finally:
        with contextlib.suppress(Exception):
            cluster.client.delete("namespace", name, missing_ok=True)


@pytest.fixture(scope="module")
def crd_installed(cluster):
    cluster.cluster.install_crd()
