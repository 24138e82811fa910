"""The local Kubernetes control plane (tests/cluster) does what the other tests rely on."""
from __future__ import annotations

import ipaddress
import json
import time
import uuid

import pytest

import kvtest

pytestmark = pytest.mark.cluster

LOOPBACK_NET = ipaddress.ip_network("127.0.0.0/8")
DEFAULT_FLEET = {
    "gpu-node-0": ("8", "NVIDIA-H200"),
    "gpu-node-1": ("8", "NVIDIA-H200"),
    "gpu-node-2": ("8", "NVIDIA-H200"),
    "workstation-0": ("1", "NVIDIA-GeForce-RTX-4090"),
}


def get_json(cluster, *args):
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def condition(obj, ctype):
    for c in obj.get("status", {}).get("conditions", []) or []:
        if c["type"] == ctype:
            return c
    return None


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip) in LOOPBACK_NET


# --------------------------------------------------------------------------- nodes, network
def test_every_node_ready_with_gpu_shape(cluster):
    def all_ready():
        nodes = get_json(cluster, "nodes")["items"]
        names = {n["metadata"]["name"] for n in nodes}
        ok = set(DEFAULT_FLEET) <= names and all(
            (condition(n, "Ready") or {}).get("status") == "True" for n in nodes)
        return nodes if ok else None

    nodes = cluster.wait_until(all_ready, timeout=60, message="every node Ready")
    by_name = {n["metadata"]["name"]: n for n in nodes}
    for name, (gpus, product) in DEFAULT_FLEET.items():
        n = by_name[name]
        assert n["status"]["allocatable"]["nvidia.com/gpu"] == gpus
        assert n["status"]["capacity"]["nvidia.com/gpu"] == gpus
        assert n["metadata"]["labels"]["nvidia.com/gpu.product"] == product
        assert n["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        assert not n["spec"].get("taints"), f"{name} is tainted: {n['spec'].get('taints')}"
    for name in ("gpu-node-0", "gpu-node-1", "gpu-node-2"):
        n = by_name[name]
        assert n["status"]["capacity"]["memory"] == "2Ti"
        assert n["status"]["capacity"]["cpu"] == "192"
        assert n["status"]["capacity"]["pods"] == "110"
        assert n["metadata"]["labels"]["kvoffload.io/nvme"] == "true"
        assert n["metadata"]["labels"]["nvidia.com/gpu.memory"] == "143771"
    ws = by_name["workstation-0"]
    assert ws["status"]["capacity"]["memory"] == "128Gi"
    assert ws["status"]["capacity"]["cpu"] == "32"
    assert ws["metadata"]["labels"]["nvidia.com/gpu.memory"] == "24564"
    assert "kvoffload.io/nvme" not in ws["metadata"]["labels"]


def test_network_rule_everything_is_loopback(cluster, namespace):
    """Listeners bind 127.0.0.1; node, pod-CIDR and service IPs are all in 127.0.0.0/8."""
    st = cluster.cluster.state()
    pids = [r["pid"] for r in st["processes"].values()]
    listeners = kvtest.listening_sockets(pids)
    assert listeners, "no listening sockets found for the cluster's processes"
    assert all(addr == "127.0.0.1" for addr, _, _ in listeners), listeners
    expected = set(st["ports"].values())
    assert {port for _, port, _ in listeners} == expected

    for n in get_json(cluster, "nodes")["items"]:
        for a in n["status"].get("addresses", []):
            if a["type"] in ("InternalIP", "ExternalIP"):
                assert is_loopback(a["address"]), (n["metadata"]["name"], a)
        for cidr in n["spec"].get("podCIDRs", []):
            assert ipaddress.ip_network(cidr).subnet_of(LOOPBACK_NET), cidr

    svc = get_json(cluster, "service", "kubernetes", "-n", "default")
    assert is_loopback(svc["spec"]["clusterIP"]), svc["spec"]["clusterIP"]
    cluster.kubectl("create", "service", "clusterip", "probe", "--tcp=80:8080", "-n", namespace)
    ip = get_json(cluster, "service", "probe", "-n", namespace)["spec"]["clusterIP"]
    assert is_loopback(ip), ip


# --------------------------------------------------------------------------- API server
def test_crd_cel_rule_refuses_bad_object(cluster, namespace):
    group = f"t{uuid.uuid4().hex[:8]}.kvoffload.test"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group, "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget",
                      "listKind": "WidgetList"},
            "versions": [{
                "name": "v1", "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {"spec": {
                        "type": "object",
                        "properties": {"minReplicas": {"type": "integer"},
                                       "maxReplicas": {"type": "integer"}},
                        "x-kubernetes-validations": [{
                            "rule": "self.minReplicas <= self.maxReplicas",
                            "message": "minReplicas must not exceed maxReplicas"}],
                    }},
                }},
            }],
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(crd))
    try:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/widgets.{group}",
                        "--timeout=60s")

        def obj(name, lo, hi):
            return json.dumps({"apiVersion": f"{group}/v1", "kind": "Widget",
                               "metadata": {"name": name, "namespace": namespace},
                               "spec": {"minReplicas": lo, "maxReplicas": hi}})

        # Discovery may lag Established by a moment: retry the good object until it lands.
        cluster.wait_until(
            lambda: cluster.kubectl("create", "-f", "-", input=obj("good", 1, 3),
                                    check=False).returncode == 0,
            timeout=30, message="good Widget accepted")
        bad = cluster.kubectl("create", "-f", "-", input=obj("bad", 5, 2), check=False)
        assert bad.returncode != 0
        assert "minReplicas must not exceed maxReplicas" in bad.stderr, bad.stderr
        assert "Invalid" in bad.stderr, bad.stderr
        names = [i["metadata"]["name"] for i in
                 get_json(cluster, f"widgets.{group}", "-n", namespace)["items"]]
        assert names == ["good"]
    finally:
        cluster.kubectl("delete", "crd", f"widgets.{group}", "--wait=false", check=False)


