"""The disk tier's hostPath and the node janitor (the chart's DaemonSet, `kvoffload clean-disk --in-cluster`) on the
real node.

The escape (issue 32): pod a-0 plants `esc -> <outside>` in its own directory; a second resource whose
spec.offload.disk.path runs through that link is accepted by the operator (it only sees a string), but its pod
never starts: the hostPath volume is the admin's root and the whole path below it is a subPath, which kubelet
opens component by component without following links. Nothing is written outside the root.

The janitor: serving pods of several KVOffloadServes (one after the other: the node has 2 CPUs) write their disk
tier under the allowed root (<root>/<rel>/<namespace>/<name>/<pod>, beside a root-owned owner marker with the
resource's uid); then they are deleted. It removes the pod directories of incarnations whose final reclaimPolicy
was Delete and keeps: a Retain one; one switched Delete -> Retain and deleted within one sweep interval (the
watch's DELETED event carries the final spec); the earlier incarnation's directory when a same-named resource
with Delete is deleted; an orphan it never saw. It never follows a link out of its root, sees nothing but the
allowed roots and its state directory (outside them), runs as root with DAC_OVERRIDE alone, a read-only root,
no new privileges, and reads KVOffloadServes with get/list/watch only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from kvtest import ROOT, condition, node

pytestmark = pytest.mark.cluster

RELEASE_NS = "kvoffload-system"
DISK_ROOT = Path("/var/lib/kvoffload")  # one of the chart's allowedDiskRoots; the only one this node has
CAP_DAC_OVERRIDE = 1 << 1
SWEEP_S = 30  # janitor.intervalSeconds: the chart's minimum


@pytest.fixture
def janitor_root():
    """A tenant's path below the allowed root, and a directory outside every root."""
    DISK_ROOT.mkdir(exist_ok=True)  # the admin's root (the hostPath volume, type Directory)
    tag = uuid.uuid4().hex[:8]
    root, outside = DISK_ROOT / f"janitor-{tag}", Path("/var/tmp") / f"kvo-outside-{tag}"
    yield root, outside
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(outside, ignore_errors=True)


def prepared(demo, ns: str, name: str) -> None:
    demo.wait_until(lambda: condition(demo.client.get("kvs", name, ns), "DiskTierReady").get("status") == "True",
                    timeout=300, interval=1, message=f"{name}: its pod directory prepared")


def scaled_to_zero(demo, ns: str, name: str) -> None:
    demo.client.patch("kvs", name, {"spec": {"replicas": 0}}, ns)
    demo.wait_until(lambda: not demo.client.list("pods", ns), timeout=180, interval=1, message=f"{name}'s pods gone")


def marker(pod_dir: Path) -> dict:
    f = pod_dir.parent / f".kvoffload-owner-{pod_dir.name}.json"
    assert f.stat().st_uid == 0, f  # root's: a tenant container cannot write there
    return json.loads(f.read_text())


def test_a_link_a_pod_plants_in_its_own_directory_leads_no_other_resource_out_of_the_root(demo, node_ns, engine_image,
                                                                                         janitor_root):
    base, outside = janitor_root
    outside.mkdir(parents=True)
    (outside / "keep.txt").write_text("outside every root")
    demo.client.create(node.serve_spec("a", engine_image, base), node_ns)
    try:
        prepared(demo, node_ns, "a")
        a0 = base / node_ns / "a" / "a-0"
        assert (a0.stat().st_uid, a0.stat().st_mode & 0o777) == (1000, 0o750)
        assert marker(a0)["uid"] == demo.client.get("kvs", "a", node_ns)["metadata"]["uid"]
        scaled_to_zero(demo, node_ns, "a")
        # What pod a-0 (UID 1000, owner of its directory) can do: plant a link to outside the root.
        (a0 / "esc").symlink_to(outside)
        os.lchown(a0 / "esc", 1000, 1000)
        demo.client.create(node.serve_spec("b", engine_image, a0 / "esc" / "lib"), node_ns)  # a valid string

        def refused():
            pods = demo.client.list("pods", node_ns)
            for st in (pods[0]["status"].get("initContainerStatuses") or []) if pods else []:
                waiting = (st.get("state") or {}).get("waiting") or {}
                if waiting.get("reason") == "CreateContainerConfigError":
                    return st["name"], waiting.get("message", "")
            return None

        name, message = demo.wait_until(refused, timeout=180, interval=1, message="kubelet refusing b-0's subPath")
        assert name == "prepare-disk-tier" and "subPath" in message, message
        assert condition(demo.client.get("kvs", "b", node_ns), "DiskTierReady").get("status") != "True"
        # Nothing was created or written outside the root, and the link is still just a link.
        assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"], sorted(map(str, outside.rglob("*")))
        assert (outside / "keep.txt").read_text() == "outside every root" and (a0 / "esc").is_symlink()
    finally:
        for name in ("a", "b"):
            demo.client.delete("kvs", name, node_ns, missing_ok=True)


