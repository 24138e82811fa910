"""Issue 35's GPU run of spec.offload.server PerNode (benchmarks/gpu/shared_gpu.py): the rendering it starts from
(`kvoffload render --node`), the capture's fitting of both pods for the CPU node, the server pod as containers, the
serving pods on the admin's tmpfs root, and the three pods laid out from the real node's captures (dry run)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import yaml

from kvtest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import gpu_manifests as gm  # noqa: E402
import shared_gpu  # noqa: E402

from kvoffload.rendering import shared_cache  # noqa: E402

EXAMPLE = ROOT / "examples" / "shared-llama31-8b.yaml"
CONFIG = ROOT / "benchmarks" / "gpu" / "shared-operator-config.yaml"
OCI = ROOT / "benchmarks" / "gpu" / "oci"


def render(node: str | None = shared_gpu.SERVER_NODE) -> str:
    extra = ["--node", node] if node else []
    return subprocess.run([sys.executable, "-m", "kvoffload.cli", "render", "-f", str(EXAMPLE), "--operator-config",
                           str(CONFIG), *extra], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def text() -> str:
    return render()


@pytest.fixture(scope="module")
def docs(text) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def server_doc(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment")


def test_render_node_adds_that_nodes_server_pinned_there_and_nothing_else(docs):
    without = [d for d in yaml.safe_load_all(render(None)) if d]
    assert [d for d in without if d["kind"] == "Deployment"] == []
    assert [d for d in docs if d["kind"] != "Deployment"] == without
    dep = server_doc(docs)
    assert dep["metadata"]["annotations"][shared_cache.NODE_ANNOTATION] == shared_gpu.SERVER_NODE
    terms = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [shared_gpu.SERVER_NODE]}]}]


def test_the_server_pod_as_containers_keeps_its_command_and_puts_each_host_path_where_asked(docs, tmp_path):
    dep = server_doc(docs)
    hp = {"dshm": str(tmp_path / "shm"), "kv-disk": str(tmp_path / "disk")}
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    run = gm.plain_pod(dep, str(tmp_path / "pod"), hp, "srv-1", image, {"X": "1"})
    roles = [(c.name, c.role) for c in run.containers]
    assert roles == [("prepare-shared-memory", "init"), ("prepare-disk-tier", "init"), ("lmcache-server", "main")]
    server = run.containers[-1]
    rendered = dep["spec"]["template"]["spec"]["containers"][0]
    assert server.argv == [*rendered["command"], *(a.replace("$(POD_NAME)", "srv-1") for a in rendered["args"])]
    assert server.env["X"] == "1" and "X" not in run.containers[0].env  # the serving image's containers only
    ns, name = dep["metadata"]["namespace"], "shared-llama31-8b"
    assert server.mounts["/dev/shm"] == (f"{hp['dshm']}/{ns}/{name}", False)
    assert server.mounts["/kvcache"] == (f"{hp['kv-disk']}/lmcache/{ns}/{name}/{name}-cache", False)
    assert run.fresh_dirs == [str(tmp_path / "pod" / "volumes" / "tmp")]  # nothing of the node's is emptied
    assert run.status_url == "http://127.0.0.1:8081/status" and server.probe
    with pytest.raises(gm.ManifestError, match="kv-disk"):
        gm.plain_pod(dep, str(tmp_path / "pod"), {"dshm": "/x"}, "srv-1", "img")


def test_a_serving_pod_on_the_tmpfs_root_with_its_own_name_and_the_root_never_emptied(text, tmp_path):
    r = gm.parse_rendered(text)
    run = gm.containerize(r, str(tmp_path / "b"), "", model_config={"a": 1}, host_paths={"dshm": "/shm-root"},
                          pod_name=f"{r.name}-1")
    vllm = run.container("main")
    assert vllm.mounts["/dev/shm"] == (f"/shm-root/{r.namespace}/{r.name}", False)
    assert "/shm-root" not in run.fresh_dirs and "" not in run.fresh_dirs
    assert vllm.env["POD_NAME"] == f"{r.name}-1"


def test_the_harness_reaches_the_server_on_loopback_and_moves_only_replica_bs_ports(text):
    r = gm.parse_rendered(text)
    args = type("A", (), {"work": "/w", "gpu_memory_utilization": 0.4})()
    runs = {}
    for i, k in enumerate(shared_gpu.PORTS):
        rep = shared_gpu.Replica(k, i, r, {}, {"a": 1}, args, "/shm-root")
        runs[k] = rep.make()
    dns = shared_cache.dns_address(r.name, r.namespace)
    for k, run in runs.items():
        assert not any(dns in a for c in run.containers for a in c.argv)
        main, x = run.container("main"), run.container("exporter")
        assert gm.flag(main.argv, "--port") == str(shared_gpu.PORTS[k][0]) and run.port == shared_gpu.PORTS[k][0]
        assert gm.flag(x.argv, "--listen") == f"127.0.0.1:{shared_gpu.PORTS[k][1]}"
        assert gm.flag(x.argv, "--vllm-metrics-url") == f"http://127.0.0.1:{shared_gpu.PORTS[k][0]}/metrics"
        cfg = json.loads(gm.flag(main.argv, "--kv-transfer-config"))["kv_connector_extra_config"]
        assert cfg["lmcache.mp.host"] == "tcp://127.0.0.1"
        last = len(main.argv) - 1 - main.argv[::-1].index("--gpu-memory-utilization")  # vLLM takes the last one
        assert main.argv[last + 1] == "0.4"
    wait = next(c for c in runs["A"].containers if c.name == "wait-for-shared-cache")
    assert gm.flag(wait.argv, "--address") == "127.0.0.1:5555"


def test_each_replica_gets_a_pod_cgroup_of_its_own():
    specs = {"vllm": {"linux": {"cgroupsPath": "/kubepods/burstable/pod1234/abc"}}}
    a, b = shared_gpu.retag(specs, "A1"), shared_gpu.retag(specs, "B1")
    assert a["vllm"]["linux"]["cgroupsPath"] == "/kubepods/burstable/pod1234-A1/abc"
    assert b["vllm"]["linux"]["cgroupsPath"] != a["vllm"]["linux"]["cgroupsPath"]
    assert specs["vllm"]["linux"]["cgroupsPath"] == "/kubepods/burstable/pod1234/abc"


def capture_module():
    spec = importlib.util.spec_from_file_location("capture", OCI / "capture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fitting_pernode_for_the_cpu_node_keeps_both_pods_and_changes_only_what_it_lists(docs):
    cap = capture_module()
    fitted, changes = cap.for_cpu_node(docs, "shared")
    assert [d["kind"] for d in fitted] == [d["kind"] for d in docs if d["kind"] in ("ConfigMap", *cap.POD_KINDS)]
    for d in fitted:
        if d["kind"] not in cap.POD_KINDS:
            continue
        spec = d["spec"]["template"]["spec"]
        paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        assert len(set(paths.values())) == len(paths)  # the tmpfs root and the disk root apart
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c["name"] == cap.WAIT_INIT:
                assert c["command"] == ["python3", "-c", "pass"]
            if c["name"] == "lmcache-server":
                assert c["command"][:2] == ["python3", "-c"] and "8081" in c["command"][2]
    assert any(ch.startswith("wait-for-shared-cache: command") for ch in changes)
    assert any(ch.startswith("lmcache-server: command") for ch in changes)


def test_the_three_pods_lay_out_from_the_real_nodes_captures_of_the_same_shape(text, tmp_path):
    """The GPU run's pods from `oci/shared` and `oci/shared-server` (capture.py of the example, on the real node):
    every rendered container has its captured spec, and no mount is added or dropped for want of one."""
    (tmp_path / "shared.yaml").write_text(text)
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "shared_gpu.py"), "--dry-run",
                    "--rendered", str(tmp_path / "shared.yaml"), "--oci-serving", str(OCI / "shared"),
                    "--oci-server", str(OCI / "shared-server"), "--out", str(out), "--work", str(tmp_path / "work")],
                   check=True, capture_output=True, text=True, cwd=ROOT / "benchmarks" / "gpu")
    dry = json.loads((out / "results.json").read_text())["dry"]
    assert set(dry) == {"A", "B", "server"}
    assert set(dry["server"]["changes"]) == {"prepare-shared-memory", "prepare-disk-tier", "lmcache-server"}
    assert set(dry["A"]["changes"]) == set(dry["B"]["changes"]) >= {"wait-for-shared-cache", "vllm", "exporter"}
    for pod, d in dry.items():
        for container, changes in d["changes"].items():
            odd = [c for c in changes if "added as kubelet mounts" in c or "derived from" in c
                   or c.startswith("captured volume mount") or "not mounted" in c]
            assert not odd, (pod, container, odd)
    # Replica B alone moves its ports; both dial the server on loopback, where the Service's name was.
    name = shared_cache.dns_address("shared-llama31-8b", "kvoffload-demo")
    assert "--port" not in dry["A"]["argv"]["vllm"] or gm.flag(dry["A"]["argv"]["vllm"], "--port") == "8000"
    assert gm.flag(dry["B"]["argv"]["vllm"], "--port") == "8001"
    assert not any(name in a for d in (dry["A"], dry["B"]) for argv in d["argv"].values() for a in argv)
    # The server's L2 is kept only for the resource it was written for: the init step gets a uid, as from the operator.
    assert gm.flag(dry["server"]["argv"][shared_gpu.DISK_INIT], "--owner-uid") == shared_gpu.OWNER_UID
