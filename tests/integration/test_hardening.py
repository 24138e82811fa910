"""Serving pods as a cluster admin wants them, judged by the real kube-apiserver, scheduler and controllers.

- Pod Security: kube-apiserver's own PodSecurity admission plugin (enabled by default, checked
  here) admits every example without a hostPath in a namespace that enforces "restricted"; the
  hostPath ones are refused there and at "baseline", and admitted at "privileged".
- Spread: replicas of one KVOffloadServe land on distinct kwok nodes, where the scheduler's
  resource scoring alone would stack them on the one big node (the control case proves it).
- NetworkPolicy: rendered, applied and pruned by the operator.
- The node janitor: its manifest is admitted only at "privileged"; its ServiceAccount can get/list
  KVOffloadServes and nothing else, and with that token alone it removes a deleted resource's
  directory, keeps a live one, and in dry-run removes nothing.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from kvoffload.api import crd
from kvoffload.controller import pipeline
from kvoffload.rendering import shared_cache
from kvtest import ROOT, ApiError, OperatorProcess
from kvtest.specs import EXAMPLE_SETTINGS

pytestmark = pytest.mark.cluster

CHART = ROOT / "charts" / "kvoffload-operator"
EXAMPLES = ROOT / "examples"
LEVELS = ("restricted", "baseline", "privileged")


def enforce(cluster, namespace: str, level: str) -> None:
    cluster.client.label("namespace", namespace, {"pod-security.kubernetes.io/enforce": level,
                                                  "pod-security.kubernetes.io/enforce-version": "latest"})


def example(file: str, namespace: str, name: str | None = None) -> dict:
    doc = yaml.safe_load((EXAMPLES / file).read_text())
    doc["metadata"]["namespace"] = namespace
    doc["metadata"]["name"] = name or doc["metadata"]["name"]
    return doc


def with_ephemeral_disk(doc: dict, name: str) -> dict:
    """The same serve with its disk tier on a generic ephemeral volume instead of a hostPath."""
    doc = copy.deepcopy(doc)
    doc["metadata"]["name"] = name
    disk = doc["spec"]["offload"]["disk"]
    doc["spec"]["offload"]["disk"] = {"storageClassName": "local-nvme", "size": disk["size"]}
    return doc


def pod_dry_run(cluster, namespace: str, pod_spec: dict, name: str = "probe") -> str | None:
    """The API server's refusal of the pod (admission, PodSecurity among it, and strict field validation as
    `kubectl create --dry-run=server` asks for), or None when it would admit it. Nothing is stored."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": pod_spec}
    try:
        cluster.client.create(pod, dry_run=True, field_validation="Strict")
    except ApiError as exc:
        return exc.message
    return None


def rendered_pod(doc: dict) -> dict:
    d = pipeline.desired(doc["metadata"]["name"], doc["metadata"]["namespace"], "", doc["spec"], EXAMPLE_SETTINGS)
    return next(c for c in d.children if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]


def shared_server_pod(doc: dict) -> dict:
    """spec.offload.server PerNode: the pod of a node's shared LMCache server (rendered for one node)."""
    d = pipeline.desired(doc["metadata"]["name"], doc["metadata"]["namespace"], "", doc["spec"], EXAMPLE_SETTINGS,
                         nodes=(shared_cache.Node("gpu-node-0"),))
    return next(c for c in d.children if c["kind"] == "Deployment")["spec"]["template"]["spec"]


# --------------------------------------------------------------------------- Pod Security
def test_pod_security_admission_is_enforced_by_the_api_server(cluster, namespace):
    """The harness runs kube-apiserver with its default admission plugins, PodSecurity among them, and
    does not disable it; a namespace label is all it takes to enforce a level."""
    args = cluster.cluster.component_args("kube-apiserver")
    assert not any(a.startswith("--disable-admission-plugins") and "PodSecurity" in a for a in args), args
    assert not any(a.startswith("--admission-control-config-file") for a in args), args
    root_pod = {"containers": [{"name": "c", "image": "busybox:1.36"}]}
    assert pod_dry_run(cluster, namespace, root_pod) is None  # unlabelled: privileged
    enforce(cluster, namespace, "restricted")
    refusal = pod_dry_run(cluster, namespace, root_pod)
    assert refusal is not None and 'violates PodSecurity "restricted:latest"' in refusal, refusal


