"""A serving pod as the operator renders it, run by the real node's kubelet + containerd + runc.

The operator is the demo's (in-cluster, from the chart). Every container runs under its rendered
securityContext, volumes and limits: the disk-tier init on a real hostPath under an allowed root, the
versions init, the exporter sidecar (the operator image, UID 65532), the LMCache server sidecar, the
engine. The engine image is a STAND-IN (the `engine_image` fixture; its name says so), and the pod asks
for the node's stand-in GPU resource (kvtest.node.GPU_STAND_IN) through spec.resources.gpuResourceName:
- `make test` runs the slim stand-in (kvtest.images.STANDIN_SLIM, 0.2 GB): the stand-ins of vLLM
  (recorded H200 /metrics pages) and of the LMCache server (its /status; its L1 in /dev/shm, an L2 chunk
  in the disk tier, engines registered over its port). It holds no vLLM/LMCache: EngineVerified says so.
- KVO_STANDIN=full runs the 8.8 GB stand-in (kvtest.images.STANDIN: the serving image, vLLM's parser
  checks the flags, the LMCache server is real; EngineVerified True). Not in `make test`: importing it
  into containerd takes twice its size on disk.
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

from kvtest import condition, node

pytestmark = pytest.mark.cluster

DISK_ROOT = Path("/var/lib/kvoffload")  # one of the chart's allowedDiskRoots
FULL = node.FULL_STANDIN


def wait_cond(demo, ns, name, type_, status, timeout=300):
    def check():
        obj = demo.client.get_or_none("kvs", name, ns)
        return obj if condition(obj, type_).get("status") == status else None
    return demo.wait_until(check, timeout=timeout, interval=1, message=f"{name} {type_}={status}")


@pytest.fixture
def disk_dir():
    DISK_ROOT.mkdir(exist_ok=True)  # the admin's root (the hostPath volume, type Directory)
    d = DISK_ROOT / f"t-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_limit(pid: int) -> int:
    """The memory cgroup limit the kernel holds the process to (cgroup v1 here, v2 where there is no v1)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return int(Path(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes").read_text())
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return int(Path(f"/sys/fs/cgroup{path}/memory.max").read_text())
    raise AssertionError(f"no memory cgroup for pid {pid}")


def prometheus_scrape(tmp: Path, target: str) -> dict[str, float]:
    """A real Prometheus on the host scrapes `target` (the exporter at the pod IP) once a second.

    Returns the series it holds."""
    port = free_port()
    (tmp / "prom.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "exporter", "static_configs": [{"targets": [target]}]}]}))
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prom.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "prom.log", "w"))
    got: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/api/v1/query?query=%7Bjob%3D%22exporter%22%7D")
                res = json.loads(conn.getresponse().read())["data"]["result"]
                got = {r["metric"]["__name__"]: float(r["value"][1]) for r in res}
                if got.get("up") == 1.0 and "kvoffload_disk_bytes" in got and "kvoffload_lmcache_server_engines" in got:
                    return got
            time.sleep(1)
        return got
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_rendered_server_pod_runs_on_the_real_node(demo, node_ns, engine_image, disk_dir, tmp_path):
    t0 = time.monotonic()
    demo.client.create(node.serve_spec("standin", engine_image, disk_dir), node_ns)
    obj = wait_cond(demo, node_ns, "standin", "Ready", "True", timeout=600)
    print(f"KVOffloadServe Ready in {time.monotonic() - t0:.0f}s")
    (pod,) = demo.client.list("pods", node_ns, labels={"kvoffload.io/serve": "standin"})
    assert pod["spec"]["nodeName"] == node.NAME
    spec, name = pod["spec"], pod["metadata"]["name"]
    names = [c["name"] for c in spec["initContainers"]] + [c["name"] for c in spec["containers"]]
    assert names == ["prepare-disk-tier", "report-engine-versions", "lmcache-server", "vllm", "exporter"], names
    statuses = {s["name"]: s for s in pod["status"]["containerStatuses"] + pod["status"]["initContainerStatuses"]}
    for c in spec["containers"]:
        assert statuses[c["name"]]["ready"] and statuses[c["name"]]["restartCount"] == 0, statuses[c["name"]]
    for init in ("prepare-disk-tier", "report-engine-versions"):
        assert statuses[init]["state"]["terminated"]["exitCode"] == 0, statuses[init]
    assert statuses["lmcache-server"]["started"] and statuses["lmcache-server"]["ready"], statuses["lmcache-server"]
    rendered = {c["name"]: c for c in spec["initContainers"] + spec["containers"]}

    # What runc was given for every container (init containers too): the rendered user, fsGroup as a
    # supplementary group, read-only root, no new privileges, the memory limit.
    oci = node.oci_specs(demo.cluster, node_ns, name)
    for cname, c in rendered.items():
        sc, proc = c["securityContext"], oci[cname]["process"]
        uid = sc.get("runAsUser", spec["securityContext"]["runAsUser"])
        assert proc["user"]["uid"] == uid and 1000 in proc["user"].get("additionalGids", []), (cname, proc["user"])
        assert oci[cname]["root"]["readonly"] is True, cname
        assert proc["noNewPrivileges"] is True, cname
        limit = oci[cname]["linux"]["resources"]["memory"]["limit"]
        assert limit == to_bytes(c["resources"]["limits"]["memory"]), (cname, limit)
    assert proc_caps(oci["prepare-disk-tier"]) == {"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER"}
    assert all(not proc_caps(oci[n]) for n in rendered if n != "prepare-disk-tier")

    # The running processes as the kernel holds them: uid, groups, no capabilities, seccomp, the cgroup's
    # limit, a read-only root mount.
    pids = node.task_pids(demo.cluster, pod)
    assert set(pids) == {"lmcache-server", "vllm", "exporter"}, pids
    for cname, pid in pids.items():
        st, sc = node.proc_status(pid), rendered[cname]["securityContext"]
        uid = sc.get("runAsUser", spec["securityContext"]["runAsUser"])
        assert st["Uid"].split()[0] == str(uid) and "1000" in st["Groups"].split(), (cname, st["Uid"], st["Groups"])
        assert (st["CapEff"], st["NoNewPrivs"], st["Seccomp"]) == ("0000000000000000", "1", "2"), (cname, st)
        assert memory_limit(pid) == to_bytes(rendered[cname]["resources"]["limits"]["memory"]), cname
        assert node.mount_options(pid)["/"][0].split(",")[0] == "ro", (cname, node.mount_options(pid)["/"])

    # The memory-backed /dev/shm: one tmpfs of the rendered sizeLimit that the server and vLLM share; the
    # server's L1 segment lives in it.
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm_size = to_bytes(volumes["dshm"]["emptyDir"]["sizeLimit"])
    shm = {n: node.mount_options(pids[n])["/dev/shm"] for n in ("lmcache-server", "vllm")}
    assert {fs for _, fs in shm.values()} == {"tmpfs"}, shm
    views = {n: os.statvfs(f"/proc/{pids[n]}/root/dev/shm") for n in ("lmcache-server", "vllm")}
    assert {v.f_blocks * v.f_frsize for v in views.values()} == {shm_size}, (views, shm_size)
    assert (os.stat(f"/proc/{pids['vllm']}/root/dev/shm").st_dev
            == os.stat(f"/proc/{pids['lmcache-server']}/root/dev/shm").st_dev)
    if not FULL:  # the slim stand-in server does at start what the real one does on a GPU host and at its first chunk
        segments = list(Path(f"/proc/{pids['vllm']}/root/dev/shm").iterdir())
        assert [p.stat().st_size for p in segments] == [to_bytes(node.STANDIN_CPU_TIER)], segments
        # The sidecar, read-only root, made numba's cache directory where the pod's /tmp is.
        assert Path(f"/proc/{pids['lmcache-server']}/root/tmp/numba-cache").is_dir()

    # The disk tier: kubelet made <root>/<ns>/<serve>/<pod> (subPathExpr) on the host; the init gave it to
    # UID 1000, 0750; the server wrote there as 1000 and the exporter (65532, fsGroup 1000) reads it.
    d = disk_dir / node_ns / "standin" / name
    st = d.stat()
    assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o7777)) == (1000, 1000, "0o750"), (d, st)
    if not FULL:
        assert [p.name for p in d.iterdir()] == ["standin-chunk-0.kvcache"], d
        assert d.joinpath("standin-chunk-0.kvcache").stat().st_uid == 1000

    # Probes against the pod IP: the exporter listens on the pod IP only, and kubelet's liveness probe passes there.
    ip = pod["status"]["podIP"]
    port = next(p["containerPort"] for p in rendered["exporter"]["ports"] if p["name"] == "metrics")
    assert (ip, port) in node.listening(pids["exporter"]) and ("0.0.0.0", port) not in node.listening(pids["exporter"])
    assert rendered["exporter"]["livenessProbe"]["httpGet"]["port"] == "metrics"

    # A real Prometheus scrapes the exporter at the pod IP through the rendered port: it read the files and
    # the servers of the other containers.
    series = prometheus_scrape(tmp_path, f"{ip}:{port}")
    assert series.get("up") == 1.0, series
    assert "kvoffload_disk_bytes" in series and "kvoffload_lmcache_server_engines" in series, series
    if not FULL:
        # the server's chunk, read by the exporter through fsGroup
        assert series["kvoffload_disk_bytes"] == 1 << 20, series
        # the stand-in vLLM registered over the server's port
        assert series["kvoffload_lmcache_server_engines"] == 1, series

    # Every condition says what is true of it.
    obj = demo.client.get("kvs", "standin", node_ns)
    conds = {c["type"]: c for c in obj["status"]["conditions"]}
    for t in ("ConfigValid", "Scheduled", "DiskTierReady", "Ready"):
        assert conds[t]["status"] == "True", conds[t]
    if FULL:
        assert conds["EngineVerified"]["status"] == "True", conds["EngineVerified"]
        assert obj["status"]["versions"]["running"][0]["vllm"] == "0.26.0", obj["status"]["versions"]
    else:  # the slim stand-in holds neither: the versions init says so, the exporter serves it, the operator reports it
        ev = conds["EngineVerified"]
        assert (ev["status"], ev["reason"]) == ("False", "EngineVersionMismatch"), ev
        assert "runs vLLM none + LMCache none" in ev["message"], ev
        assert {k: obj["status"]["versions"]["running"][0][k] for k in ("vllm", "lmcache", "torch")} == \
            dict.fromkeys(("vllm", "lmcache", "torch"), "none"), obj["status"]["versions"]


