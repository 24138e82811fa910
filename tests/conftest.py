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
  demo       session-scoped: `make demo` run from a fresh clone of this tree (its own .cluster, the
             shared caches): a control plane with a REAL node (kubelet + containerd, kvtest.node) beside
             the kwok fleet, the chart installed, the operator running in-cluster on the real node.
             Yields a ClusterHandle on that cluster (.demo_dir: the clone, .demo_log: its output).
             One real node per machine: the tests that need one share it. Stopped at the end unless
             KVO_KEEP_CLUSTER=1. Needs root and tests/cluster/build-node.sh's binaries: without them
             those tests skip, unless KVO_REQUIRE_REAL_NODE is set (make test), when they fail.
             KVO_DEMO_CLUSTER_DIR=<a running demo's .cluster> reuses that cluster (and leaves it running).
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


# `make test` runs tests/unit once in `make check`, first, before any build or download (KVO_CHECK=1): there the
# tests that need a built tool (helm, the router, the GitOps tools) or a download (the operator's wheelhouse) skip.
# With KVO_UNIT_RAN=1 (the full run after it) only those run again.
BUILT_TOOL_FIXTURES = {"helm", "vllm_router", "gitops_tools", "operator_wheelhouse", "router_wheelhouse"}


def _built_or_skip(what: str, how: str) -> None:
    """`make check` builds and downloads nothing: a test needing `what` skips there (and runs in the full pass)."""
    if os.environ.get("KVO_CHECK") == "1":
        pytest.skip(f"make check builds nothing: tests needing {what} run in the full pass ({how})")


# The tests that need a build `make test` runs in the background (kvtest.background) run last, whole modules at a
# time, in the order those builds are expected to finish, so the rest of the pass overlaps them.
TESTS = Path(__file__).parent
LATE = {"flux": 1, "keda": 2, "engine": 3}  # kvtest.background.LOCKS
LATE_PATHS = {TESTS / "integration" / "test_flux.py": "flux", TESTS / "integration" / "test_gitops.py": "flux",
              TESTS / "integration" / "test_autoscaling.py": "keda", TESTS / "engine": "engine",
              TESTS / "images": "engine"}
# Fixtures that wait for a background build, for modules outside those paths (test_routing_cluster.py's engine_python)
LATE_FIXTURES = {"gitops_tools": "flux", "engine_python": "engine"}


def _late(item) -> int:
    path = Path(item.path)
    for where, build in LATE_PATHS.items():
        if path == where or where in path.parents:
            return LATE[build]
    return max((LATE[build] for name, build in LATE_FIXTURES.items() if name in item.fixturenames), default=0)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KVO_UNIT_RAN") == "1":
        unit = TESTS / "unit"
        done = [i for i in items if unit in Path(i.path).parents and not BUILT_TOOL_FIXTURES & set(i.fixturenames)]
        if done:
            config.hook.pytest_deselected(items=done)
            gone = set(map(id, done))
            items[:] = [i for i in items if id(i) not in gone]
    rank: dict[Path, int] = {}
    for i in items:
        rank[Path(i.path)] = max(rank.get(Path(i.path), 0), _late(i))
    items.sort(key=lambda i: rank[Path(i.path)])  # stable: the collected order within each rank


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