@pytest.mark.parametrize("level", LEVELS)
def test_every_rendering_is_admitted_exactly_where_the_docs_say(cluster, namespace, level):
    """Pod templates of every example (and the ephemeral-volume form of the hostPath ones) against one level."""
    enforce(cluster, namespace, level)
    cases = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        doc = example(path.name, namespace)
        try:
            pod = rendered_pod(doc)
        except Exception:  # the example the operator refuses renders no pod
            continue
        if doc["spec"]["offload"].get("server") == "PerNode":  # the shared /dev/shm is a hostPath, and no ephemeral L2
            cases += [(path.name, pod, True), (path.name + " (shared server)", shared_server_pod(doc), True)]
            continue
        cases.append((path.name, pod, bool(doc["spec"]["offload"].get("disk", {}).get("path"))))
        if doc["spec"]["offload"].get("disk"):
            eph = with_ephemeral_disk(doc, doc["metadata"]["name"])
            cases.append((path.name + " (storageClassName)", rendered_pod(eph), False))
    # 6 examples render (the field one is refused); 3 have a hostPath disk, also tried as ephemeral volumes; the
    # PerNode one's serving pod and shared server pod are hostPath pods
    assert len(cases) == 10
    for label, pod, host_path in cases:
        refusal = pod_dry_run(cluster, namespace, pod)
        if host_path and level != "privileged":
            assert refusal is not None and "violates PodSecurity" in refusal and "hostPath" in refusal, (label, refusal)
        else:
            assert refusal is None, (label, level, refusal)


def _pods(cluster, namespace: str, name: str) -> list[dict]:
    return cluster.client.list("pods", namespace, labels={"kvoffload.io/serve": name})


def _refusals(cluster, namespace: str, name: str) -> list[str]:
    return [e["message"] for e in cluster.client.list("events", namespace)
            if e.get("reason") == "FailedCreate" and e["involvedObject"]["name"] == name]


def test_examples_through_the_operator_in_a_restricted_namespace(cluster, namespace, crd_installed):
    """Every example without a hostPath, applied through the operator into a namespace enforcing
    "restricted", gets its pods created; the hostPath example's pods are refused by PodSecurity."""
    enforce(cluster, namespace, "restricted")
    cpu = example("cpu-tier-qwen25-7b.yaml", namespace)
    ws = with_ephemeral_disk(example("workstation-llama31-8b.yaml", namespace), "ws-ephemeral")
    tp8 = with_ephemeral_disk(example("tp8-llama33-70b.yaml", namespace), "tp8-ephemeral")
    host = example("tp8-llama33-70b.yaml", namespace, name="tp8-hostpath")
    op = OperatorProcess(cluster.env, [namespace])
    try:
        for doc in (cpu, ws, tp8, host):
            cluster.client.apply(doc)
        admitted = {d["metadata"]["name"]: d["spec"].get("replicas", 1) for d in (cpu, ws, tp8)}

        def all_created():
            counts = {n: len(_pods(cluster, namespace, n)) for n in admitted}
            return counts if counts == admitted else None

        cluster.wait_until(all_created, timeout=120, message=f"pods of {sorted(admitted)} created")
        for name in admitted:
            assert not _refusals(cluster, namespace, name), _refusals(cluster, namespace, name)
            for pod in _pods(cluster, namespace, name):
                assert pod["spec"]["securityContext"]["runAsUser"] == 1000
        refusal = cluster.wait_until(lambda: _refusals(cluster, namespace, "tp8-hostpath"), timeout=60,
                                     message="the hostPath StatefulSet's pod refused")
        assert 'violates PodSecurity "restricted:latest"' in refusal[0] and "hostPath" in refusal[0], refusal
        assert not _pods(cluster, namespace, "tp8-hostpath")
        # The CPU-only pods are bound: their ephemeral-storage requests (weights + caches) fit a node.
        cluster.wait_until(lambda: all(p["spec"].get("nodeName")
                                       for p in _pods(cluster, namespace, cpu["metadata"]["name"])),
                           timeout=60, message="CPU-only pods scheduled")
        pod = _pods(cluster, namespace, cpu["metadata"]["name"])[0]
        vllm = pod["spec"]["containers"][0]
        assert vllm["resources"]["requests"]["ephemeral-storage"] == "30Gi"
    finally:
        op.stop()
        print(op.output()[-3000:])