def janitor_pod(demo) -> dict | None:
    pods = [p for p in demo.client.list("pods", RELEASE_NS, labels={"app.kubernetes.io/component": "janitor"})
            if p["spec"].get("nodeName") == node.NAME and not p["metadata"].get("deletionTimestamp")]
    return pods[0] if pods and condition(pods[0], "Ready").get("status") == "True" else None


def state(state_dir: Path) -> dict:
    f = state_dir / "state.json"
    return {uid: e["reclaimPolicy"] for uid, e in json.loads(f.read_text())["deleted"].items()} if f.exists() else {}


def test_the_janitor_reclaims_a_deleted_incarnations_directory_and_nothing_else(
        demo, node_ns, engine_image, janitor_root, tmp_path):
    root, outside = janitor_root
    state_dir = Path("/var/tmp") / f"kvo-janitor-state-{uuid.uuid4().hex[:8]}"
    chart = (demo.demo_dir or ROOT) / "charts" / "kvoffload-operator"
    values = tmp_path / "janitor.yaml"
    values.write_text(yaml.safe_dump({
        "operator": {"config": {"allowedDiskRoots": [str(DISK_ROOT)]}},  # the roots this node has: one setting
        "janitor": {"enabled": True, "statePath": str(state_dir), "intervalSeconds": SWEEP_S, "minAgeSeconds": 0,
                    "unknownPolicy": "Retain", "tolerations": node.PLACEMENT["tolerations"]}}))
    outside.mkdir(parents=True)
    (outside / "keep.txt").write_text("not the janitor's")
    names = ("kept", "gone", "flip", "twin")
    uid = {}

    def make(name: str, reclaim: str) -> Path:
        demo.client.create(node.serve_spec(name, engine_image, root, reclaim=reclaim), node_ns)
        prepared(demo, node_ns, name)
        uid[name] = demo.client.get("kvs", name, node_ns)["metadata"]["uid"]
        d = root / node_ns / name / f"{name}-0"
        assert marker(d)["uid"] == uid[name]
        # As a pod would leave them: files of UID 1000.
        (d / "chunk.kvcache").write_bytes(b"\0" * 4096)
        os.chown(d / "chunk.kvcache", 1000, 1000)
        scaled_to_zero(demo, node_ns, name)  # still live; one serving pod at a time fits the node's 2 CPUs
        return d

    before = demo.helm("get", "values", "kvoffload", "-n", RELEASE_NS, "-o", "yaml").stdout
    try:
        demo.helm("upgrade", "kvoffload", str(chart), "-n", RELEASE_NS, "--reuse-values", "-f", str(values),
                  "--wait", "--timeout", "3m")
        demo.wait_until(lambda: janitor_pod(demo), timeout=180, message="the janitor pod Ready on the real node")
        kept, gone, flip = make("kept", "Retain"), make("gone", "Delete"), make("flip", "Delete")
        (gone / "escape").symlink_to(outside / "keep.txt")  # a link out of the root: removed, never followed
        # The first incarnation of `twin` (Retain) had two pods here; the second (Delete) runs twin-0 only.
        old_twin = make("twin", "Retain")
        old_uid = uid["twin"]
        demo.client.delete("kvs", "twin", node_ns)
        demo.wait_until(lambda: not demo.client.get_or_none("kvs", "twin", node_ns), timeout=60, message="twin gone")
        twin1 = old_twin.with_name("twin-1")  # what the old incarnation's second pod left (the operator's own code)
        subprocess.run([sys.executable, "-m", "kvoffload.cli.main", "prepare-disk-tier", "--parent", str(twin1.parent),
                        "--namespace", node_ns, "--name", "twin", "--pod", "twin-1", "--owner-uid", old_uid,
                        "--chown", "1000:1000"], check=True)
        (twin1 / "chunk.kvcache").write_bytes(b"\0" * 4096)
        make("twin", "Delete")  # a new incarnation: its twin-0 is marked with its own uid
        assert uid["twin"] != old_uid and marker(twin1)["uid"] == old_uid
        orphan = root / node_ns / "never-seen" / "never-seen-0"
        orphan.mkdir(parents=True)
        (orphan / "chunk.kvcache").write_bytes(b"\0" * 4096)

        # flip: Delete -> Retain, then deleted at once, well within one sweep interval.
        demo.client.patch("kvs", "flip", {"spec": {"offload": {"disk": {"reclaimPolicy": "Retain"}}}}, node_ns)
        for name in ("gone", "kept", "flip", "twin"):
            demo.client.delete("kvs", name, node_ns)
        want = {uid["gone"]: "Delete", uid["kept"]: "Retain", uid["flip"]: "Retain", uid["twin"]: "Delete",
                old_uid: "Retain"}
        demo.wait_until(lambda: want.items() <= state(state_dir).items(), timeout=60, interval=1,
                        message="the janitor's watch recorded each deleted incarnation's final policy")
        demo.wait_until(lambda: not gone.exists() and not (root / node_ns / "twin" / "twin-0").exists(),
                        timeout=3 * SWEEP_S, interval=1, message="the janitor removed gone-0 and the new twin-0")
        metrics_page = None
        pod = janitor_pod(demo)
        port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
        url = f"http://{pod['status']['podIP']}:{port}/metrics"
        metrics_page = urllib.request.urlopen(url, timeout=5).read().decode()  # noqa: S310
        assert (kept / "chunk.kvcache").exists()  # reclaimPolicy Retain
        assert (flip / "chunk.kvcache").exists()  # its final spec said Retain
        assert (twin1 / "chunk.kvcache").exists()  # the earlier incarnation's (Retain): not the later one's call
        assert orphan.is_dir()  # no marker: never touched
        assert (outside / "keep.txt").read_text() == "not the janitor's"  # the link was removed, not followed
        removed = [ln for ln in metrics_page.splitlines()
                   if ln.startswith("kvoffload_janitor_removed_directories_total{")]
        assert removed and sum(float(ln.split()[-1]) for ln in removed) >= 2, metrics_page[-2000:]
        assert not any(p.is_relative_to(DISK_ROOT) for p in state_dir.rglob("*"))

        # Least privilege, as the kernel holds the process: root with DAC_OVERRIDE only, no new privileges,
        # seccomp, read-only root; the only host directories it sees are the allowed root and its state.
        (cs,) = pod["status"]["containerStatuses"]
        cid = cs["containerID"].removeprefix("containerd://")
        tasks = {p[0]: int(p[1]) for p in (ln.split()
                                           for ln in node.ctr(demo.cluster, "tasks", "ls").stdout.splitlines()[1:])
                 if p}
        st = dict((k, v.strip()) for k, v in (ln.split(":", 1)
                                              for ln in Path(f"/proc/{tasks[cid]}/status").read_text().splitlines()))
        assert st["Uid"].split()[0] == "0" and int(st["CapEff"], 16) == CAP_DAC_OVERRIDE, st
        assert int(st["CapBnd"], 16) == CAP_DAC_OVERRIDE and (st["NoNewPrivs"], st["Seccomp"]) == ("1", "2"), st
        mounts = {ln.split()[4]: ln.split()[5] for ln in Path(f"/proc/{tasks[cid]}/mountinfo").read_text().splitlines()}
        assert mounts["/"].split(",")[0] == "ro", mounts["/"]
        host = {m for m in mounts if m.startswith("/host")}
        assert host == {f"/host{DISK_ROOT}"}, host
        assert "/var/lib/kvoffload-janitor" in mounts
        sa = pod["spec"]["serviceAccountName"]
        who = f"system:serviceaccount:{RELEASE_NS}:{sa}"
        can = {what: demo.kubectl("auth", "can-i", *what.split(), "--as", who, check=False).stdout.strip()
               for what in ("watch kvoffloadserves.kvoffload.io -A", "delete kvoffloadserves.kvoffload.io -A",
                            "list pods -A", "get secrets -A", "list nodes")}
        assert can == {"watch kvoffloadserves.kvoffload.io -A": "yes", "delete kvoffloadserves.kvoffload.io -A": "no",
                       "list pods -A": "no", "get secrets -A": "no", "list nodes": "no"}, can
    finally:
        for name in names:
            demo.client.delete("kvs", name, node_ns, missing_ok=True)
        demo.helm("upgrade", "kvoffload", str(chart), "-n", RELEASE_NS, "--reset-values", "-f", "-", "--wait",
                  "--timeout", "3m",
                  input=before)  # the release's values as they were: no janitor
        shutil.rmtree(state_dir, ignore_errors=True)


def test_the_chart_refuses_a_janitor_state_path_inside_an_allowed_root(demo):
    chart = (demo.demo_dir or ROOT) / "charts" / "kvoffload-operator"
    for path in ("/var/lib/kvoffload/state", "/mnt/nvme", "/var/lib"):
        cp = demo.helm("upgrade", "kvoffload", str(chart), "-n", RELEASE_NS, "--reuse-values", "--set",
                       "janitor.enabled=true",
                       "--set", f"janitor.statePath={path}", "--dry-run", check=False)
        assert cp.returncode != 0 and "janitor.statePath" in cp.stderr, (path, cp.stderr)
