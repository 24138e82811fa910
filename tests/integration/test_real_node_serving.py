"""A serving pod as the operator renders it, run by the real node's kubelet + containerd + runc.

The operator is the demo's (in-cluster, from the chart). Every container runs under its rendered
securityContext, volumes and limits: the disk-tier init on a real hostPath under an allowed root, the
versions init, the exporter sidecar (the operator image, UID 65532), the LMCache server sidecar for
real (LMCache 0.5.3 on CPU). The engine container is the STAND-IN image (kvtest.images.STANDIN: vLLM's
own parser checks the rendered flags, then it serves the /metrics pages recorded on an H200); the pod
asks for the node's stand-in GPU resource (kvtest.node.GPU_STAND_IN) through spec.resources.gpuResourceName.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from kvtest import condition, images, node

pytestmark = pytest.mark.cluster

DISK_ROOT = Path("/var/lib/kvoffload")  # one of the chart's allowedDiskRoots


@pytest.fixture(scope="module")
def standin(demo):
    """The stand-in built (kvtest.images, cached) and in the node's containerd. spec.engine.image names it,
    so every serving container of the pod but the exporter runs it (it is the serving image + the stand-in
    `vllm`). Importing it takes its size twice on disk (content + unpacked snapshot): with less free
    space than that and a margin, the test skips rather than fill a shared disk."""
    if os.environ.get("KVO_SERVING_ON_NODE") != "1":
        # Not yet run to the end anywhere (the 8.2 GiB stand-in never fitted the shared disk where it was
        # written): opt in with KVO_SERVING_ON_NODE=1 until it has (docs/cluster.md says so).
        pytest.skip("the serving pod on the real node is opt-in (KVO_SERVING_ON_NODE=1): not yet run to the end")
    tar = images.save("standin")
    free = shutil.disk_usage(node.containerd_root()).free
    if free < 2 * tar.stat().st_size + (10 << 30):
        pytest.skip(f"{free / 2**30:.0f} GiB free: importing the {tar.stat().st_size / 2**30:.1f} GiB stand-in "
                    f"image needs twice that plus 10 GiB")
    node.load_images(demo.cluster, ["standin"])
    return images.STANDIN


def serve(name: str, disk: Path, **resources) -> dict:
    return {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe", "metadata": {"name": name},
            "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
                     "engine": {"image": images.STANDIN, "vllmVersion": "0.26.0", "lmcacheVersion": "0.5.3",
                                "maxModelLen": 8192, "maxNumSeqs": 4},
                     "offload": {"backend": "lmcache-server", "chunkSize": 256, "cpu": {"size": "512Mi"},
                                 "disk": {"path": str(disk), "size": "1Gi"}},
                     "resources": {"gpuResourceName": node.GPU_STAND_IN, "gpuMemory": "24Gi", "cpu": "100m",
                                   "engineBaseline": "1536Mi", "perWorkerOverhead": "256Mi",
                                   "stagingPerWorker": "128Mi", "serverBaseline": "1Gi", "shm": "256Mi",
                                   **resources},
                     "scheduling": node.PLACEMENT}}


def wait_cond(demo, ns, name, type_, status, timeout=300):
    def check():
        obj = demo.client.get_or_none("kvs", name, ns)
        return obj if condition(obj, type_).get("status") == status else None
    return demo.wait_until(check, timeout=timeout, interval=1, message=f"{name} {type_}={status}")


@pytest.fixture
def disk_dir():
    d = DISK_ROOT / f"t-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_rendered_server_pod_runs_on_the_real_node(demo, node_ns, standin, disk_dir, tmp_path):
    demo.client.create(serve("standin", disk_dir), node_ns)
    obj = wait_cond(demo, node_ns, "standin", "Ready", "True", timeout=600)
    (pod,) = demo.client.list("pods", node_ns, labels={"kvoffload.io/serve": "standin"})
    assert pod["spec"]["nodeName"] == node.NAME
    spec = pod["spec"]
    names = [c["name"] for c in spec["initContainers"]] + [c["name"] for c in spec["containers"]]
    assert {"prepare-disk-tier", "report-engine-versions", "lmcache-server", "vllm", "exporter"} <= set(names), names
    statuses = {s["name"]: s for s in pod["status"]["containerStatuses"] + pod["status"]["initContainerStatuses"]}
    for c in spec["containers"]:
        assert statuses[c["name"]]["ready"], statuses[c["name"]]
    for c in spec["initContainers"]:
        st = statuses[c["name"]]
        assert st["state"].get("terminated", {}).get("exitCode") == 0 or st.get("started"), st
    # Each container's securityContext as the kernel sees it: the processes' uids in /proc.
    uids = container_uids(demo, pod)
    want = {c["name"]: c["securityContext"]["runAsUser"] for c in spec["containers"]}
    assert uids == want, (uids, want)
    # The disk tier: kubelet made <root>/<ns>/<serve>/<pod> on the host; the init gave it to UID 1000, 0750.
    d = disk_dir / node_ns / "standin" / pod["metadata"]["name"]
    st = d.stat()
    assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o7777)) == (1000, 1000, "0o750"), (d, st)
    # Every condition says what is true of it.
    conds = {c["type"]: c for c in obj["status"]["conditions"]}
    assert conds["EngineVerified"]["status"] == "True", conds["EngineVerified"]
    assert obj["status"]["versions"]["running"]["vllm"] == "0.26.0", obj["status"]["versions"]
    assert obj["status"]["versions"]["running"]["lmcache"] == "0.5.3", obj["status"]["versions"]
    for t in ("ConfigValid", "Scheduled", "DiskTierReady"):
        assert conds[t]["status"] == "True", conds[t]
    # A real Prometheus scrapes the exporter at the pod IP through the rendered port.
    port = next(p["containerPort"] for c in spec["containers"] for p in c.get("ports", []) if p["name"] == "metrics")
    series = prometheus_scrape(tmp_path, f"{pod['status']['podIP']}:{port}")
    assert series["up"] == 1.0, series
    assert any(k.startswith("kvoffload_") for k in series), sorted(series)[:20]


def container_uids(demo, pod) -> dict[str, int]:
    """{container: uid of its first process}, from containerd's view of each running container."""
    out = {}
    for cs in pod["status"]["containerStatuses"]:
        cid = cs["containerID"].removeprefix("containerd://")
        spec = json.loads(node.ctr(demo.cluster, "containers", "info", cid).stdout)["Spec"]
        out[cs["name"]] = spec["process"]["user"]["uid"]
        pid = node.ctr(demo.cluster, "tasks", "ls").stdout
        for line in pid.splitlines()[1:]:
            parts = line.split()
            if parts and parts[0] == cid:
                out[cs["name"]] = int(Path(f"/proc/{parts[1]}/status").read_text().split("Uid:")[1].split()[0])
    return out