# --------------------------------------------------------------------------- spread
SPREAD_SERVE = {
    "apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe",
    "spec": {"replicas": 3, "model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxModelLen": 8192},
             "offload": {"cpu": {"size": "8Gi"}}, "resources": {"gpuMemory": "141Gi"}},
}


@pytest.fixture
def spread_nodes(cluster):
    """One big node and two that fit one replica each, tainted so that only this test's pods go there.
    Resource scoring (LeastAllocated, BalancedAllocation) prefers the big node for every pod."""
    tag = uuid.uuid4().hex[:6]
    taint = {"key": "kvoffload.io/spread-test", "value": tag, "effect": "NoSchedule"}
    labels = {"kvoffload.io/spread-test": tag}
    pools = [
        {"name": f"spread-big-{tag}", "count": 1, "labels": labels, "taints": [taint],
         "capacity": {"cpu": "1000", "memory": "64Ti", "pods": "110", "ephemeral-storage": "100Ti",
                      "nvidia.com/gpu": "64"}},
        {"name": f"spread-small-{tag}", "count": 2, "labels": labels, "taints": [taint],
         "capacity": {"cpu": "8", "memory": "64Gi", "pods": "110", "ephemeral-storage": "200Gi",
                      "nvidia.com/gpu": "1"}},
    ]
    names = cluster.cluster.apply_fleet(pools)
    try:
        yield tag, names
    finally:
        cluster.cluster.delete_nodes(names)


def _spread_serve(namespace: str, name: str, tag: str, spread: list | None) -> dict:
    doc = copy.deepcopy(SPREAD_SERVE)
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"]["scheduling"] = {"nodeSelector": {"kvoffload.io/spread-test": tag},
                                 "tolerations": [{"key": "kvoffload.io/spread-test", "operator": "Equal", "value": tag,
                                                  "effect": "NoSchedule"}]}
    if spread is not None:
        doc["spec"]["scheduling"]["topologySpreadConstraints"] = spread
    return doc


def _nodes_of(cluster, namespace: str, name: str, replicas: int):
    def bound():
        pods = _pods(cluster, namespace, name)
        nodes = [p["spec"].get("nodeName") for p in pods]
        return nodes if len(nodes) == replicas and all(nodes) else None
    return cluster.wait_until(bound, timeout=90, message=f"{replicas} pods of {name} bound")


