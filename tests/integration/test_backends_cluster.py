"""spec.offload.backend on the real control plane: the API server's CEL rules, each backend reconciled
to Ready with its conditions, and switching backend on a live resource as a rolling change (which pod
objects and volumes survive it)."""

from __future__ import annotations

import copy

import pytest

from kvtest import ApiError, condition
from kvtest.specs import PAIR, children_by_name, wait_ready
from kvtest.specs import serve as _serve

pytestmark = pytest.mark.cluster

def serve(name: str, backend: str, disk: bool = True) -> dict:
    return _serve(name, **PAIR, offload__backend=backend, **({} if disk else {"offload__disk": None}))


@pytest.mark.parametrize("obj, needle", [
    (serve("bad", "vllm-native"), "spec.offload.disk: Invalid value"),
    (serve("bad", "vllm-native"), "CPU tier only"),
    ({**serve("bad", "lmcache-server"), "spec": {**serve("bad", "lmcache-server")["spec"], "offload": {
        "backend": "lmcache-server", "cpu": {"size": "16Gi", "evictionPolicy": "LFU"}}}},
     "spec.offload.cpu.evictionPolicy"),
    (serve("bad", "redis"), 'spec.offload.backend: Unsupported value: "redis"'),
    # Fields a backend cannot honour (backends/*.refuses), refused by the generated CEL rules as by spec.parse.
    ({**serve("bad", "vllm-native", disk=False),
      "spec": {**serve("bad", "vllm-native", disk=False)["spec"], "offload": {
          "backend": "vllm-native", "chunkSize": 512, "cpu": {"size": "16Gi"}}}},
     "spec.offload.chunkSize: Invalid value"),
    ({**serve("bad", "lmcache"), "spec": {**serve("bad", "lmcache")["spec"], "resources": {
        "gpuMemory": "141Gi", "serverBaseline": "3Gi"}}}, "spec.resources.serverBaseline: Invalid value"),
])
def test_api_server_refuses_what_a_backend_cannot_do(cluster, namespace, crd_installed, obj, needle):  # noqa: F811
    with pytest.raises(ApiError) as refused:
        cluster.client.apply(obj, namespace)
    assert needle in refused.value.message, refused.value
    assert not cluster.client.exists("kvs", "bad", namespace)


def pod_spec(cluster, ns, name):
    return cluster.client.get("statefulset", name, ns)["spec"]["template"]["spec"]


def test_each_backend_reconciles_with_its_conditions(cluster, namespace, operator):  # noqa: F811
    for name, backend, disk in (("inproc", "lmcache", True), ("server", "lmcache-server", True),
                                ("native", "vllm-native", False)):
        cluster.client.apply(serve(name, backend, disk), namespace)
    got = {name: wait_ready(cluster, namespace, name, timeout=240) for name in ("inproc", "server", "native")}
    for name, obj in got.items():
        assert condition(obj, "ConfigValid")["status"] == "True" and condition(obj, "Scheduled")["status"] == "True"
        assert obj["status"]["budget"]["backend"] == obj["spec"]["offload"]["backend"]
    assert "LMCacheConnectorV1" in condition(got["inproc"], "OffloadActive")["message"]
    assert "LMCacheMPConnector" in condition(got["server"], "OffloadActive")["message"]
    assert "OffloadingConnector" in condition(got["native"], "OffloadActive")["message"]
    assert condition(got["native"], "DiskTierReady")["reason"] == "NotConfigured"
    assert condition(got["server"], "DiskTierReady")["status"] == "True"
    assert ("ConfigMap", "inproc-lmcache") in children_by_name(cluster.client, namespace, "inproc")
    kids = children_by_name(cluster.client, namespace, "server") | children_by_name(cluster.client, namespace, "native")
    assert not any(k[0] == "ConfigMap" for k in kids)
    server = pod_spec(cluster, namespace, "server")
    sidecar = next(c for c in server["initContainers"] if c["name"] == "lmcache-server")
    assert sidecar["restartPolicy"] == "Always"  # the API server accepted a native sidecar
    # The server requests its own process; its limit also holds the L1 (it faults the L1 in itself when it
    # sees a GPU), which only the vLLM container requests: the pod's requests count the L1 once.
    summary = got["server"]["status"]["summary"]
    assert summary["serverMemory"] == sidecar["resources"]["requests"]["memory"]
    assert summary["serverMemoryLimit"] == sidecar["resources"]["limits"]["memory"] != summary["serverMemory"]
    pods = {p["metadata"]["name"]: p for p in cluster.client.list("pods", namespace)}
    assert pods["server-0"]["status"]["phase"] == "Running"
    live = {c["name"]: c["resources"] for c in pods["server-0"]["spec"]["initContainers"]
            + pods["server-0"]["spec"]["containers"]}
    assert live["lmcache-server"]["limits"]["memory"] == summary["serverMemoryLimit"]
    # Request below limit in the sidecar: Burstable, as every backend's pod already is (no CPU limits).
    assert pods["server-0"]["status"]["qosClass"] == pods["inproc-0"]["status"]["qosClass"] == "Burstable"
    table = cluster.kubectl("get", "kvs", "-n", namespace).stdout  # kubectl under test: the printer columns
    assert "BACKEND" in table and "lmcache-server" in table and "vllm-native" in table