def proc_caps(spec: dict) -> set[str]:
    return set(spec["process"].get("capabilities", {}).get("effective") or [])


def to_bytes(q: str) -> int:
    from kvoffload.api.quantity import to_bytes as parse
    return parse(q, "quantity")


def test_over_its_limit_the_engine_is_oom_killed_and_ready_names_it(demo, node_ns, engine_image, disk_dir):
    # The stand-in holds more host memory than the vllm container's limit (its terms + at least 1 GiB of
    # headroom), as an engine that outgrew its budget: the kernel stops it at the limit.
    hold = 4 << 30
    demo.client.create(node.serve_spec("tight", engine_image, disk_dir,
                                       env=[{"name": "KVO_STANDIN_HOST_BYTES", "value": str(hold)}]),
                       node_ns)

    def oom():
        obj = demo.client.get_or_none("kvs", "tight", node_ns)
        ready = condition(obj, "Ready")
        return obj if ready.get("status") == "False" and "OOMKilled" in ready.get("message", "") else None
    obj = demo.wait_until(oom, timeout=300, interval=1, message="Ready=False naming the OOM kill")
    msg = condition(obj, "Ready")["message"]
    assert "vllm" in msg, msg
    (pod,) = demo.client.list("pods", node_ns, labels={"kvoffload.io/serve": "tight"})
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "vllm"]
    assert to_bytes(c["resources"]["limits"]["memory"]) < hold, c["resources"]
    (cs,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == "vllm"]
    last = cs.get("lastState", {}).get("terminated") or cs["state"].get("terminated")
    assert last["reason"] == "OOMKilled" and last["exitCode"] == 137, cs
    assert os.path.isdir(disk_dir)