def prometheus_scrape(tmp: Path, target: str) -> dict[str, float]:
    port = free_port()
    (tmp / "prom.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "exporter", "static_configs": [{"targets": [target]}]}]}))
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prom.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "prom.log", "w"))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/api/v1/query?query=%7Bjob%3D%22exporter%22%7D")
                res = json.loads(conn.getresponse().read())["data"]["result"]
                got = {r["metric"]["__name__"]: float(r["value"][1]) for r in res}
                if got.get("up") == 1.0 and len(got) > 5:
                    return got
            time.sleep(1)
        return got if "got" in dir() else {}
    finally:
        proc.terminate()
        proc.wait(10)


def test_over_its_limit_the_engine_is_oom_killed_and_ready_names_it(demo, node_ns, standin, disk_dir):
    # 1 MiB for the engine's baseline: the stand-in (vLLM's parser imports torch) cannot start in it.
    demo.client.create(serve("tight", disk_dir, engineBaseline="1Mi", perWorkerOverhead="1Mi",
                             stagingPerWorker="1Mi", headroomPercent=0), node_ns)

    def oom():
        obj = demo.client.get_or_none("kvs", "tight", node_ns)
        ready = condition(obj, "Ready")
        return obj if ready.get("status") == "False" and "OOMKilled" in ready.get("message", "") else None
    obj = demo.wait_until(oom, timeout=300, interval=1, message="Ready=False naming the OOM kill")
    msg = condition(obj, "Ready")["message"]
    assert "vllm" in msg, msg
    (pod,) = demo.client.list("pods", node_ns, labels={"kvoffload.io/serve": "tight"})
    (cs,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == "vllm"]
    last = cs.get("lastState", {}).get("terminated") or cs["state"].get("terminated")
    assert last["reason"] == "OOMKilled" and last["exitCode"] == 137, cs
    assert os.path.isdir(disk_dir)
