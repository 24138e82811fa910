"""The operator on the real control plane: kube-apiserver validates, kube-scheduler places pods
on kwok GPU nodes, kube-controller-manager runs the StatefulSet and garbage collector."""

from __future__ import annotations

import copy
import json
import time

import pytest

from kvoffload.engine import images
from kvoffload.engine.images import resolve
from kvtest import ROOT, ApiError, condition
from kvtest.specs import children_by_name, serve, wait_condition, wait_ready

pytestmark = pytest.mark.cluster

SMALL = serve("svc")


def test_create_runs_on_gpu_nodes_and_reports_the_budget(cluster, namespace, operator):
    cluster.client.apply(SMALL, namespace)
    obj = wait_ready(cluster, namespace, "svc")
    kids = children_by_name(cluster.client, namespace, "svc")
    assert set(kids) == {("ConfigMap", "svc-lmcache"), ("Service", "svc"), ("Service", "svc-pods"),
                         ("StatefulSet", "svc"), ("PodDisruptionBudget", "svc")}
    for child in kids.values():
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["uid"] == obj["metadata"]["uid"] and ref["controller"]
    pods = cluster.client.list("pods", namespace)
    assert len(pods) == 1 and pods[0]["status"]["phase"] == "Running"
    nvme = {n["metadata"]["name"] for n in cluster.client.list("nodes", labels={"kvoffload.io/nvme": "true"})
            if n["metadata"]["name"].startswith("gpu-node-")}  # the fleet's servers (tests/cluster/nodes.yaml)
    assert nvme and pods[0]["spec"]["nodeName"] in nvme  # NVMe nodes only
    st = obj["status"]
    assert condition(obj, "ConfigValid")["status"] == "True" and condition(obj, "Scheduled")["status"] == "True"
    assert condition(obj, "DiskTierReady")["status"] == "True"
    assert st["summary"]["cpuTokens"] > 0 and st["summary"]["diskTokens"] > st["summary"]["cpuTokens"]
    vllm = kids[("StatefulSet", "svc")]["spec"]["template"]["spec"]["containers"][0]
    assert vllm["image"] == images.DEFAULT_IMAGE  # the default: the serving image
    pair = resolve(vllm["image"], None, None)  # the operator's table for the default image
    # Rendered for the table's pair; nothing reported what runs (no exporter listens on kwok pods).
    assert st["versions"] == {"image": vllm["image"], "renderedFor": {"vllm": pair.vllm, "lmcache": pair.lmcache},
                              "running": []}
    assert condition(obj, "EngineVerified")["reason"] == "VersionsNotReported"
    assert st["endpoint"] == f"http://svc.{namespace}.svc:8000/v1"
    assert vllm["resources"]["limits"]["memory"] == st["summary"]["memory"]
    table = cluster.kubectl("get", "kvs", "-n", namespace).stdout  # kubectl under test: printer columns
    assert "GPU-TOKENS" in table and "True" in table and st["summary"]["memory"] in table