def fresh_clone(dest: Path) -> Path:
    """This tree as a new user gets it: a `git clone` of HEAD, plus the working tree's uncommitted
    changes (so that a run on work in progress tests that work), nothing git ignores."""
    root = kvtest.ROOT
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(root), str(dest)], check=True)
    changed = subprocess.run(["git", "ls-files", "-z", "-m", "-o", "-d", "--exclude-standard"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, changed):
        src, dst = root / rel, dest / rel
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
            dst.chmod(src.stat().st_mode)
        elif not src.exists() and dst.exists():
            dst.unlink()  # deleted in the working tree
    return dest


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    why = None
    if os.geteuid() != 0:
        why = "the real node needs root"
    elif kvtest.missing_binaries() or kvtest.missing_node_binaries():
        why = (f"missing {kvtest.missing_binaries() + kvtest.missing_node_binaries()} "
               f"(make cluster-build node-build system-deps)")
    elif kvtest.node.lock_holder() and not os.environ.get("KVO_DEMO_CLUSTER_DIR"):
        why = f"another real node runs on this machine ({kvtest.node.lock_holder()})"
    if why:
        if os.environ.get("KVO_REQUIRE_REAL_NODE"):
            pytest.fail(why + " (KVO_REQUIRE_REAL_NODE is set)", pytrace=False)
        pytest.skip(why)
    reuse = os.environ.get("KVO_DEMO_CLUSTER_DIR")  # a cluster a `make demo` left running: iterate on the tests
    if reuse:
        c = kvtest.Cluster(dir=Path(reuse).resolve())
        if not c.running() or not c.real_node:
            pytest.fail(f"KVO_DEMO_CLUSTER_DIR={reuse}: no running cluster with a real node there", pytrace=False)
        handle = ClusterHandle(c, False)
        handle.demo_dir, handle.demo_log, handle.demo_rc = None, None, None
        yield handle
        return
    clone = fresh_clone(tmp_path_factory.mktemp("fresh") / "kvoffload")
    log = clone.parent / "make-demo.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVO_CLUSTER_DIR", "KUBECONFIG", "VIRTUAL_ENV"))}
    c = kvtest.Cluster(dir=clone / ".cluster", real_node=True)
    try:
        with open(log, "w") as out:
            cp = subprocess.run(["make", "demo"], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=2400)
        handle = ClusterHandle(c, True)
        handle.demo_dir, handle.demo_log = clone, log
        handle.demo_rc = cp.returncode
        yield handle
    finally:
        if os.environ.get("KVO_KEEP_CLUSTER") != "1":
            problems = c.down()
            if problems:
                print(f"real-node cluster teardown problems: {problems}", file=sys.stderr)


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


@pytest.fixture
def node_ns(demo):
    """A fresh namespace in the demo's cluster (the one with the real node), deleted after the test."""
    name = f"t-node-{uuid.uuid4().hex[:8]}"
    demo.client.namespace(name, labels={"kvoffload.io/test": "true"})
    yield name
    with contextlib.suppress(Exception):
        demo.client.delete("namespace", name, missing_ok=True)


@pytest.fixture(scope="session")
def vllm_router() -> Path:
    """vLLM's router from its PyPI wheel (`make router`: tests/routing/build-router.sh); skips without it, unless
    KVO_REQUIRE_CLUSTER is set (make test), when it fails."""
    from kvoffload.engine import router

    path = Path.home() / ".cache" / "kvoffload" / f"vllm-router-{router.VERSION}"
    if not (path / ".done").exists():
        if os.environ.get("KVO_REQUIRE_CLUSTER"):
            pytest.fail(f"vllm-router {router.VERSION} is not installed: run `make router`")
        pytest.skip(f"vllm-router {router.VERSION} is not installed (make router)")
    return path / "bin" / "vllm-router"


@pytest.fixture(scope="session")
def gitops_tools() -> dict[str, str]:
    """name -> path of each GitOps test tool (tests/gitops/build.sh: Go builds, cached by version)."""
    _built_or_skip("the GitOps tools", "make gitops-tools")
    from kvtest import gitops

    return gitops.tools()


@pytest.fixture(scope="session")
def operator_wheelhouse() -> Path:
    """The operator's dependencies as wheels (`make operator-wheels`), so an install runs offline."""
    _built_or_skip("the operator's wheelhouse", "make operator-wheels")
    wheelhouse = Path.home() / ".cache" / "kvoffload" / "wheelhouse"
    if not list(wheelhouse.glob("kopf-*.whl")):
        pytest.fail(f"no wheels in {wheelhouse}: run `make operator-wheels`")
    return wheelhouse


@pytest.fixture(scope="session")
def router_wheelhouse() -> Path:
    """vLLM's router and its dependencies as wheels (`make router-wheels`), so the router image builds offline."""
    _built_or_skip("the router's wheelhouse", "make router-wheels")
    from kvtest import images

    if not list(images.ROUTER_WHEELHOUSE.glob("vllm_router-*.whl")):
        pytest.fail(f"no vllm-router wheel in {images.ROUTER_WHEELHOUSE}: run `make router-wheels`")
    return images.ROUTER_WHEELHOUSE


@pytest.fixture(scope="module")
def crd_installed(cluster):
    cluster.cluster.install_crd()
