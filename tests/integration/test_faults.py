"""Faults on the real control plane: the operator SIGKILLed mid-rollout, kube-apiserver and etcd restarted.

These tests restart control-plane components, so they run on a private cluster (its own state dir,
ports and etcd, 8 kwok GPU nodes) started for this module and stopped after it: the shared cluster
in .cluster/ that other suites use is never touched.

After every fault the same invariants are checked (`assert_converged`): every KVOffloadServe Ready at
its generation, exactly the expected children (ConfigMap, two Services, StatefulSet, PDB), each with
exactly one controller ownerReference to a KVOffloadServe that exists, nothing orphaned, the expected
pods, and no finalizer or kopf bookkeeping on any resource.

Every random choice (kill points, restart moments, which resources change) comes from one seed per run, printed
when the module starts and in each test's captured output: KVO_FAULT_SEED=<seed> replays a run.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

import kvtest
from kvtest import OperatorProcess
from kvtest.specs import live_children

pytestmark = pytest.mark.cluster

GROUP = "kvoffload.io"
OWNER_LABEL = "kvoffload.io/serve"
# CPU tier only, one replica of one GPU: 8 nodes x 8 GPUs hold every pod of these tests at once.
SPEC = {"replicas": 1, "model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxModelLen": 4096},
        "offload": {"cpu": {"size": "1Gi"}}, "resources": {"gpuMemory": "141Gi"}}


def expected_children(name: str) -> set[tuple[str, str]]:
    return {("ConfigMap", f"{name}-lmcache"), ("Service", name), ("Service", f"{name}-pods"),
            ("StatefulSet", name), ("PodDisruptionBudget", name)}


# ------------------------------------------------------------------------------ the run's seed
@pytest.fixture(scope="module")
def seed(request) -> int:
    """A fresh seed per run (KVO_FAULT_SEED pins it), shown at once: a failing run is replayed with it."""
    value = int(os.environ.get("KVO_FAULT_SEED") or random.SystemRandom().randrange(1_000_000))
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None:  # on the terminal even when output is captured and all pass
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"test_faults: KVO_FAULT_SEED={value}")
    return value


@pytest.fixture
def rng(seed, request) -> random.Random:
    """The test's own stream from the run's seed (keyed by its name), so a test replays the same way alone or among
    the others. Printed again: it lands in a failing test's captured output."""
    print(f"KVO_FAULT_SEED={seed}")
    return random.Random(f"{seed}-{request.node.name}")


