"""The local Kubernetes control plane (tests/cluster) does what the other tests rely on."""
from __future__ import annotations

import ipaddress
import json
import re
import time
import uuid

import pytest

import kvtest
from kvtest import ApiError, condition

pytestmark = pytest.mark.cluster

LOOPBACK_NET = ipaddress.ip_network("127.0.0.0/8")
DEFAULT_FLEET = {
    "gpu-node-0": ("8", "NVIDIA-H200"),
    "gpu-node-1": ("8", "NVIDIA-H200"),
    "gpu-node-2": ("8", "NVIDIA-H200"),
    "workstation-0": ("1", "NVIDIA-GeForce-RTX-4090"),
}


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip) in LOOPBACK_NET


# --------------------------------------------------------------------------- nodes, network
def test_every_node_ready_with_gpu_shape(cluster):
    def all_ready():
        nodes = cluster.client.list("nodes")
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

    c = cluster.client
    for n in c.list("nodes"):
        for a in n["status"].get("addresses", []):
            if a["type"] in ("InternalIP", "ExternalIP"):
                assert is_loopback(a["address"]), (n["metadata"]["name"], a)
        for cidr in n["spec"].get("podCIDRs", []):
            assert ipaddress.ip_network(cidr).subnet_of(LOOPBACK_NET), cidr

    svc = c.get("service", "kubernetes", "default")
    assert is_loopback(svc["spec"]["clusterIP"]), svc["spec"]["clusterIP"]
    c.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "probe", "namespace": namespace},
              "spec": {"type": "ClusterIP", "selector": {"app": "probe"},
                       "ports": [{"name": "80-8080", "port": 80, "targetPort": 8080}]}})
    ip = c.get("service", "probe", namespace)["spec"]["clusterIP"]
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
    c = cluster.client
    c.apply(crd)
    try:
        c.established(f"widgets.{group}", timeout=60)

        def obj(name, lo, hi):
            return {"apiVersion": f"{group}/v1", "kind": "Widget",
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {"minReplicas": lo, "maxReplicas": hi}}

        # Discovery may lag Established by a moment: retry the good object until it lands.
        cluster.wait_until(lambda: c.create(obj("good", 1, 3)), timeout=30, message="good Widget accepted")
        with pytest.raises(ApiError) as bad:
            c.create(obj("bad", 5, 2))
        assert "minReplicas must not exceed maxReplicas" in bad.value.message, bad.value
        assert bad.value.reason == "Invalid", bad.value
        names = [i["metadata"]["name"] for i in c.list(f"widgets.{group}", namespace)]
        assert names == ["good"]
    finally:
        c.delete("crd", f"widgets.{group}", missing_ok=True)


def test_service_account_token_and_rbac(cluster, namespace):
    token = cluster.client.create_token("default", namespace)
    assert token.count(".") == 2
    sa = cluster.client.as_token(token)
    review = sa.create({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})  # `auth whoami`
    assert review["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:default"
    with pytest.raises(ApiError) as denied:
        sa.list("secrets", namespace)
    assert denied.value.status == 403 and denied.value.reason == "Forbidden", denied.value


# --------------------------------------------------------------------------- scheduling, kwok
def statefulset(name, namespace, requests, limits=None):
    return {
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
    }


def test_gpu_statefulset_pod_runs_on_gpu_node(cluster, namespace):
    c = cluster.client
    c.apply(statefulset("gpu", namespace, {"nvidia.com/gpu": "1", "cpu": "1", "memory": "1Gi"}))

    def running():
        pod = c.get_or_none("pod", "gpu-0", namespace)
        if pod is None:
            return None
        ready = (condition(pod, "Ready") or {}).get("status") == "True"
        return pod if pod["status"].get("phase") == "Running" and ready else None

    pod = cluster.wait_until(running, timeout=60, message="pod gpu-0 Running and Ready")
    node = c.get("node", pod["spec"]["nodeName"])
    assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) >= 1
    assert is_loopback(pod["status"]["podIP"]), pod["status"]["podIP"]
    assert is_loopback(pod["status"]["hostIP"]), pod["status"]["hostIP"]
    cluster.wait_until(lambda: c.get("statefulset", "gpu", namespace)["status"].get("readyReplicas") == 1,
                       timeout=60, message="StatefulSet gpu readyReplicas=1")