def test_service_account_token_and_rbac(cluster, namespace, tmp_path):
    token = cluster.kubectl("create", "token", "default", "-n", namespace).stdout.strip()
    assert token.count(".") == 2
    server = cluster.cluster.state()["server"]
    kc = tmp_path / "sa.kubeconfig"
    kc.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "c", "cluster": {
            "server": server, "certificate-authority": str(cluster.cluster.pki / "ca.crt")}}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa"}}],
    }))
    who = cluster.kubectl("--kubeconfig", str(kc), "auth", "whoami", "-o",
                          "jsonpath={.status.userInfo.username}").stdout
    assert who == f"system:serviceaccount:{namespace}:default"
    denied = cluster.kubectl("--kubeconfig", str(kc), "get", "secrets", "-n", namespace,
                             check=False)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr, denied.stderr


# --------------------------------------------------------------------------- scheduling, kwok
def statefulset(name, namespace, requests, limits=None):
    return json.dumps({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "serviceName": name, "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{
                    "name": "main",
                    # Never pulled: kwok runs no containers, it only writes pod status.
                    "image": "registry.invalid/kvoffload/fake:0",
                    "resources": {"requests": requests, "limits": limits or requests},
                }]},
            },
        },
    })


def test_gpu_statefulset_pod_runs_on_gpu_node(cluster, namespace):
    cluster.kubectl("apply", "-f", "-", input=statefulset(
        "gpu", namespace, {"nvidia.com/gpu": "1", "cpu": "1", "memory": "1Gi"}))

    def running():
        cp = cluster.kubectl("get", "pod", "gpu-0", "-n", namespace, "-o", "json", check=False)
        if cp.returncode:
            return None
        pod = json.loads(cp.stdout)
        ready = (condition(pod, "Ready") or {}).get("status") == "True"
        return pod if pod["status"].get("phase") == "Running" and ready else None

    pod = cluster.wait_until(running, timeout=60, message="pod gpu-0 Running and Ready")
    node = get_json(cluster, "node", pod["spec"]["nodeName"])
    assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) >= 1
    assert is_loopback(pod["status"]["podIP"]), pod["status"]["podIP"]
    assert is_loopback(pod["status"]["hostIP"]), pod["status"]["hostIP"]
    cluster.wait_until(
        lambda: get_json(cluster, "statefulset", "gpu", "-n", namespace)["status"]
        .get("readyReplicas") == 1, timeout=60, message="StatefulSet gpu readyReplicas=1")


