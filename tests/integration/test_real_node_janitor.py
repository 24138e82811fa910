"""The node janitor (the chart's DaemonSet, `kvoffload clean-disk --in-cluster`) on the real node.

Serving pods of two KVOffloadServes (one after the other) write their disk tier under a hostPath root (kubelet makes
<root>/<namespace>/<name>/<pod>, the pods' init container hands it to UID 1000); the janitor sees both
live, then both are deleted: it removes the directory of the one whose reclaimPolicy was Delete,
keeps the Retain one's and an orphan it never saw live (unknownPolicy Retain), never follows a link
out of its root, and sees nothing but the roots it mounts. It runs as root with DAC_OVERRIDE alone
(kubelet makes the parents root-owned, the pods' files are UID 1000's), a read-only root, no new
privileges, and reads KVOffloadServes with get/list only.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from kvtest import ROOT, condition, node

pytestmark = pytest.mark.cluster

RELEASE_NS = "kvoffload-system"
DISK_ROOT = Path("/var/lib/kvoffload")  # one of the chart's allowedDiskRoots
CAP_DAC_OVERRIDE = 1 << 1
SWEEP_S = 30  # janitor.intervalSeconds: the chart's minimum


@pytest.fixture
def janitor_root():
    root = DISK_ROOT / f"janitor-{uuid.uuid4().hex[:8]}"
    outside = DISK_ROOT / f"outside-{uuid.uuid4().hex[:8]}"
    yield root, outside
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(outside, ignore_errors=True)


def janitor_pod(demo) -> dict | None:
    pods = [p for p in demo.client.list("pods", RELEASE_NS, labels={"app.kubernetes.io/component": "janitor"})
            if p["spec"].get("nodeName") == node.NAME and not p["metadata"].get("deletionTimestamp")]
    return pods[0] if pods and condition(pods[0], "Ready").get("status") == "True" else None


def state(root: Path) -> dict:
    f = root / ".kvoffload-janitor-state.json"
    return json.loads(f.read_text())["policies"] if f.exists() else {}


def test_the_janitor_reclaims_a_deleted_resources_directory_and_nothing_else(demo, node_ns, engine_image, janitor_root,
                                                                              tmp_path):
    root, outside = janitor_root
    chart = (demo.demo_dir or ROOT) / "charts" / "kvoffload-operator"
    values = tmp_path / "janitor.yaml"
    values.write_text(yaml.safe_dump({"janitor": {
        "enabled": True, "paths": [str(root)], "intervalSeconds": SWEEP_S, "minAgeSeconds": 0, "unknownPolicy": "Retain",
        "tolerations": node.PLACEMENT["tolerations"]}}))
    # Outside every janitor path but under the same allowed root: the janitor cannot even see it.
    outside.mkdir(parents=True)
    (outside / "keep.txt").write_text("not the janitor's")
    def prepared(name: str) -> None:
        demo.wait_until(lambda: condition(demo.client.get("kvs", name, node_ns), "DiskTierReady").get("status") == "True",
                        timeout=300, interval=1, message=f"{name}: its pod directory prepared")

    # One serving pod at a time fits the node's 2 CPUs (the LMCache server requests one): "kept" makes its
    # directory, then goes to 0 replicas (still live), then "gone" makes its own.
    before = demo.helm("get", "values", "kvoffload", "-n", RELEASE_NS, "-o", "yaml").stdout
    demo.client.create(node.serve_spec("kept", engine_image, root, reclaim="Retain"), node_ns)
    try:
        demo.helm("upgrade", "kvoffload", str(chart), "-n", RELEASE_NS, "--reuse-values", "-f", str(values),
                  "--wait", "--timeout", "3m")
        demo.wait_until(lambda: janitor_pod(demo), timeout=180, message="the janitor pod Ready on the real node")
        prepared("kept")
        demo.client.patch("kvs", "kept", {"spec": {"replicas": 0}}, node_ns)
        demo.wait_until(lambda: not demo.client.list("pods", node_ns), timeout=180, interval=1, message="kept-0 gone")
        demo.client.create(node.serve_spec("gone", engine_image, root, reclaim="Delete"), node_ns)
        prepared("gone")
        gone, kept = root / node_ns / "gone" / "gone-0", root / node_ns / "kept" / "kept-0"
        assert gone.is_dir() and kept.is_dir(), sorted(map(str, root.rglob("*")))
        # As a pod would leave them: files of UID 1000, a link out of the root (the link goes, its target stays).
        for d in (gone, kept):
            (d / "chunk.kvcache").write_bytes(b"\0" * 4096)
            (d / "chunk.kvcache").chmod(0o640)
            os.chown(d / "chunk.kvcache", 1000, 1000)
        (gone / "escape").symlink_to(outside / "keep.txt")
        orphan = root / node_ns / "never-seen" / "never-seen-0"
        orphan.mkdir(parents=True)
        (orphan / "chunk.kvcache").write_bytes(b"\0" * 4096)
        demo.wait_until(lambda: {f"{node_ns}/gone": "Delete", f"{node_ns}/kept": "Retain"}.items() <= state(root).items(),
                        timeout=3 * SWEEP_S, interval=1, message="the janitor saw both resources live (its state file)")
        assert gone.is_dir() and kept.is_dir()  # live: left alone

        for name in ("gone", "kept"):
            demo.client.delete("kvs", name, node_ns)
        demo.wait_until(lambda: not demo.client.list("pods", node_ns), timeout=180, interval=1, message="serving pods gone")
        demo.wait_until(lambda: not gone.exists(), timeout=3 * SWEEP_S, interval=1, message="the janitor removed gone-0")
        assert kept.is_dir() and (kept / "chunk.kvcache").exists()  # reclaimPolicy Retain
        assert orphan.is_dir()  # never seen live: unknownPolicy Retain
        assert (outside / "keep.txt").read_text() == "not the janitor's"  # the link was removed, not followed

        # What it reports, on the pod IP.
        pod = janitor_pod(demo)
        port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
        page = urllib.request.urlopen(f"http://{pod['status']['podIP']}:{port}/metrics", timeout=5).read().decode()  # noqa: S310
        removed = [ln for ln in page.splitlines() if ln.startswith("kvoffload_janitor_removed_directories_total{")]
        assert removed and float(removed[0].split()[-1]) >= 1, page[-2000:]

        # Least privilege, as the kernel holds the process: root with DAC_OVERRIDE only, no new privileges,
        # seccomp, read-only root; the only host directories it sees are its paths.
        (cs,) = pod["status"]["containerStatuses"]
        cid = cs["containerID"].removeprefix("containerd://")
        tasks = {p[0]: int(p[1]) for p in (ln.split() for ln in node.ctr(demo.cluster, "tasks", "ls").stdout.splitlines()[1:]) if p}
        st = dict((k, v.strip()) for k, v in (ln.split(":", 1) for ln in Path(f"/proc/{tasks[cid]}/status").read_text().splitlines()))
        assert st["Uid"].split()[0] == "0" and int(st["CapEff"], 16) == CAP_DAC_OVERRIDE, st
        assert int(st["CapBnd"], 16) == CAP_DAC_OVERRIDE and (st["NoNewPrivs"], st["Seccomp"]) == ("1", "2"), st
        mounts = {ln.split()[4]: ln.split()[5] for ln in Path(f"/proc/{tasks[cid]}/mountinfo").read_text().splitlines()}
        assert mounts["/"].split(",")[0] == "ro", mounts["/"]
        host = {m for m in mounts if m.startswith("/host")}
        assert host == {f"/host{root}"}, host
        sa = pod["spec"]["serviceAccountName"]
        who = f"system:serviceaccount:{RELEASE_NS}:{sa}"
        can = {what: demo.kubectl("auth", "can-i", *what.split(), "--as", who, check=False).stdout.strip()
               for what in ("list kvoffloadserves.kvoffload.io -A", "delete kvoffloadserves.kvoffload.io -A",
                            "list pods -A", "get secrets -A", "list nodes")}
        assert can == {"list kvoffloadserves.kvoffload.io -A": "yes", "delete kvoffloadserves.kvoffload.io -A": "no",
                       "list pods -A": "no", "get secrets -A": "no", "list nodes": "no"}, can
    finally:
        for name in ("gone", "kept"):
            demo.client.delete("kvs", name, node_ns, missing_ok=True)
        demo.helm("upgrade", "kvoffload", str(chart), "-n", RELEASE_NS, "--reset-values", "-f", "-", "--wait", "--timeout", "3m",
                  input=before)  # the release's values as they were: no janitor


def test_the_chart_refuses_a_janitor_path_outside_the_allowed_roots(demo):
    chart = (demo.demo_dir or ROOT) / "charts" / "kvoffload-operator"
    for path in ("/etc", "/var/lib/kvoffload/../../etc", "/var/lib/kvoffload"):
        cp = demo.helm("upgrade", "kvoffload", str(chart), "-n", RELEASE_NS, "--reuse-values", "--set", "janitor.enabled=true",
                       "--set", f"janitor.paths[0]={path}", "--dry-run", check=False)
        assert cp.returncode != 0 and "is not strictly below one of operator.config.allowedDiskRoots" in cp.stderr, (path, cp.stderr)