def test_replicas_spread_over_nodes_by_default(cluster, namespace, crd_installed, spread_nodes):
    tag, names = spread_nodes
    op = OperatorProcess(cluster.env, [namespace])
    try:
        # Control, and the override: spread over a label every test node shares (one "zone") instead of
        # hostnames. Any own constraint also replaces the scheduler's built-in default spread, so only
        # the resource scores decide, and they stack every replica on the big node.
        zone = [{"maxSkew": 1, "topologyKey": "kvoffload.io/spread-test", "whenUnsatisfiable": "ScheduleAnyway",
                 "labelSelector": {"matchLabels": {"kvoffload.io/serve": "packed"}}}]
        cluster.client.apply(_spread_serve(namespace, "packed", tag, zone))
        packed = _nodes_of(cluster, namespace, "packed", 3)
        assert packed == [f"spread-big-{tag}-0"] * 3, packed
        cluster.client.delete("kvs", "packed", namespace, wait=True, timeout=60)
        cluster.wait_until(lambda: not _pods(cluster, namespace, "packed"), timeout=90, message="packed pods gone")
        # Default: the soft spread over kubernetes.io/hostname puts each replica on its own node.
        cluster.client.apply(_spread_serve(namespace, "spread", tag, None))
        spread = _nodes_of(cluster, namespace, "spread", 3)
        assert sorted(spread) == sorted(names), spread
        sts = cluster.client.get("statefulset", "spread", namespace)
        (c,) = sts["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert c["whenUnsatisfiable"] == "ScheduleAnyway" and c["topologyKey"] == "kubernetes.io/hostname"
    finally:
        op.stop()
        print(op.output()[-3000:])


# --------------------------------------------------------------------------- NetworkPolicy
def test_network_policy_is_applied_and_pruned(cluster, namespace, crd_installed):
    doc = example("cpu-tier-qwen25-7b.yaml", namespace)
    doc["spec"]["networkPolicy"] = {"servingFrom": ["gateway"], "metricsFrom": ["monitoring"]}
    op = OperatorProcess(cluster.env, [namespace],
                         config={"resyncSeconds": 20, "operatorNamespace": "kvoffload-system"})
    name = doc["metadata"]["name"]
    try:
        cluster.client.apply(doc)
        np = cluster.wait_until(lambda: cluster.client.get_or_none("networkpolicy", name, namespace), timeout=60,
                                message="NetworkPolicy")
        rules = {r["ports"][0]["port"]: r["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"]
                 for r in np["spec"]["ingress"]}
        assert rules == {8000: ["gateway"], 9400: ["kvoffload-system", "monitoring"]}
        assert np["metadata"]["ownerReferences"][0]["kind"] == crd.KIND
        cluster.client.patch("kvs", name, [{"op": "remove", "path": "/spec/networkPolicy"}], namespace, type="json")
        cluster.wait_until(lambda: not cluster.client.exists("networkpolicy", name, namespace),
                           timeout=60, message="NetworkPolicy pruned")
    finally:
        op.stop()
        print(op.output()[-3000:])


# --------------------------------------------------------------------------- the node janitor
def _janitor_docs(cluster, release: str, namespace: str, *extra: str) -> list[dict]:
    out = cluster.helm("template", release, CHART, "--namespace", namespace, "--set", "crds.enabled=false",
                       "--set", "janitor.enabled=true", *extra).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_janitor_manifest_is_admitted_only_at_privileged(cluster, namespace):
    docs = _janitor_docs(cluster, "kvo", namespace)
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"].endswith("-janitor")]
    cluster.client.apply(sa)  # admission looks the pod's ServiceAccount up
    pod = ds["spec"]["template"]["spec"]
    for level in LEVELS:
        enforce(cluster, namespace, level)
        refusal = pod_dry_run(cluster, namespace, pod, name=f"janitor-{level}")
        if level == "privileged":
            assert refusal is None, refusal
        else:
            assert refusal is not None and "violates PodSecurity" in refusal, (level, refusal)
            assert "hostPath" in refusal, refusal
            if level == "baseline":  # baseline allows DAC_OVERRIDE: only the hostPath refuses it there
                assert "DAC_OVERRIDE" not in refusal, refusal


SERVE_STUB = {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe",
              "spec": {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxModelLen": 8192},
                       "offload": {"cpu": {"size": "8Gi"}, "disk": {"path": "/mnt/nvme/lmcache", "size": "10Gi"}}}}
OLD = time.time() - 3600


def _pod_dir(root: Path, ns: str, name: str, uid: str, size: int) -> Path:
    """What kubelet and the init container leave: <root>/lmcache/<ns>/<name>/<name>-0, marked with `uid`."""
    from kvoffload.node import disk_prepare, owner_marker

    parent = root / "lmcache" / ns / name
    parent.mkdir(parents=True, exist_ok=True)
    disk_prepare.prepare_pod_dir(str(parent), owner_marker.Owner(ns, name, f"{name}-0", uid), 1000, 1000)
    d = parent / f"{name}-0"
    (d / "chunk.pt").write_bytes(b"k" * size)
    os.utime(d, (OLD, OLD))
    return d


def _clean(kubeconfig: Path, root: Path, state: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvoffload.cli", "clean-disk", "--kubeconfig", str(kubeconfig),
                           "--root", str(root), "--state", str(state), "-o", "json", *extra],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_janitor_with_its_own_rbac_on_the_real_api_server(cluster, namespace, crd_installed, tmp_path):
    release = f"kvo-{uuid.uuid4().hex[:6]}"
    docs = _janitor_docs(cluster, release, namespace)
    rbac = [d for d in docs if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet")
            and d["metadata"]["name"].endswith("-janitor")]
    assert len(rbac) == 4
    for d in rbac:
        cluster.client.apply(d)
    sa = f"{release}-kvoffload-operator-janitor"
    try:
        # Least privilege: get/list/watch KVOffloadServes, nothing else. can_i without a namespace asks about
        # all namespaces (namespace "", as `kubectl auth can-i --all-namespaces` does).
        who = f"system:serviceaccount:{namespace}:{sa}"
        janitor = cluster.client.as_user(who)
        allowed = {(verb, res): janitor.can_i(verb, res)
                   for verb in ("get", "list", "watch", "delete", "patch")
                   for res in ("kvoffloadserves.kvoffload.io", "secrets", "pods")}
        assert {k for k, v in allowed.items() if v} == {(verb, "kvoffloadserves.kvoffload.io")
                                                        for verb in ("get", "list", "watch")}, allowed
        # The DaemonSet runs on every NVMe-labelled node and on no other.
        nvme = {n["metadata"]["name"] for n in cluster.client.list("nodes", labels={"kvoffload.io/nvme": "true"})}

        def placed():
            pods = cluster.client.list("pods", namespace, labels={"app.kubernetes.io/component": "janitor"})
            nodes = {p["spec"].get("nodeName") for p in pods}
            return nodes if nodes == nvme else None
        cluster.wait_until(placed, timeout=90, message="a janitor pod on each NVMe node")

        # Its logic with its own token: one live and one deleted resource, directories on a temp root. A one-shot
        # run watches nothing: a deletion it did not see has no recorded policy, so --unknown-policy decides.
        token = cluster.client.create_token(sa, namespace, seconds=600)
        kubeconfig = cluster.token_kubeconfig(tmp_path / "janitor.kubeconfig", token, namespace, "janitor")
        uids = {name: cluster.client.apply({**SERVE_STUB, "metadata": {"name": name, "namespace": namespace}})
                ["metadata"]["uid"] for name in ("live", "gone")}
        root, state = tmp_path / "nvme", tmp_path / "state.json"
        live_dir = _pod_dir(root, namespace, "live", uids["live"], 100)
        gone_dir = _pod_dir(root, namespace, "gone", uids["gone"], 4096)
        both_live = _clean(kubeconfig, root, state, "--unknown-policy", "Delete")
        assert both_live.returncode == 0, both_live.stderr
        assert json.loads(both_live.stdout)["bytesFreed"] == 0 and gone_dir.exists()

        cluster.client.delete("kvs", "gone", namespace, wait=True)
        kept = _clean(kubeconfig, root, state)  # no recorded policy: Retain, the default
        assert kept.returncode == 0, kept.stderr
        assert json.loads(kept.stdout)["bytesFreed"] == 0 and (gone_dir / "chunk.pt").exists()
        dry = _clean(kubeconfig, root, state, "--unknown-policy", "Delete", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        report = json.loads(dry.stdout)
        assert report["dryRun"] and report["bytesFreed"] == 4096
        assert gone_dir.exists() and (gone_dir / "chunk.pt").stat().st_size == 4096  # dry-run removes nothing

        real = _clean(kubeconfig, root, state, "--unknown-policy", "Delete")
        assert real.returncode == 0, real.stderr
        assert json.loads(real.stdout)["bytesFreed"] == 4096
        assert not (root / "lmcache" / namespace / "gone").exists()
        assert (live_dir / "chunk.pt").read_bytes() == b"k" * 100

        # A token without the ClusterRole cannot list: the janitor stops with an error, removes nothing.
        cluster.client.delete("clusterrolebinding", sa)
        cluster.wait_until(lambda: not janitor.can_i("list", "kvoffloadserves.kvoffload.io"),
                           timeout=30, message="the binding's removal seen by the authorizer")
        _pod_dir(root, namespace, "gone", uids["gone"], 10)
        denied = _clean(kubeconfig, root, state, "--unknown-policy", "Delete")
        assert (denied.returncode == 2 and "403" in denied.stderr
                and "nothing was removed" in denied.stderr), denied.stderr
        assert (root / "lmcache" / namespace / "gone" / "gone-0" / "chunk.pt").exists()
    finally:
        for kind in ("clusterrolebinding", "clusterrole"):
            # best effort, as the `--ignore-not-found`, unchecked kubectl delete was
            with contextlib.suppress(ApiError):
                cluster.client.delete(kind, sa, missing_ok=True)