def test_pod_larger_than_any_node_stays_pending(cluster, namespace):
    cluster.client.apply(statefulset("huge", namespace, {"memory": "4Ti", "cpu": "1"}))

    def unschedulable():
        pod = cluster.client.get_or_none("pod", "huge-0", namespace)
        if pod is None:
            return None
        c = condition(pod, "PodScheduled")
        return pod if c and c["status"] == "False" and c.get("reason") == "Unschedulable" else None

    pod = cluster.wait_until(unschedulable, timeout=60, message="huge-0 PodScheduled=False")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")
    assert "Insufficient memory" in condition(pod, "PodScheduled")["message"]


# --------------------------------------------------------------------------- controllers
def test_garbage_collector_deletes_owned_configmap(cluster, namespace):
    c = cluster.client
    c.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner", "namespace": namespace},
              "data": {"a": "1"}})
    uid = c.get("configmap", "owner", namespace)["metadata"]["uid"]
    c.apply({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "child", "namespace": namespace, "ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}]},
        "data": {"b": "2"},
    })
    c.delete("configmap", "owner", namespace)
    cluster.wait_until(lambda: not c.exists("configmap", "child", namespace),
                       timeout=60, message="garbage collection of ConfigMap child")
    with pytest.raises(ApiError) as gone:
        c.get("configmap", "child", namespace)
    assert gone.value.status == 404 and gone.value.reason == "NotFound", gone.value


# --------------------------------------------------------------------------- versions
def test_versions(cluster):
    assert cluster.helm("version", "--template", "{{.Version}}").stdout.strip() == "v4.3.1"
    assert "v4.3.1" in cluster.helm("version").stdout
    v = json.loads(cluster.kubectl("version", "-o", "json").stdout)  # kubectl under test: its version and the server's
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
    c = cluster.client
    web = {"app": "web"}
    c.create({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": namespace,
                                                                          "labels": web},
              "spec": {"replicas": 1, "selector": {"matchLabels": web}, "template": {
                  "metadata": {"labels": web},
                  "spec": {"containers": [{"name": "fake", "image": "registry.invalid/kvoffload/fake:0"}]}}}})
    c.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": namespace, "labels": web},
              "spec": {"selector": web, "ports": [{"port": 80, "targetPort": 80, "protocol": "TCP"}]}})
    cluster.wait_until(
        lambda: [p["status"].get("phase") for p in c.list("pods", namespace, labels=web)] == ["Running"],
        timeout=60, message="web pod Running")

    def refused():
        events = c.list("events", namespace, fields="reason=FailedToUpdateEndpointSlices")
        return [e for e in events if "loopback" in e["message"]]

    cluster.wait_until(refused, timeout=60, message="FailedToUpdateEndpointSlices event")
    slices = c.list("endpointslices", namespace, labels={"kubernetes.io/service-name": "web"})
    assert all(not s.get("endpoints") for s in slices), slices


# --------------------------------------------------------------------------- the tests' API client
def configmap(name, namespace, data, labels=None):
    meta = {"name": name, "namespace": namespace, **({"labels": labels} if labels else {})}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def test_client_resolves_names_as_kubectl_does(cluster, crd_installed):
    """Each kubectl-style name reaches the same collection kubectl lists (its own request log shows the
    URL), and every name `kubectl api-resources -o name` prints resolves back to itself."""
    c = cluster.client
    # kubectl under test: the resource names it knows, and which URL it resolves a name to
    listed = set(cluster.kubectl("api-resources", "-o", "name").stdout.split())
    assert "kvoffloadserves.kvoffload.io" in listed
    for full in sorted(listed):
        r = c.resource(full)
        assert (f"{r.plural}.{r.group}" if r.group else r.plural) == full
    for name in ("kvs", "kvoffloadserve", "kvoffloadserves.kvoffload.io", "po", "pods", "no", "svc", "sa",
                 "cm", "ev", "events", "deploy", "statefulset.apps", "sts", "pdb", "netpol", "crd",
                 "leases"):
        r = c.resource(name)
        assert (f"{r.plural}.{r.group}" if r.group else r.plural) in listed, name
        log = cluster.kubectl("get", name, "--all-namespaces", "-o", "name", "-v=6").stderr  # kubectl under test
        urls = re.findall(r"https://127\.0\.0\.1:\d+(/[^?\"\s]+)", log)
        assert r.path() in urls, (name, r.path(), urls)