def test_switching_backend_is_a_rolling_change(cluster, namespace, operator):  # noqa: F811
    obj = serve("svc", "lmcache")
    cluster.client.apply(obj, namespace)
    wait_ready(cluster, namespace, "svc", timeout=240)
    before = cluster.client.get("pods", "svc-0", namespace)
    rev_before = cluster.client.get("statefulset", "svc", namespace)["status"]["currentRevision"]

    to_server = copy.deepcopy(obj)
    to_server["spec"]["offload"]["backend"] = "lmcache-server"
    cluster.client.apply(to_server, namespace)
    after = wait_ready(cluster, namespace, "svc", generation=2, timeout=240)
    sts = cluster.client.get("statefulset", "svc", namespace)
    assert sts["status"]["currentRevision"] != rev_before  # a new revision, rolled out
    assert sts["status"]["updateRevision"] == sts["status"]["currentRevision"]
    pod = cluster.client.get("pods", "svc-0", namespace)
    # A rolling update replaces the pod object: same name (so the same per-pod disk directory
    # <root>/<ns>/svc/svc-0, emptied again by the init step), new UID (so a new memory-backed
    # /dev/shm emptyDir: an L1 in it starts cold). Only a vLLM container restart inside one pod
    # keeps the server, its L1 and its L2 (the sidecar's restartPolicy Always).
    assert pod["metadata"]["uid"] != before["metadata"]["uid"]
    vol = {v["name"]: v for v in pod["spec"]["volumes"]}
    old = {v["name"]: v for v in before["spec"]["volumes"]}
    assert vol["kv-disk"]["hostPath"] == old["kv-disk"]["hostPath"]
    assert vol["dshm"]["emptyDir"]["sizeLimit"] != old["dshm"]["emptyDir"]["sizeLimit"]  # now holds the L1 too
    assert not any(k[0] == "ConfigMap" for k in children_by_name(cluster.client, namespace, "svc"))  # pruned
    assert after["status"]["budget"]["backend"] == "lmcache-server"

    to_native = copy.deepcopy(to_server)
    to_native["spec"]["offload"]["backend"] = "vllm-native"
    del to_native["spec"]["offload"]["disk"]
    cluster.client.apply(to_native, namespace)
    native = wait_ready(cluster, namespace, "svc", generation=3, timeout=240)
    spec = pod_spec(cluster, namespace, "svc")
    assert [c["name"] for c in spec["initContainers"]] == ["report-engine-versions"]  # no disk step, no server
    assert [c["name"] for c in spec["containers"]] == ["vllm", "exporter"]
    args = spec["containers"][0]["args"]
    assert args[args.index("--kv-offloading-backend") + 1] == "native"
    assert condition(native, "DiskTierReady")["reason"] == "NotConfigured"
    assert native["status"]["budget"]["backend"] == "vllm-native"

    back = copy.deepcopy(obj)  # and back to the in-process default: the ConfigMap returns
    cluster.client.apply(back, namespace)
    wait_ready(cluster, namespace, "svc", generation=4, timeout=240)
    assert ("ConfigMap", "svc-lmcache") in children_by_name(cluster.client, namespace, "svc")
