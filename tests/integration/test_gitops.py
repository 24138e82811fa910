"""GitOps readers of a KVOffloadServe on the real control plane.

- kstatus (github.com/fluxcd/cli-utils at the version Helm v4.3.1 waits with; Flux uses the same
  rules) on live objects: Ready -> Current, invalid -> Failed, rolling out / just created /
  operator behind -> InProgress, being deleted -> Terminating;
- Argo CD's health (charts/kvoffload-operator/argocd/health.lua on gopher-lua) on the same live
  objects, which are also the checked-in fixtures of the Argo CD test table: this test re-captures
  them and compares their shape (KVO_CAPTURE_GITOPS_FIXTURES=1 rewrites them);
- `helm install --wait` fails fast on an invalid spec and returns only once a valid one is Ready;
- Events: one per transition, none for a no-op reconcile;
- `kubectl kvs why` through kubectl's plugin mechanism.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from kvtest import ROOT, OperatorProcess, condition
from kvtest import gitops as gt
from kvtest.specs import serve

pytestmark = pytest.mark.cluster

BAD_PATH = "/etc/lmcache"  # the API server accepts it; the operator refuses it (outside the allowed roots)
WAIT_CHART = ROOT / "tests/gitops/wait-chart"
CRASH_LOOP = {  # a pod status as kubelet writes it for a container in a crash loop
    "conditions": [{"type": t, "status": s} for t, s in (("PodScheduled", "True"), ("Initialized", "True"),
                                                         ("ContainersReady", "False"), ("Ready", "False"))],
    "containerStatuses": [{"name": "vllm", "ready": False, "restartCount": 5, "image": "lmcache/vllm-openai:v0.5.4",
                           "imageID": "", "started": False,
                           "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
                           "state": {"waiting": {"reason": "CrashLoopBackOff",
                                                 "message": "back-off 2m40s restarting failed container=vllm"}}}],
}


def wait_for(cluster, ns, name, pred, message, timeout=120):
    return cluster.wait_until(lambda: (o := cluster.client.get_or_none("kvs", name, ns)) is not None and pred(o) and o,
                              timeout=timeout, message=f"{name}: {message}")


def at_generation(o, type_, status, reason=None):
    c = condition(o, type_)
    return (c.get("status") == status and c.get("observedGeneration") == o["metadata"]["generation"]
            and (reason is None or c.get("reason") == reason))


def ready(o):
    return at_generation(o, "Ready", "True") and o["status"].get("observedGeneration") == o["metadata"]["generation"]


def kstatus(cluster, ns, *names) -> dict[str, dict]:
    cp = subprocess.run([gt.tools()["kstatus-check"], "-kubeconfig", str(cluster.kubeconfig), "-n", ns, *names],
                        capture_output=True, text=True, check=True, timeout=60)
    return {v["name"]: v for v in map(json.loads, cp.stdout.splitlines())}


@pytest.fixture(scope="module")
def captured(cluster, crd_installed):
    """Live objects in every state a GitOps reader must tell apart, each read (object, kstatus,
    Argo CD health) at the moment it is in that state."""
    ns = f"t-gitops-capture-{os.getpid()}"
    cluster.client.namespace(ns)  # and its default ServiceAccount
    states: dict[str, dict] = {}

    def snap(state: str, name: str) -> None:
        verdict = kstatus(cluster, ns, name)[name]
        obj = cluster.client.get("kvs", name, ns)
        states[state] = {"object": obj, "kstatus": verdict, "argocd": gt.lua_health([obj])[0], "namespace": ns}

    objects = {"ready": serve("ready"), "invalid": serve("invalid", offload__disk={"path": BAD_PATH, "size": "100Gi"}),
               "unschedulable": serve("unschedulable", offload__cpu={"size": "3Ti"}),  # nodes have at most 2 TiB
               "scaled-to-zero": serve("scaled-to-zero", replicas=0), "rolling-out": serve("rolling-out"),
               "operator-behind": serve("operator-behind"), "just-created": serve("just-created"),
               "pods-failing": serve("pods-failing")}
    proc = None
    try:
        for obj in objects.values():  # the operator is not running yet: nothing writes a status
            cluster.client.apply(obj, ns)
        snap("just-created", "just-created")

        proc = OperatorProcess(cluster.env, [ns])
        for name in ("ready", "scaled-to-zero", "rolling-out", "operator-behind", "just-created", "pods-failing"):
            wait_for(cluster, ns, name, ready, "Ready")
        wait_for(cluster, ns, "invalid", lambda o: at_generation(o, "Stalled", "True"), "Stalled")
        wait_for(cluster, ns, "unschedulable", lambda o: at_generation(o, "Scheduled", "False", "Unschedulable"),
                 "Unschedulable")
        for state in ("ready", "invalid", "unschedulable", "scaled-to-zero"):
            snap(state, state)

        # Pods failing: kwok runs no container, so this test writes what kubelet would for a crash loop.
        cluster.client.patch("pod", "pods-failing-0", {"status": CRASH_LOOP}, ns, subresource="status")
        wait_for(cluster, ns, "pods-failing", lambda o: at_generation(o, "Ready", "False", "PodsFailing"),
                 "PodsFailing")
        snap("pods-failing", "pods-failing")

        # Rolling out: with kube-controller-manager stopped the StatefulSet controller cannot act on
        # the new template, so the operator reports the rollout pending for as long as we look.
        cluster.cluster.stop_component("kube-controller-manager")
        try:
            cluster.client.apply(serve("rolling-out", offload__cpu={"size": "24Gi"}), ns)
            wait_for(cluster, ns, "rolling-out", lambda o: at_generation(o, "Ready", "False", "RollingOut"),
                     "RollingOut")
            snap("rolling-out", "rolling-out")
        finally:
            cluster.cluster.start_component("kube-controller-manager")
        wait_for(cluster, ns, "rolling-out", ready, "Ready after the rollout")

        # Operator behind: a new generation the operator has not seen (it is stopped).
        proc.stop()
        proc = None
        cluster.client.apply(serve("operator-behind", offload__cpu={"size": "24Gi"}), ns)
        snap("operator-behind", "operator-behind")

        # Being deleted: a finalizer of ours holds the object in deletion.
        cluster.client.patch("kvs", "ready", {"metadata": {"finalizers": ["example.com/hold"]}}, ns)
        cluster.client.delete("kvs", "ready", ns)
        wait_for(cluster, ns, "ready", lambda o: "deletionTimestamp" in o["metadata"], "deletionTimestamp")
        snap("being-deleted", "ready")
        cluster.client.patch("kvs", "ready", {"metadata": {"finalizers": None}}, ns)
        cluster.wait_until(lambda: not cluster.client.exists("kvs", "ready", ns), timeout=30, message="ready deleted")
        yield states
    finally:
        if proc is not None:
            proc.stop()
            print(proc.output()[-3000:])
        cluster.client.delete("namespace", ns, missing_ok=True)


KSTATUS = {"pods-failing": "InProgress",
           "ready": "Current", "invalid": "Failed", "unschedulable": "InProgress", "scaled-to-zero": "Current",
           "rolling-out": "InProgress", "operator-behind": "InProgress", "just-created": "InProgress",
           "being-deleted": "Terminating"}


@pytest.mark.parametrize("state", sorted(KSTATUS))
def test_kstatus_reads_each_state(captured, state):
    verdict = captured[state]["kstatus"]
    assert verdict["status"] == KSTATUS[state], verdict
    if state == "invalid":  # Stalled's reason and message come from ConfigValid: the field and the allowed roots
        assert verdict["conditions"][0]["reason"] == "InvalidSpec" and "spec.offload.disk.path" in verdict["message"]
    if state == "just-created":  # the CRD's status default: "generation 1 not observed", not "no status: current"
        assert captured[state]["object"]["status"] == {"observedGeneration": 0}


def test_argocd_health_on_live_objects_matches_the_table(captured):
    table = yaml.safe_load(gt.TABLE.read_text())["tests"]
    expected = {Path(t["inputPath"]).stem: t["healthStatus"] for t in table}
    assert set(expected) == set(captured) - {"being-deleted"}
    for state, want in expected.items():
        assert captured[state]["argocd"]["status"] == want["status"], (state, captured[state]["argocd"])


def test_fixtures_are_live_captures(captured):
    """The checked-in fixtures have the shape the API server and operator produce today."""
    if os.environ.get("KVO_CAPTURE_GITOPS_FIXTURES") == "1":
        for state, got in captured.items():
            if state != "being-deleted":
                gt.write_fixture(state, gt.normalize(got["object"], got["namespace"]))
    for state, got in captured.items():
        if state == "being-deleted":
            continue
        live = gt.normalize(got["object"], got["namespace"])
        assert gt.shape(live) == gt.shape(gt.read_fixture(state)), (
            f"{state}: re-capture (KVO_CAPTURE_GITOPS_FIXTURES=1)")


# --- helm install --wait (Helm v4: kstatus watcher) -----------------------------------------------

def helm_install(cluster, ns, release, timeout_s, **values):
    args = ["install", release, str(WAIT_CHART), "-n", ns, "--wait=watcher", "--timeout", f"{timeout_s}s"]
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    t0 = time.monotonic()
    cp = cluster.helm(*args, check=False, timeout=timeout_s + 60)
    return cp, time.monotonic() - t0


def test_helm_wait_fails_fast_on_an_invalid_spec(cluster, namespace, operator):
    timeout = 120
    cp, took = helm_install(cluster, namespace, "bad", timeout, name="bad", diskPath=BAD_PATH)
    print("helm install --wait of an invalid KVOffloadServe: exit "
          f"{cp.returncode} after {took:.1f}s (timeout {timeout}s)")
    assert cp.returncode != 0
    assert took < timeout / 4, f"took {took:.1f}s of a {timeout}s timeout"
    assert "status: Failed" in cp.stderr and "spec.offload.disk.path" in cp.stderr, cp.stderr


def test_helm_wait_returns_once_ready(cluster, namespace, operator):
    cp, took = helm_install(cluster, namespace, "good", 180, name="good")
    print(f"helm install --wait of a valid KVOffloadServe: exit {cp.returncode} after {took:.1f}s")
    assert cp.returncode == 0, cp.stderr
    obj = cluster.client.get("kvs", "good", namespace)  # read right after helm returned
    assert ready(obj), obj.get("status")


# --- Events ----------------------------------------------------------------------------------------

def test_one_event_per_transition_none_for_a_no_op(cluster, namespace, crd_installed):
    """reconcile in this process (no operator running): each call is one reconcile we can count."""
    from kvoffload.api.settings import Settings
    from kvoffload.controller import events as ev
    from kvoffload.controller.kube import Kube
    from kvoffload.controller.reconcile import reconcile

    kube = Kube(cluster.api_client())
    recorder = ev.Recorder(lambda ns, body: kube.request("POST", f"/api/v1/namespaces/{ns}/events", body))
    settings = dataclasses.replace(Settings(), probe_exporters=False)

    def ours():
        uid = cluster.client.get("kvs", "svc", namespace)["metadata"]["uid"]
        items = cluster.client.list("events", namespace)
        return [e["reason"] for e in items if e["involvedObject"].get("uid") == uid]

    cluster.client.apply(serve("svc", offload__disk={"path": BAD_PATH, "size": "100Gi"}), namespace)
    assert reconcile(kube, namespace, "svc", settings, recorder=recorder) == "invalid"
    assert ours() == ["SpecRefused"]
    assert reconcile(kube, namespace, "svc", settings, recorder=recorder) == "unchanged"
    assert ours() == ["SpecRefused"]

    cluster.client.apply(serve("svc"), namespace)
    outcomes = [reconcile(kube, namespace, "svc", settings, recorder=recorder)]
    cluster.wait_until(lambda: outcomes.append(reconcile(kube, namespace, "svc", settings, recorder=recorder))
                       or ready(cluster.client.get("kvs", "svc", namespace)), timeout=120, message="Ready")
    story = ours()
    assert sorted(story) == sorted(["SpecRefused", "SpecAccepted", "Applied", "Scheduled", "Ready"]), story
    assert reconcile(kube, namespace, "svc", settings, recorder=recorder) == "unchanged"
    assert reconcile(kube, namespace, "svc", settings, recorder=recorder) == "unchanged"
    assert sorted(ours()) == sorted(story)
    described = cluster.kubectl("describe", "kvs", "svc", "-n", namespace).stdout  # kubectl under test: describe
    assert "SpecRefused" in described and "kvoffload-operator" in described


# --- kubectl kvs ----------------------------------------------------------------------------------

def kubectl_kvs(cluster, *args):
    """kubectl under test: our plugin found and run through kubectl's plugin mechanism."""
    from kvtest.paths import kubectl_path

    env = {**cluster.env, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([kubectl_path(), "kvs", *args], env=env, capture_output=True, text=True, timeout=120)


def test_kubectl_kvs_why_explains_in_plain_words(cluster, namespace, operator):
    cluster.client.apply(serve("bad", offload__disk={"path": BAD_PATH, "size": "100Gi"}), namespace)
    cluster.client.apply(serve("good"), namespace)
    wait_for(cluster, namespace, "bad", lambda o: at_generation(o, "Stalled", "True"), "Stalled")
    wait_for(cluster, namespace, "good", ready, "Ready")

    bad = kubectl_kvs(cluster, "why", "bad", "-n", namespace)
    assert bad.returncode == 0, bad.stderr
    assert "Refused: the operator cannot act on this spec." in bad.stdout
    assert "spec.offload.disk.path" in bad.stdout and "kstatus) read: Failed" in bad.stdout
    assert "Warning  SpecRefused: KVOffloadServe bad" in bad.stdout and "No StatefulSet" in bad.stdout

    good = kubectl_kvs(cluster, "why", "good", "-n", namespace)
    assert good.returncode == 0, good.stderr
    assert "Ready: 1/1 replicas ready and up to date." in good.stdout and "read: Current" in good.stdout
    assert "StatefulSet good: 1/1 ready" in good.stdout and "pod good-0: Running on gpu-node-" in good.stdout
    assert "Normal   Ready: KVOffloadServe good" in good.stdout and "KV cache per replica: gpu" in good.stdout

    missing = kubectl_kvs(cluster, "why", "nope", "-n", namespace)
    assert missing.returncode == 1 and "not found" in missing.stderr

    plan = kubectl_kvs(cluster, "plan", "--model", "Qwen/Qwen2.5-7B-Instruct", "--cpu-size", "16Gi")
    assert plan.returncode == 0 and "cpu" in plan.stdout
    rendered = kubectl_kvs(cluster, "render", "-f", str(ROOT / "examples/cpu-tier-qwen25-7b.yaml"))
    assert rendered.returncode == 0 and "kind: StatefulSet" in rendered.stdout


# --- the first status ------------------------------------------------------------------------------

def test_every_version_before_ready_reads_in_progress(cluster, namespace, operator):
    """Every version of the object, from a watch, until Ready: as created it holds only the CRD's status default,
    and kstatus and Argo CD read each version before Ready as in progress, so the operator writes no first-sight
    status before it applies anything (tests/unit/test_first_status.py compares the two offline)."""
    versions: list[dict] = []
    since = cluster.client.list_raw("kvs", namespace)["metadata"]["resourceVersion"]
    t0 = time.monotonic()
    cluster.client.apply(serve("svc"), namespace)
    # From before the create: every version, none missed.
    for _type, obj in cluster.client.watch("kvs", namespace, resource_version=since, timeout=60):
        versions.append(obj)
        if (obj.get("status") or {}).get("conditions") and len([v for v in versions
                                                                if v.get("status", {}).get("conditions")]) == 1:
            print(f"first status {time.monotonic() - t0:.2f}s after the apply started")
        if ready(obj):
            break
    assert ready(versions[-1])
    assert versions[0]["status"] == {"observedGeneration": 0}  # as created: the CRD's default, no conditions
    first = next(v for v in versions if (v.get("status") or {}).get("conditions"))
    assert condition(first, "Reconciling")["status"] == "True" and first["status"]["observedGeneration"] == 0
    before = versions[:-1]
    assert [gt.kstatus_file(v)["status"] for v in before] == ["InProgress"] * len(before), before
    assert [h["status"] for h in gt.lua_health(before)] == ["Progressing"] * len(before), before
    assert gt.kstatus_file(versions[-1])["status"] == "Current"
    assert gt.lua_health(versions[-1:])[0]["status"] == "Healthy"