def test_update_rolls_out_and_status_follows(cluster, namespace, operator):
    cluster.client.apply(SMALL, namespace)
    wait_ready(cluster, namespace, "svc")
    changed = copy.deepcopy(SMALL)
    changed["spec"]["offload"]["cpu"]["size"] = "24Gi"
    cluster.client.apply(changed, namespace)
    obj = wait_ready(cluster, namespace, "svc", generation=2)
    cm = cluster.client.get("configmap", "svc-lmcache", namespace)
    assert "max_local_cpu_size: 24.0" in cm["data"]["lmcache.yaml"]
    sts = cluster.client.get("statefulset", "svc", namespace)
    assert sts["status"]["updateRevision"] == sts["status"]["currentRevision"]
    assert (obj["status"]["summary"]["memory"]
            == sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"])


def test_scale_subresource(cluster, namespace, operator):
    cluster.client.apply(SMALL, namespace)
    wait_ready(cluster, namespace, "svc")
    cluster.kubectl("scale", "kvs/svc", "-n", namespace, "--replicas=2")  # kubectl under test: kubectl scale
    obj = wait_ready(cluster, namespace, "svc")
    assert obj["status"]["readyReplicas"] == 2 and obj["spec"]["replicas"] == 2
    assert cluster.client.get("statefulset", "svc", namespace)["spec"]["replicas"] == 2
    scale = cluster.client.get("kvs", "svc", namespace, subresource="scale")
    assert scale["status"]["replicas"] == 2 and scale["status"]["selector"] == "kvoffload.io/serve=svc"


def test_delete_garbage_collects_children(cluster, namespace, operator):
    cluster.client.apply(SMALL, namespace)
    wait_ready(cluster, namespace, "svc")
    cluster.client.delete("kvs", "svc", namespace, wait=True, timeout=60)
    cluster.wait_until(lambda: not children_by_name(cluster.client, namespace, "svc"), timeout=90,
                       message="children garbage-collected")


def test_drift_is_repaired(cluster, namespace, operator):
    cluster.client.apply(SMALL, namespace)
    wait_ready(cluster, namespace, "svc")
    cluster.client.delete("configmap", "svc-lmcache", namespace)
    cluster.client.patch("statefulset", "svc",
                         [{"op": "replace", "path": "/spec/template/spec/containers/0/image", "value": "evil:latest"}],
                         namespace, type="json")
    cluster.wait_until(lambda: cluster.client.exists("configmap", "svc-lmcache", namespace), timeout=60,
                       message="ConfigMap re-created")
    cluster.wait_until(
        lambda: (cluster.client.get("statefulset", "svc", namespace)["spec"]["template"]["spec"]
                 ["containers"][0]["image"] == images.DEFAULT_IMAGE),
        timeout=60, message="image restored")


@pytest.mark.parametrize("patch, needle", [
    ({"engine": {"maxModelLen": 4096, "gpuMemoryUtilization": 1.5}}, "spec.engine.gpuMemoryUtilization"),
    ({"engine": {"maxModelLen": 4096, "tensorParallelSize": 0}}, "spec.engine.tensorParallelSize"),
    ({"engine": {"maxModelLen": 4096, "extraArgs": ["--max-model-len=1"]}}, "spec.engine.extraArgs"),
    ({"engine": {"maxModelLen": 4096, "env": [{"name": "LMCACHE_LOCAL_DISK", "value": "True"}]}}, "spec.engine.env"),
    ({"offload": {"chunkSize": 0, "cpu": {"size": "1Gi"}}}, "spec.offload.chunkSize"),
    ({"offload": {"cpu": {"size": "forty"}}}, "spec.offload.cpu.size"),
    ({"offload": {"cpu": {"size": "1Gi"}, "disk": {"size": "10Gi"}}}, "spec.offload.disk"),
    ({"offload": {"cpu": {"size": "1Gi"}, "disk": {"path": "/mnt/nvme/../etc", "size": "10Gi"}}},
     "spec.offload.disk.path"),
    ({"offload": {"cpu": {"size": "1Gi"}, "disk": {"path": "relative", "size": "10Gi"}}}, "spec.offload.disk.path"),
    ({"offload": {"cpu": {"size": "1Gi", "evictionPolicy": "RANDOM"}}}, "spec.offload.cpu.evictionPolicy"),
    ({"offload": {"cpu": {"size": "1Gi"}, "cpuThreshold": 0.8}}, "cpuThreshold"),
])
def test_api_server_refuses_bad_specs_naming_the_field(cluster, namespace, crd_installed, patch, needle):
    obj = copy.deepcopy(SMALL)
    for key, value in patch.items():
        obj["spec"][key] = {**obj["spec"].get(key, {}), **value} if key == "engine" else value
    with pytest.raises(ApiError) as refused:
        cluster.client.apply(obj, namespace)
    assert needle in refused.value.message, refused.value
    assert cluster.client.exists("kvs", "svc", namespace) is False


def test_api_server_refuses_long_names(cluster, namespace, crd_installed):
    obj = copy.deepcopy(SMALL)
    obj["metadata"]["name"] = "x" * 53
    with pytest.raises(ApiError) as refused:
        cluster.client.apply(obj, namespace)
    assert "at most 52 characters" in refused.value.message, refused.value


def spec_versions(children: dict) -> dict:
    """What the operator writes of each child: its generation where it has one (kube-controller-manager's status
    writes, such as the disruption controller's to a PodDisruptionBudget once a pod is ready, bump only the
    resourceVersion), else its resourceVersion."""
    return {k: v["metadata"].get("generation") or v["metadata"]["resourceVersion"] for k, v in children.items()}


def test_operator_refuses_what_only_it_can_see(cluster, namespace, operator):
    obj = copy.deepcopy(SMALL)
    obj["spec"]["offload"]["disk"]["path"] = "/etc/lmcache"  # well-formed, but outside the allowed roots
    cluster.client.apply(obj, namespace)
    found = wait_condition(cluster, namespace, "svc", "ConfigValid", "False")
    assert "spec.offload.disk.path" in condition(found, "ConfigValid")["message"]
    assert "allowed roots" in condition(found, "ConfigValid")["message"]
    assert children_by_name(cluster.client, namespace, "svc") == {}
    # Fixing it creates the children; breaking it again changes nothing that exists.
    cluster.client.apply(SMALL, namespace)
    wait_ready(cluster, namespace, "svc")
    before = spec_versions(children_by_name(cluster.client, namespace, "svc"))
    bad_tp = copy.deepcopy(SMALL)
    bad_tp["spec"]["engine"]["tensorParallelSize"] = 3  # Qwen2.5-7B: 28 heads, 4 KV heads; vLLM refuses TP 3
    cluster.client.apply(bad_tp, namespace)
    found = wait_condition(cluster, namespace, "svc", "ConfigValid", "False")
    assert "spec.engine.tensorParallelSize" in condition(found, "ConfigValid")["message"]
    assert spec_versions(children_by_name(cluster.client, namespace, "svc")) == before


def test_too_big_for_every_node_is_unschedulable(cluster, namespace, operator):
    obj = copy.deepcopy(SMALL)
    obj["spec"]["offload"]["cpu"]["size"] = "3Ti"  # nodes have at most 2 TiB
    cluster.client.apply(obj, namespace)
    found = wait_condition(cluster, namespace, "svc", "Scheduled", "False", reason="Unschedulable")
    assert "Insufficient memory" in condition(found, "Scheduled")["message"]
    assert condition(found, "Ready")["status"] == "False"


def test_steady_state_writes_nothing(cluster, namespace, operator):
    cluster.client.apply(SMALL, namespace)
    wait_ready(cluster, namespace, "svc")
    time.sleep(5)  # let the last pod events settle before taking the baseline

    def versions():
        kvs = cluster.client.get("kvs", "svc", namespace)
        return {("kvs", "svc"): kvs["metadata"]["resourceVersion"],
                **{k: v["metadata"]["resourceVersion"]
                   for k, v in children_by_name(cluster.client, namespace, "svc").items()}}

    before = versions()
    log_before = operator.output().count("apply ")
    time.sleep(60)  # three resync timers (resyncSeconds: 20) fire in this minute
    assert versions() == before
    assert operator.output().count("apply ") == log_before


def test_offload_active_and_engine_versions_come_from_the_pods_exporter(cluster, namespace, operator, tmp_path):
    """The proof path end to end: kwok pod IPs are loopback, so a real exporter bound to the pod's IP
    answers the operator's probe. It reads real /metrics pages of vLLM 0.26.0 + LMCache 0.5.3 from an
    H200 (served on 127.0.0.1; LMCache's figures from vLLM's shared page): without the connector, with
    it under vLLM's default V2 runner (LMCache never loaded), and with the V1 runner (LMCache loaded);
    and a versions file like the one the serving image's init container writes."""
    import subprocess
    import sys

    from kvtest.exporter import FakeVllm

    fixtures = ROOT / "tests/fixtures"
    cluster.client.apply(SMALL, namespace)
    obj = wait_ready(cluster, namespace, "svc")
    assert condition(obj, "OffloadActive")["status"] == "Unknown"  # nothing listens on the pod IP yet
    rendered = obj["status"]["versions"]["renderedFor"]
    pod = cluster.client.list("pods", namespace)[0]
    ip, pod_name = pod["status"]["podIP"], pod["metadata"]["name"]
    assert ip.startswith("127.")  # the network rule: kwok pod IPs are loopback
    config = tmp_path / "lmcache.yaml"
    config.write_text(cluster.client.get("configmap", "svc-lmcache", namespace)["data"]["lmcache.yaml"])
    versions = tmp_path / "versions.json"
    versions.write_text(json.dumps({**rendered, "torch": "2.11.0+cu130"}))
    with FakeVllm((fixtures / "vllm-0.26.0-lmcache-0.5.3-h200/vllm-metrics-without-connector.txt").read_text()) as vllm:
        exporter = subprocess.Popen([sys.executable, "-m", "kvoffload.cli", "exporter", "--listen", f"{ip}:9400",
                                     "--vllm-metrics-url", vllm.url, "--unloaded-grace-seconds", "0",
                                     "--lmcache-config", str(config), "--tensor-parallel-size", "1",
                                     "--engine-versions-file", str(versions)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            # vLLM never asked a KV connector and no LMCache figures: nothing proven. The operator
            # re-probes at its next reconcile (resyncSeconds: 20 in tests).
            found = wait_condition(cluster, namespace, "svc", "OffloadActive", "False", timeout=60,
                                   reason="NoLMCacheActivity")
            assert condition(found, "EngineVerified")["reason"] == "EngineVersionsMatch"
            assert found["status"]["versions"]["running"] == [
                {**rendered, "torch": "2.11.0+cu130", "podCount": 1, "pods": [pod_name]}]
            # The reference run (V2 runner): vLLM counted 64,028 tokens loaded, LMCache retrieved none.
            vllm.body = (fixtures / "vllm-0.26.0-lmcache-0.5.3-h200/vllm-metrics-with-lmcache.txt").read_text()
            found = wait_condition(cluster, namespace, "svc", "OffloadActive", "False", timeout=60,
                                   reason="ExternalHitsNotLoaded")
            message = condition(found, "OffloadActive")["message"]
            assert (message.startswith("1/1 pods")
                    and "vLLM counted 64,028 prompt tokens as loaded from LMCache" in message)
            assert "lmcache:num_retrieve_requests_total 0" in message
            # The V1 runner (what the operator renders for this pair): LMCache retrieved 6 times.
            vllm.body = (fixtures / "vllm-0.26.0-lmcache-0.5.3-h200-v1runner/vllm-metrics-with-lmcache.txt").read_text()
            found = wait_condition(cluster, namespace, "svc", "OffloadActive", "True", timeout=60)
            assert "1/1 pods" in condition(found, "OffloadActive")["message"]

            # The image holds another pair than the one rendered for.
            other = ({"vllm": "0.26.0", "lmcache": "0.5.3"} if rendered != {"vllm": "0.26.0", "lmcache": "0.5.3"}
                     else {"vllm": "0.27.1", "lmcache": "0.5.4"})
            versions.write_text(json.dumps({**other, "torch": "2.13.0"}))
            found = wait_condition(cluster, namespace, "svc", "EngineVerified", "False", timeout=60,
                                   reason="EngineVersionMismatch")
            assert condition(found, "EngineVerified")["message"].startswith(
                f"rendered for vLLM {rendered['vllm']} + LMCache {rendered['lmcache']}, "
                f"pod {pod_name} runs vLLM {other['vllm']} + LMCache {other['lmcache']}")
            assert found["status"]["versions"]["renderedFor"] == rendered
            assert found["status"]["versions"]["running"] == [{**other, "torch": "2.13.0", "podCount": 1,
                                                               "pods": [pod_name]}]
        finally:
            exporter.terminate()
            exporter.wait(10)
    found = wait_condition(cluster, namespace, "svc", "OffloadActive", "Unknown", timeout=60,
                           reason="ExporterUnreachable")
    assert condition(found, "EngineVerified")["reason"] == "VersionsNotReported"


def test_pass_through_fields_the_api_server_refuses_are_config_errors(cluster, namespace, operator):
    """Tolerations/affinity/env reach the pod unchanged; if the API server refuses the StatefulSet they
    make, no child is half-applied: such a StatefulSet is dry-run before any other child is written."""
    obj = copy.deepcopy(SMALL)
    obj["spec"]["scheduling"] = {"tolerations": [{"key": "gpu", "operator": "Sometimes"}]}
    cluster.client.apply(obj, namespace)
    found = wait_condition(cluster, namespace, "svc", "ConfigValid", "False")
    msg = condition(found, "ConfigValid")["message"]
    assert "refused the rendered" in msg and "tolerations" in msg
    assert children_by_name(cluster.client, namespace, "svc") == {}
    cluster.client.apply(SMALL, namespace)
    wait_ready(cluster, namespace, "svc")
