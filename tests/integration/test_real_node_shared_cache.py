"""spec.offload.server PerNode on the real node (issue 35 slice B; docs/shared-cache.md): one LMCache server pod for the
resource on the node, shared by its replicas there, as the demo's operator (in-cluster, from the chart) renders and
runs it. The engine image is the slim STAND-IN (kvtest.images STANDIN_SLIM: no vLLM, no LMCache, no model): its
`lmcache server` holds its L1 as a /dev/shm segment and lists the engines that registered over its ZMQ port; its `vllm`
registers each worker there and answers completions from recorded pages. Nothing here measures speed or hits.

The test plays the cluster admin: it mounts a tmpfs at the demo's sharedMemoryRoot (tests/cluster/demo-values.yaml,
kvtest.specs.SHARED_MEMORY_ROOT) and removes it afterwards. The lifecycle, in order:
- the first replica bound to the node: the operator creates the node's server; the replica's init step waits for it,
  then its vLLM registers with it through the node-local Service; the L1 segment lies in the resource's directory of
  the admin's tmpfs, seen as /dev/shm by the server and the replica;
- scale up onto the node: the new replica registers with the same server, and no second server appears;
- a replica deleted (rescheduled onto the same node): its successor registers with the same server, not restarted;
- the server pod deleted while requests are sent to both replicas: every request is answered (a replica without its
  server serves without the shared tier), SharedCacheReady leaves True and comes back, and both replicas register
  with the new server pod; the L2 chunk file written before is kept by the new pod's init step (same fingerprint);
- a fingerprint change (chunkSize) replaces the server, and its init step empties the L2;
- scaled to zero: the server stays for its grace period (sharedServerGraceSeconds), then the operator removes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvoffload.engine import images
from kvtest import condition, node
from kvtest.specs import SHARED_MEMORY_ROOT

pytestmark = pytest.mark.cluster

SHM_ROOT = Path(SHARED_MEMORY_ROOT)
NAME = "shared"
SHARED_LABEL = "kvoffload.io/shared-cache"
CHUNK = "meta-llama-SEP-Llama-3.1-8B-Instruct@0x01000000@0@" + "cd" * 16 + ".data"  # fs_native's name for a chunk


FORWARDING = Path("/proc/sys/net/ipv4/conf") / node.BRIDGE / "forwarding"


@pytest.fixture
def bridge_forwarding():
    """Pod to ClusterIP to pod on the node: kube-proxy's DNAT turns it into a packet the host forwards from the bridge
    back onto it, which every Kubernetes node does (ip_forward=1). The real node restores the host's ip_forward (0
    here) once it is Ready; this turns forwarding on for packets that arrive on the bridge only, for this test (the
    node's guard still drops anything from the bridge to another interface, and its counters show it), and puts the
    old value back."""
    before = FORWARDING.read_text().strip()
    FORWARDING.write_text("1\n")
    try:
        yield
    finally:
        FORWARDING.write_text(before + "\n")


@pytest.fixture
def shm_root():
    """The admin's tmpfs root on the node (the real node is this machine): a tmpfs of its own, so the L1s cannot
    fill anything else."""
    SHM_ROOT.mkdir(mode=0o755, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m,mode=0755", "kvoffload-shm-test", str(SHM_ROOT)],
                   check=True)
    try:
        yield SHM_ROOT
    finally:
        subprocess.run(["umount", "-l", str(SHM_ROOT)], check=False)
        with_contents = list(SHM_ROOT.iterdir()) if SHM_ROOT.is_dir() else []
        if not with_contents:
            SHM_ROOT.rmdir()


def shared_spec(image: str, disk: Path, replicas: int) -> dict:
    body = node.serve_spec(NAME, image, disk)
    # PerNode needs LMCache >= 0.5.6 (engine/images.SHARED_SERVER_MIN_LMCACHE): the resource declares the default pair
    # and that pair's server floor. The stand-in holds no engine of either pair; what it reports leaves EngineVerified
    # False, which this test does not read.
    pair = images.KNOWN_IMAGES[images.DEFAULT_IMAGE]
    body["spec"]["engine"].update(vllmVersion=pair.vllm, lmcacheVersion=pair.lmcache)
    body["spec"]["resources"]["serverBaseline"] = images.server_baseline_floor(pair.lmcache)
    body["spec"]["offload"]["server"] = "PerNode"
    body["spec"]["replicas"] = replicas
    return body


def live(pods: list[dict]) -> list[dict]:
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def serving_pods(demo, ns) -> list[dict]:
    return live(demo.client.list("pods", ns, labels={"kvoffload.io/serve": NAME}))


def server_pods(demo, ns) -> list[dict]:
    return live(demo.client.list("pods", ns, labels={SHARED_LABEL: NAME}))


def server_deployments(demo, ns) -> list[dict]:
    return [d for d in demo.client.list("deployments", ns, labels={"kvoffload.io/serve": NAME})
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == "shared-cache"]


def ready(pod: dict) -> bool:
    return condition(pod, "Ready").get("status") == "True"


def status_of(pod: dict) -> dict:
    """The server's GET /status at its pod IP (the host reaches the bridge; the stand-in lists registered engines)."""
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8081/status", timeout=5) as r:  # noqa: S310
        return json.loads(r.read())


def one_ready_server(demo, ns, engines: int, other_than: str | None = None) -> dict:
    """Waits for exactly one ready server pod (not `other_than`, a pod uid) with `engines` registered engines."""
    def check():
        pods = server_pods(demo, ns)
        if len(pods) != 1 or not ready(pods[0]) or pods[0]["metadata"]["uid"] == other_than:
            return None
        try:
            doc = status_of(pods[0])
        except OSError:
            return None
        return pods[0] if len(doc.get("registered_gpu_ids", [])) == engines else None
    return demo.wait_until(check, timeout=300, interval=1,
                           message=f"one ready server pod with {engines} registered engine(s)")


def wait_cond(demo, ns, type_, status, reason=None, timeout=300) -> dict:
    def check():
        c = condition(demo.client.get_or_none("kvs", NAME, ns), type_)
        return c if c.get("status") == status and (reason is None or c.get("reason") == reason) else None
    return demo.wait_until(check, timeout=timeout, interval=1, message=f"{type_}={status} {reason or ''}")


def complete(pod: dict) -> int:
    body = json.dumps({"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "hello", "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://{pod['status']['podIP']}:8000/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - the pod's bridge address
        return r.status


def _seen_while_replaced(demo, ns, old_uid: str) -> list[str]:
    """SharedCacheReady's reasons until a new server pod is ready (its False may be shorter than a status write)."""
    seen: list[str] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        reason = condition(demo.client.get("kvs", NAME, ns), "SharedCacheReady").get("reason", "")
        if not seen or seen[-1] != reason:
            seen.append(reason)
        pods = server_pods(demo, ns)
        if pods and pods[0]["metadata"]["uid"] != old_uid and ready(pods[0]):
            return seen
        time.sleep(0.5)
    raise AssertionError(f"no new server pod ready within 300s; SharedCacheReady was {seen}")


def disk_report(pod: dict) -> dict:
    for st in pod["status"].get("initContainerStatuses") or []:
        if st["name"] == "prepare-disk-tier":
            return json.loads(((st.get("state") or {}).get("terminated") or {}).get("message") or "{}")
    return {}


def test_one_server_per_node_shared_by_the_replicas_there(demo, node_ns, engine_image, shm_root, disk_base,
                                                          bridge_forwarding):
    cfg = node.operator_config(demo)
    assert cfg.get("sharedMemoryRoot") == SHARED_MEMORY_ROOT, (
        "the demo's operator has no sharedMemoryRoot (tests/cluster/demo-values.yaml); a demo from an older tree?", cfg)
    grace = int(cfg.get("sharedServerGraceSeconds", 600))
    c = demo.client
    t0 = time.monotonic()
    c.create(shared_spec(engine_image, disk_base, replicas=1), node_ns)
    try:
        _lifecycle(demo, node_ns, shm_root, disk_base, grace, t0)
    finally:
        c.delete("kvs", NAME, node_ns, missing_ok=True)
    assert not any(node.guard_counters().values()), node.guard_counters()  # nothing left the bridge


def _lifecycle(demo, ns, shm_root, disk_base, grace, t0):
    c = demo.client
    # --- the first replica on the node: the operator creates the node's server; the replica registers with it
    server = one_ready_server(demo, ns, engines=1)
    wait_cond(demo, ns, "Ready", "True")
    sc = wait_cond(demo, ns, "SharedCacheReady", "True", "ServersReady")
    print(f"first replica registered with its node's server in {time.monotonic() - t0:.0f}s; {sc['message']}")
    assert server["spec"]["nodeName"] == node.NAME
    (first,) = serving_pods(demo, ns)
    assert first["spec"]["nodeName"] == node.NAME
    svc = c.get("services", f"{NAME}-cache", ns)
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["spec"]["clusterIP"] in sc["message"]  # the replicas dial the ClusterIP the operator read back
    policy = c.get("networkpolicies", f"{NAME}-cache", ns)
    assert policy["spec"]["podSelector"]["matchLabels"] == {SHARED_LABEL: NAME}
    # The L1 segment in the resource's own directory of the admin's tmpfs, which both pods see as /dev/shm.
    d = shm_root / ns / NAME
    st = d.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1000, 1000, 0o700), st
    segments = [p.name for p in d.iterdir() if p.name.startswith("lmcache-standin-l1-")]
    assert segments == [f"lmcache-standin-l1-{server['metadata']['name']}"], segments
    for pod, cname in ((server, "lmcache-server"), (first, "vllm")):
        pid = node.task_pids(demo.cluster, pod)[cname]
        assert os.stat(f"/proc/{pid}/root/dev/shm").st_ino == st.st_ino, cname  # the same directory
        status = node.proc_status(pid)
        assert status["Uid"].split()[0] == "1000" and status["CapEff"] == "0000000000000000", (cname, status)
    server_uid = server["metadata"]["uid"]

    # --- scale up onto the node that has the server: it registers there; no second server
    c.patch("kvs", NAME, {"spec": {"replicas": 2}}, ns)
    server = one_ready_server(demo, ns, engines=2)
    assert server["metadata"]["uid"] == server_uid and len(server_deployments(demo, ns)) == 1
    wait_cond(demo, ns, "Ready", "True")

    # --- a replica deleted and made again on the same node: it finds the same server, warm (not restarted)
    c.delete("pods", f"{NAME}-0", ns)
    demo.wait_until(lambda: (p := [x for x in serving_pods(demo, ns) if x["metadata"]["name"] == f"{NAME}-0"])
                    and p[0]["metadata"]["uid"] != first["metadata"]["uid"] and ready(p[0]), timeout=300, interval=1,
                    message=f"{NAME}-0 made again and ready")
    server = one_ready_server(demo, ns, engines=2)
    assert server["metadata"]["uid"] == server_uid

    # An L2 chunk, written as the server writes them (UID 1000, LMCache's name), for the server's successor to keep.
    l2 = disk_base / ns / NAME / f"{NAME}-cache"
    chunk = l2 / CHUNK
    chunk.write_bytes(os.urandom(4096))
    os.chown(chunk, 1000, 1000)

    # --- the server pod deleted while both replicas keep answering requests
    replicas = serving_pods(demo, ns)
    assert len(replicas) == 2 and all(ready(p) for p in replicas)
    answers: list[object] = []
    stop = threading.Event()

    def load():
        while not stop.is_set():
            for p in replicas:
                try:
                    answers.append(complete(p))
                except Exception as exc:  # noqa: BLE001 - a lost request is what this counts
                    answers.append(exc)
            time.sleep(0.2)

    sender = threading.Thread(target=load, daemon=True)
    sender.start()
    try:
        time.sleep(2)
        c.delete("pods", server["metadata"]["name"], ns)
        seen = _seen_while_replaced(demo, ns, server_uid)
        print(f"server pod deleted; SharedCacheReady meanwhile: {seen}")
        server = one_ready_server(demo, ns, engines=2, other_than=server_uid)
        wait_cond(demo, ns, "SharedCacheReady", "True", "ServersReady")
        time.sleep(2)
    finally:
        stop.set()
        sender.join(timeout=30)
    failed = [a for a in answers if a != 200]
    print(f"{len(answers)} requests sent while the server was deleted and came back; {len(failed)} not answered 200")
    assert answers and not failed, failed[:5]
    assert server["spec"]["nodeName"] == node.NAME
    kept = disk_report(server)
    assert kept.get("disk") == "kept", kept  # the same resource and fingerprint: the new server finds the chunk
    assert chunk.exists()

    # --- a fingerprint change empties the L2: other chunk boundaries, other hashes and sizes. The replicas roll too:
    # vLLM's connector reads the chunk size from the server once, at start.
    before = server["metadata"]["uid"]
    c.patch("kvs", NAME, {"spec": {"offload": {"chunkSize": 512}}}, ns)
    server = one_ready_server(demo, ns, engines=2, other_than=before)
    wait_cond(demo, ns, "Ready", "True")
    report = disk_report(server)
    assert report.get("disk") == "emptied" and "chunkSize" in report.get("why", ""), report
    assert not chunk.exists()

    # --- scaled to zero: the server stays its grace period, then goes
    c.patch("kvs", NAME, {"spec": {"replicas": 0}}, ns)
    idle = wait_cond(demo, ns, "SharedCacheReady", "False", "NoReplicasPlaced")
    assert "kept until their grace period ends" in idle["message"], idle
    gone_at = time.monotonic()
    demo.wait_until(lambda: not server_deployments(demo, ns), timeout=grace + 120, interval=2,
                    message="the idle server removed after its grace period")
    print(f"idle server removed {time.monotonic() - gone_at:.0f}s after the last replica left (grace {grace}s)")