# ------------------------------------------------------------------------------ a private cluster
@pytest.fixture(scope="module")
def private_cluster(request):
    missing = kvtest.missing_binaries()
    if missing:
        msg = f"local cluster binaries missing: {', '.join(missing)}; build them with tests/cluster/build.sh"
        if os.environ.get("KVO_REQUIRE_CLUSTER"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    # Its own state dir (not pytest's tmp_path, which other sessions' runs prune): the component logs stay
    # for a post-mortem when a test fails, and go when all passed.
    c = kvtest.Cluster(dir=Path(tempfile.mkdtemp(prefix="kvo-faults-cluster-")))
    # 12 x 8 GPUs: room for the 40 + 15 + 15 single-GPU resources the tests below keep until the module ends.
    c.up(kvtest.make_fleet(gpu_nodes=12, workstations=0))
    failed_before = request.session.testsfailed
    try:
        c.install_crd()
        yield c
    finally:
        problems = c.down()
        if request.session.testsfailed == failed_before and not problems:
            shutil.rmtree(c.dir, ignore_errors=True)
        else:
            print(f"private cluster state and logs kept in {c.dir}")
        assert not problems, problems


def create(c: kvtest.Cluster, ns: str, name: str) -> None:
    body = {"apiVersion": f"{GROUP}/v1alpha1", "kind": "KVOffloadServe", "metadata": {"name": name},
            "spec": copy.deepcopy(SPEC)}
    c.client.create(body, ns)


def create_once(c: kvtest.Cluster, ns: str, name: str) -> bool:
    """Create, counting "already exists" as done (a retried create whose first answer was lost)."""
    try:
        create(c, ns, name)
    except kvtest.ApiError as exc:
        if exc.status != 409:
            raise
    return True


def patch_spec(c: kvtest.Cluster, ns: str, name: str, patch: dict[str, Any]) -> None:
    c.client.patch("kvs", name, {"spec": patch}, ns)


def children(c: kvtest.Cluster, ns: str) -> list[dict[str, Any]]:
    """Every object of the operator's child kinds in the namespace (labelled by us or not)."""
    return live_children(c.client, ns, labelled=False)


def ready(obj: dict[str, Any]) -> bool:
    st = obj.get("status") or {}
    conds = {c["type"]: c for c in st.get("conditions", [])}
    return (st.get("observedGeneration") == obj["metadata"]["generation"]
            and conds.get("Ready", {}).get("status") == "True")


def problems(c: kvtest.Cluster, ns: str, want: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Everything that is not as it should be once the operator has converged ([] when all is well).

    want: name -> spec patch applied (to check the rollout reached the children), for every resource that
    should exist; None means "whatever exists".
    """
    out: list[str] = []
    serves = {s["metadata"]["name"]: s for s in c.client.list("kvs", ns)}
    if want is not None and set(serves) != set(want):
        out.append(f"resources {sorted(set(serves) ^ set(want))} missing or unexpected")
    uids = {s["metadata"]["uid"]: name for name, s in serves.items()}
    for name, s in sorted(serves.items()):
        meta = s["metadata"]
        if meta.get("finalizers"):
            out.append(f"{name}: finalizers {meta['finalizers']}")
        kopf_marks = [k for k in (meta.get("annotations") or {}) if "kopf" in k
                      or k.startswith(f"{GROUP}/last-handled")]
        if kopf_marks:
            out.append(f"{name}: kopf annotations {kopf_marks}")
        if not ready(s):
            out.append(f"{name}: not Ready at generation {meta['generation']}: "
                       f"{(s.get('status') or {}).get('conditions')}")
    found: dict[str, set[tuple[str, str]]] = {name: set() for name in serves}
    sts_by_name: dict[str, dict[str, Any]] = {}
    cm_by_name: dict[str, dict[str, Any]] = {}
    for child in children(c, ns):
        meta = child["metadata"]
        refs = [r for r in meta.get("ownerReferences") or [] if r.get("kind") == "KVOffloadServe"]
        labelled = OWNER_LABEL in (meta.get("labels") or {})
        if not refs and not labelled:
            continue  # kube-root-ca.crt and the like
        key = (child["kind"], meta["name"])
        controllers = [r for r in meta.get("ownerReferences") or [] if r.get("controller")]
        if len(refs) != 1 or len(controllers) != 1 or controllers[0] is not refs[0]:
            out.append(f"{key}: ownerReferences {meta.get('ownerReferences')}")
            continue
        owner = uids.get(refs[0]["uid"])
        if owner is None:
            out.append(f"{key}: orphan, owner {refs[0]['name']} uid {refs[0]['uid']} does not exist")
            continue
        if meta["labels"].get(OWNER_LABEL) != owner or key in found[owner]:
            out.append(f"{key}: label {meta['labels'].get(OWNER_LABEL)!r} or duplicate for {owner}")
        if meta.get("finalizers"):
            out.append(f"{key}: finalizers {meta['finalizers']}")
        found[owner].add(key)
        if child["kind"] == "StatefulSet":
            sts_by_name[meta["name"]] = child
        if child["kind"] == "ConfigMap":
            cm_by_name[owner] = child
    for name, kids in sorted(found.items()):
        if kids != expected_children(name):
            out.append(f"{name}: children {sorted(kids)}, expected {sorted(expected_children(name))}")
    for name, s in sorted(serves.items()):
        sts = sts_by_name.get(name)
        if sts is None:
            continue
        cpu = ((want or {}).get(name) or {}).get("offload", {}).get("cpu", {}).get("size", "1Gi")
        st = sts.get("status") or {}
        if st.get("updateRevision") != st.get("currentRevision"):
            out.append(f"{name}: StatefulSet revisions {st.get('updateRevision')} != {st.get('currentRevision')}")
        engine_cfg = (cm_by_name.get(name) or {}).get("data", {}).get("lmcache.yaml", "")
        if want is not None and f"max_local_cpu_size: {float(cpu.removesuffix('Gi'))}" not in engine_cfg:
            out.append(f"{name}: ConfigMap does not hold the CPU tier {cpu} of the spec")
        mem = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
        if (s.get("status") or {}).get("summary", {}).get("memory") != mem:
            out.append(f"{name}: status memory "
                       f"{(s.get('status') or {}).get('summary', {}).get('memory')} != StatefulSet {mem}")
    pods_by_owner: dict[str, list[str]] = {}
    for pod in c.client.list("pods", ns):
        owner = (pod["metadata"].get("labels") or {}).get(OWNER_LABEL)
        if pod["metadata"].get("deletionTimestamp"):
            continue
        pods_by_owner.setdefault(owner or "?", []).append(pod["metadata"]["name"])
        if owner not in serves:
            out.append(f"pod {pod['metadata']['name']}: owner {owner!r} does not exist")
        elif pod.get("status", {}).get("phase") != "Running":
            out.append(f"pod {pod['metadata']['name']}: phase {pod.get('status', {}).get('phase')}")
    for name, s in serves.items():
        if sorted(pods_by_owner.get(name, [])) != [f"{name}-{i}" for i in range(s["spec"].get("replicas", 1))]:
            out.append(f"{name}: pods {sorted(pods_by_owner.get(name, []))}")
    return out


def wait_converged(c: kvtest.Cluster, ns: str, want: dict[str, dict[str, Any]] | None, timeout: float) -> list[str]:
    """Wait until `problems` is empty or `timeout` passes; return what is still wrong ([] = converged)."""
    last: list[str] = []

    def converged() -> bool:
        nonlocal last
        try:
            last = problems(c, ns, want)
        except Exception as exc:  # noqa: BLE001 - the API may be restarting
            last = [f"{type(exc).__name__}: {exc}"]
        return not last

    # A timeout is an answer here, not an error: the callers look at what is left (pods only: heal the scheduler).
    with contextlib.suppress(TimeoutError):
        kvtest.wait_until(converged, timeout=timeout, interval=1, message="the operator converges")
    return last


def assert_converged(c: kvtest.Cluster, ns: str, want: dict[str, dict[str, Any]] | None, timeout: float) -> float:
    """Wait until `problems` is empty; return the seconds it took. On timeout, fail with what is still wrong."""
    t0 = time.monotonic()
    last = wait_converged(c, ns, want, timeout)
    if last:
        health = {comp: detail for comp, (ok, detail) in c.component_health().items()}
        pytest.fail(f"not converged after {timeout:.0f}s (control plane: {health}):\n" +
                    "\n".join(p[:400] for p in last[:30]), pytrace=False)
    return time.monotonic() - t0


def start_operator(c: kvtest.Cluster, ns: str, log_path: Path | None = None) -> OperatorProcess:
    return OperatorProcess(c.env, [ns], {"resyncSeconds": 20}, log_path=log_path)


def wait_log(op: OperatorProcess, needle: str, timeout: float, after: int = 0) -> None:
    kvtest.wait_until(lambda: op.output().count(needle) > after or op.proc.poll() is not None, timeout=timeout,
                         interval=0.05, message=f"operator log line {needle!r}")
    assert op.proc.poll() is None, op.output()[-3000:]


# ------------------------------------------------------------------------------ the tests
KILLS = 10
CREATE_PER_ROUND = 4  # 40 resources over the 10 rounds
UPDATE_PER_ROUND = 2  # spec changes that roll the StatefulSet
DELETE_ROUNDS = (3, 7)  # rounds that also delete a resource (garbage collection while the operator is down)


def test_sigkill_mid_rollout_ten_times(private_cluster, tmp_path, seed, rng):
    """Kill -9 the operator at random points of a rollout, 10 times, restarting it each time."""
    c = private_cluster
    ns = c.client.namespace(f"faults-kill-{seed}")
    want: dict[str, dict[str, Any]] = {}
    kill_points = []
    for round_ in range(KILLS):
        for i in range(CREATE_PER_ROUND):
            name = f"s{round_:02d}-{i}"
            create(c, ns, name)
            want[name] = {}
        older = sorted(n for n in want if not n.startswith(f"s{round_:02d}-"))
        for name in rng.sample(older, min(UPDATE_PER_ROUND, len(older))):
            want[name] = {"offload": {"cpu": {"size": f"{rng.randint(2, 8)}Gi"}}}
            patch_spec(c, ns, name, want[name])
        if round_ in DELETE_ROUNDS and older:
            gone = rng.choice(older)
            c.client.delete("kvs", gone, ns)
            del want[gone]
        op = start_operator(c, ns, tmp_path / f"operator-{round_}.log")
        # Kill somewhere between its first write and a couple of seconds later: mid-apply, between a
        # StatefulSet and its PDB, during a status write, or while pods roll.
        wait_log(op, "apply ", timeout=60)
        delay = rng.uniform(0, 2.5)
        time.sleep(delay)  # deliberate: the kill point itself, a random moment of the rollout (no condition to await)
        applies = op.output().count("apply ")
        op.kill()
        kill_points.append((round(delay, 2), applies))
    print(f"kills (seconds after the first apply, applies logged before the kill): {kill_points}")
    op = start_operator(c, ns, tmp_path / "operator-final.log")
    try:
        took = assert_converged(c, ns, want, timeout=150)
        print(f"converged {took:.1f}s after the final restart; {len(want)} resources")
    finally:
        op.stop()


@pytest.mark.parametrize("component", ["kube-apiserver", "etcd"])
def test_control_plane_restart_mid_rollout(private_cluster, tmp_path, rng, component):
    """Restart kube-apiserver (or etcd) while the operator rolls out; the same operator process recovers."""
    c = private_cluster
    ns = c.client.namespace(f"faults-{component}-{time.time_ns() % 100_000}")
    op = start_operator(c, ns, tmp_path / "operator.log")
    try:
        want = {}
        for i in range(10):
            create(c, ns, f"before-{i}")
            want[f"before-{i}"] = {}
        wait_log(op, "apply ", timeout=60)
        time.sleep(rng.uniform(0.5, 2))  # deliberate: restart at a random moment of the rollout, not after a condition
        # etcd is stopped with SIGTERM: the local etcd runs with --unsafe-no-fsync, so a SIGKILL can lose
        # writes it already acknowledged (seen: a pod binding), which a real etcd (fsync) never does.
        # kube-apiserver keeps no state of its own: SIGKILL.
        sig = signal.SIGTERM if component == "etcd" else signal.SIGKILL
        healthy_after = c.restart(component, downtime=5, sig=sig)
        print(f"{component}: stopped ({sig.name}), down 5 s, healthy {healthy_after:.1f}s after its restart")
        # New work after the restart proves the watches came back, not only the retries of old work.
        for i in range(5):
            kvtest.wait_until(lambda i=i: create_once(c, ns, f"after-{i}"), timeout=60, message=f"create after-{i}")
            want[f"after-{i}"] = {}
        patch_spec(c, ns, "before-0", {"offload": {"cpu": {"size": "3Gi"}}})
        want["before-0"] = {"offload": {"cpu": {"size": "3Gi"}}}
        t0 = time.monotonic()
        stuck = wait_converged(c, ns, want, timeout=60)
        if any(line.startswith("pod ") for line in stuck) and all(
                line.startswith("pod ") or "not Ready" in line or "revisions" in line for line in stuck):
            # Only pods are behind: on this local control plane kube-scheduler now and then stops seeing new
            # pods after a kube-apiserver restart (about 1 run in 3 here; they stay unbound for minutes, and
            # a scheduler restart places them at once). That is not the operator's to fix: restart the
            # scheduler and kwok, leave the operator alone, and demand full convergence again.
            print(f"control plane left pods behind after the {component} restart (not the operator):\n" +
                  "\n".join(stuck[:10]) + "\nrestarting kube-scheduler and kwok")
            for comp in ("kube-scheduler", "kwok"):
                c.restart(comp)
        assert_converged(c, ns, want, timeout=90)
        print(f"converged {time.monotonic() - t0:.1f}s after the restart" + (" (with the heal above)" if stuck else ""))
        assert op.proc.poll() is None, "the operator process exited:\n" + op.output()[-3000:]
    finally:
        op.stop()
        trouble = [line for line in op.output().splitlines() if " WARNING " in line or " ERROR " in line]
        print(f"operator: {len(trouble)} warnings/errors while {component} was down, e.g.:")
        print("\n".join(line[:300] for line in trouble[:12]))


def etcd_delete(c: kvtest.Cluster, key: str) -> int:
    """Delete one key straight from etcd (its JSON gateway on the loopback client port): a change the API
    server never sees happen, so no watch can ever deliver its DELETE."""
    import base64
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", c.state()["ports"]["etcd-client"], timeout=10)
    conn.request("POST", "/v3/kv/deleterange", json.dumps({"key": base64.b64encode(key.encode()).decode()}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = json.loads(resp.read() or b"{}")
    assert resp.status == 200, body
    return int(body.get("deleted", 0))


def test_caches_cannot_serve_stale_decisions_after_an_apiserver_restart(private_cluster, tmp_path, rng):
    """The operator reads children, pods and KVOffloadServes from watch-fed caches. kube-apiserver is
    SIGKILLed mid-rollout, and while it is down a ConfigMap of a resource that will not change again is
    deleted straight from etcd (the restarted API server's history has no DELETE for it: only a fresh
    LIST shows it is gone). Then every other resource's spec changes and new ones come. The same
    operator process must converge: new specs in every child, the lost ConfigMap re-created."""
    c = private_cluster
    ns = c.client.namespace(f"faults-cache-{time.time_ns() % 100_000}")
    op = start_operator(c, ns, tmp_path / "operator.log")
    try:
        want: dict[str, dict[str, Any]] = {}
        for i in range(8):
            create(c, ns, f"r-{i}")
            want[f"r-{i}"] = {}
        # The victim's children must exist before the restart (its ConfigMap is what gets lost).
        kvtest.wait_until(lambda: c.client.exists("configmap", "r-0-lmcache", ns), timeout=60,
                          message="r-0's ConfigMap")
        time.sleep(rng.uniform(0, 1))  # deliberate: a random moment while the others are mid-rollout
        c.stop_component("kube-apiserver", signal.SIGKILL)
        assert etcd_delete(c, f"/registry/configmaps/{ns}/r-0-lmcache") == 1
        # Deliberate downtime (as c.restart's downtime=5 above): the operator's watches break and its writes fail while
        # the API server is away, which is the fault; nothing to wait for but the time.
        time.sleep(3)
        healthy_after = c.start_component("kube-apiserver")
        print(f"kube-apiserver healthy {healthy_after:.1f}s after its restart")
        # r-0 is left alone: no event about it will come; only the relist can tell its ConfigMap is gone.
        for i in range(1, 8):
            want[f"r-{i}"] = {"offload": {"cpu": {"size": f"{2 + i % 4}Gi"}}}
            kvtest.wait_until(lambda i=i: patch_spec(c, ns, f"r-{i}", want[f"r-{i}"]) or True, timeout=60,
                              message=f"patch r-{i}")
        for i in range(8, 10):
            kvtest.wait_until(lambda i=i: create_once(c, ns, f"r-{i}"), timeout=60, message=f"create r-{i}")
            want[f"r-{i}"] = {}
        t0 = time.monotonic()
        stuck = wait_converged(c, ns, want, timeout=60)
        if stuck and all(line.startswith("pod ") or "not Ready" in line or "revisions" in line for line in stuck):
            # kube-scheduler now and then stops seeing new pods after an API server restart (see the test above).
            print("control plane left pods behind (not the operator):\n" + "\n".join(stuck[:10]))
            for comp in ("kube-scheduler", "kwok"):
                c.restart(comp)
        assert_converged(c, ns, want, timeout=90)
        print(f"converged {time.monotonic() - t0:.1f}s after the restart")
        log = op.output()
        assert "relisted ConfigMap" in log, "the broken ConfigMap watch was not followed by a LIST"
        assert f"apply ConfigMap {ns}/r-0-lmcache" in log.split("relisted ConfigMap", 1)[1], \
            "r-0's lost ConfigMap was not re-applied after the relist"
        assert op.proc.poll() is None, "the operator process exited:\n" + log[-3000:]
    finally:
        op.stop()