def test_pod_larger_than_any_node_stays_pending(cluster, namespace):
    cluster.kubectl("apply", "-f", "-", input=statefulset(
        "huge", namespace, {"memory": "4Ti", "cpu": "1"}))

    def unschedulable():
        cp = cluster.kubectl("get", "pod", "huge-0", "-n", namespace, "-o", "json", check=False)
        if cp.returncode:
            return None
        pod = json.loads(cp.stdout)
        c = condition(pod, "PodScheduled")
        return pod if c and c["status"] == "False" and c.get("reason") == "Unschedulable" else None

    pod = cluster.wait_until(unschedulable, timeout=60, message="huge-0 PodScheduled=False")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")
    assert "Insufficient memory" in condition(pod, "PodScheduled")["message"]


# --------------------------------------------------------------------------- controllers
def test_garbage_collector_deletes_owned_configmap(cluster, namespace):
    cluster.kubectl("create", "configmap", "owner", "-n", namespace, "--from-literal=a=1")
    uid = get_json(cluster, "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "child", "namespace": namespace, "ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}]},
        "data": {"b": "2"},
    }))
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)
    cluster.wait_until(
        lambda: cluster.kubectl("get", "configmap", "child", "-n", namespace,
                                check=False).returncode != 0,
        timeout=60, message="garbage collection of ConfigMap child")
    assert "NotFound" in cluster.kubectl("get", "configmap", "child", "-n", namespace,
                                         check=False).stderr


# --------------------------------------------------------------------------- versions
def test_versions(cluster):
    assert cluster.helm("version", "--template", "{{.Version}}").stdout.strip() == "v4.3.1"
    assert "v4.3.1" in cluster.helm("version").stdout
    v = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert v["clientVersion"]["gitVersion"] == "v1.37.1"
    assert v["serverVersion"]["gitVersion"] == "v1.37.2"
    assert (v["serverVersion"]["major"], v["serverVersion"]["minor"]) == ("1", "37")


# --------------------------------------------------------------------------- lifecycle
def test_second_cluster_starts_fast_and_down_leaves_nothing(cluster, tmp_path):
    """A throwaway cluster in its own state dir: up from cache, then down leaves no trace."""
    c2 = kvtest.Cluster(dir=tmp_path / "c2", bin=cluster.bin)
    t0 = time.monotonic()
    try:
        assert c2.up(kvtest.make_fleet(gpu_nodes=2, workstations=0)) is True
        elapsed = time.monotonic() - t0
        assert c2.up() is False  # reuses the running one
        assert c2.ready_nodes() == {"gpu-node-0", "gpu-node-1"}
        st = c2.state()
        pids = [r["pid"] for r in st["processes"].values()]
        ports = set(st["ports"].values())
        assert elapsed < 60, f"start from cache took {elapsed:.1f}s"
    finally:
        problems = c2.down()
    assert problems == []
    for pid in pids:
        s = kvtest.proc_stat(pid)
        assert s is None or s[0] in ("Z", "X"), f"pid {pid} survived down: {s}"
    bound = {p for _, p, _ in kvtest.listening_sockets()}
    assert not ports & bound, f"ports still bound after down: {ports & bound}"
    assert c2.running() is False


def test_service_endpoints_refused_for_loopback_pod_ips(cluster, namespace):
    """The price of the network rule: pod IPs are loopback, and the API server refuses
    loopback addresses in EndpointSlices, so a Service never gets endpoints and nothing
    (not even the apiserver resolving a webhook Service) can dial a pod."""
    cluster.kubectl("create", "deployment", "web", "--image=registry.invalid/kvoffload/fake:0",
                    "-n", namespace)
    cluster.kubectl("expose", "deployment", "web", "--port=80", "-n", namespace)
    cluster.wait_until(
        lambda: cluster.kubectl("get", "pods", "-n", namespace, "-l", "app=web", "-o",
                                "jsonpath={.items[*].status.phase}").stdout == "Running",
        timeout=60, message="web pod Running")

    def refused():
        events = get_json(cluster, "events", "-n", namespace,
                          "--field-selector", "reason=FailedToUpdateEndpointSlices")["items"]
        return [e for e in events if "loopback" in e["message"]]

    cluster.wait_until(refused, timeout=60, message="FailedToUpdateEndpointSlices event")
    slices = get_json(cluster, "endpointslices", "-n", namespace,
                      "-l", "kubernetes.io/service-name=web")["items"]
    assert all(not s.get("endpoints") for s in slices), slices