def test_client_missing_object_is_a_404_with_the_servers_message(cluster, namespace):
    c = cluster.client
    with pytest.raises(ApiError) as missing:
        c.get("configmap", "absent", namespace)
    assert missing.value.status == 404 and missing.value.reason == "NotFound"
    assert missing.value.message == 'configmaps "absent" not found'
    assert c.get_or_none("configmap", "absent", namespace) is None
    assert c.exists("configmap", "absent", namespace) is False


def test_client_server_side_apply_is_idempotent_and_refuses_a_second_manager(cluster, namespace):
    c = cluster.client
    obj = configmap("ssa", namespace, {"a": "1"})
    first = c.apply(obj)
    again = c.apply(obj)
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]  # nothing written
    assert [m["manager"] for m in again["metadata"]["managedFields"]] == ["kvtest"]
    with pytest.raises(ApiError) as conflict:
        c.apply(configmap("ssa", namespace, {"a": "2"}), manager="someone-else", force=False)
    assert conflict.value.status == 409 and conflict.value.reason == "Conflict"
    assert conflict.value.message == 'Apply failed with 1 conflict: conflict with "kvtest": .data.a', conflict.value
    assert c.get("configmap", "ssa", namespace)["data"] == {"a": "1"}
    taken = c.apply(configmap("ssa", namespace, {"a": "2"}), manager="someone-else", force=True)
    assert taken["data"] == {"a": "2"}


def test_client_watch_from_a_lists_resource_version(cluster, namespace):
    c = cluster.client
    mine = {"kvtest.io/watch": "yes"}
    c.create(configmap("before", namespace, {"a": "0"}, mine))
    rv = c.list_raw("configmaps", namespace, labels="kvtest.io/watch=yes")["metadata"]["resourceVersion"]
    c.create(configmap("after", namespace, {"a": "1"}, mine))
    events = c.watch("configmaps", namespace, resource_version=rv, labels="kvtest.io/watch=yes", timeout=30)
    try:
        added = next(events)  # created after the list: replayed from its resourceVersion
        c.patch("configmap", "after", {"data": {"a": "2"}}, namespace)
        modified = next(events)  # changed while watching: delivered live
    finally:
        events.close()
    assert (added[0], added[1]["metadata"]["name"], added[1]["data"]) == ("ADDED", "after", {"a": "1"})
    assert (modified[0], modified[1]["metadata"]["name"], modified[1]["data"]) == ("MODIFIED", "after", {"a": "2"})


def test_client_can_i_matches_rbac(cluster, namespace):
    c = cluster.client
    sa = c.as_token(c.create_token("default", namespace))
    assert sa.can_i("list", "configmaps", namespace) is False  # nothing grants it yet
    c.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": "cm-reader", "namespace": namespace},
             "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}]})
    c.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "cm-reader", "namespace": namespace},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm-reader"},
             "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}]})
    cluster.wait_until(lambda: sa.can_i("list", "configmaps", namespace), timeout=30, message="Role bound")
    assert sa.can_i("get", "configmaps", namespace, name="kube-root-ca.crt") is True
    assert sa.can_i("delete", "configmaps", namespace) is False
    assert sa.can_i("list", "secrets", namespace) is False
    assert sa.can_i("list", "configmaps", "default") is False  # a Role binds in its namespace only
    assert c.as_user(f"system:serviceaccount:{namespace}:default").can_i("list", "configmaps", namespace) is True
    # ... and the API server acts on the same decision.
    assert isinstance(sa.list("configmaps", namespace), list)
    with pytest.raises(ApiError) as denied:
        sa.list("secrets", namespace)
    assert denied.value.status == 403
