"""The disk tier kept across pod restarts (issue 35): the fingerprint, the rendered init step, its keep-or-empty
decision on real directories, and what DiskTierReady says about it.

Backend lmcache-server's LMCache server finds an L2 chunk by its file name (fs_native), so a new server reads the
files an earlier one wrote: its pod directory is kept while the same incarnation prepared it for the same
fingerprint. Backend lmcache's in-process disk tier never reads them (index lost): always emptied.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kvoffload.api.settings import Settings
from kvoffload.backends import lmcache_server
from kvoffload.cli import main as cli_main
from kvoffload.cli import why
from kvoffload.controller import conditions, pipeline
from kvoffload.engine import images
from kvoffload.node import disk_prepare, owner_marker
from kvoffload.rendering import disk_tier, render
from kvtest.specs import T0, body, pod, spec, sts

SERVER = {"offload__backend": "lmcache-server"}
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="owner markers are root's; the tests chown to UID 1000")


def desired(settings: Settings | None = None, **patch):
    return pipeline.desired("svc", "ns", "uid-1", spec(**{**SERVER, **patch}), settings or Settings())


def fp(settings: Settings | None = None, **patch):
    d = desired(settings, **patch)
    return disk_tier.fingerprint(d.spec, d.budget, settings or Settings(), lmcache_server.BACKEND)


def init_args(**patch) -> list[str]:
    sts_ = next(c for c in desired(**patch).children if c["kind"] == "StatefulSet")
    (init,) = [c for c in sts_["spec"]["template"]["spec"]["initContainers"] if c["name"] == render.DISK_INIT]
    return init["args"]


def arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# ----------------------------------------------------------------------------- the fingerprint (pure)


OTHER_IMAGE = next(i for i, k in images.KNOWN_IMAGES.items() if (k.vllm, k.lmcache) == ("0.26.0", "0.5.3"))


@pytest.mark.parametrize("field, patch", [
    ("chunkSize", {"offload__chunkSize": 512}),
    ("kvDtype", {"model__kvDtype": "fp8"}),
    ("dtype", {"engine__dtype": "float16"}),
    ("tensorParallelSize", {"engine__tensorParallelSize": 2}),
    ("servedName", {"model__servedName": "chat"}),
    ("image", {"engine__image": OTHER_IMAGE, "engine__vllmVersion": "0.26.0", "engine__lmcacheVersion": "0.5.3"}),
    ("extraArgs", {"engine__extraArgs": ["--enable-chunked-prefill"]}),
    ("env", {"engine__env": [{"name": "VLLM_ATTENTION_BACKEND", "value": "FLASHINFER"}]}),
])
def test_what_changes_the_key_or_the_bytes_changes_the_fingerprint(field, patch):
    before, after = fp(), fp(**patch)
    assert before is not None and after is not None
    assert field in {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}, (before, after)


def test_the_hash_seed_setting_changes_the_fingerprint():
    assert fp()["pythonHashSeed"] == "0" and fp(Settings(python_hash_seed="7"))["pythonHashSeed"] == "7"


@pytest.mark.parametrize("patch", [{"replicas": 3}, {"offload__cpu__size": "64Gi"}, {"offload__disk__size": "400Gi"},
                                   {"engine__maxNumSeqs": 8}, {"offload__disk__reclaimPolicy": "Retain"}])
def test_what_leaves_the_files_readable_leaves_the_fingerprint(patch):
    assert disk_tier.encode(fp(**patch)) == disk_tier.encode(fp())


def test_no_fingerprint_where_nothing_is_kept():
    lm = pipeline.desired("svc", "ns", "uid-1", spec(), Settings())
    assert disk_tier.fingerprint(lm.spec, lm.budget, Settings(), render.backends.get("lmcache")) is None  # index lost
    eph = desired(offload__disk={"storageClassName": "local-nvme", "size": "200Gi"})
    assert disk_tier.fingerprint(eph.spec, eph.budget, Settings(), lmcache_server.BACKEND) is None  # new per pod


def test_the_init_step_gets_the_fingerprint_and_the_cap_and_reports_back():
    args = init_args()
    assert json.loads(arg(args, "--fingerprint")) == fp()
    assert arg(args, "--fingerprint") == disk_tier.encode(fp())
    # 20% of the 200Gi budget: above LMCache's L2 eviction watermark (0.8), which is all it counts and evicts.
    assert int(arg(args, "--keep-bytes")) == 200 * 2**30 // 5 == lmcache_server.kept_bytes(200 * 2**30)
    assert arg(args, "--report") == render.TERMINATION_LOG
    lm = init_args(offload__backend="lmcache")
    assert "--fingerprint" not in lm and "--keep-bytes" not in lm and arg(lm, "--report") == render.TERMINATION_LOG


# ----------------------------------------------------------------------------- keep or empty (pure)


def owner(uid: str = "u1", fingerprint: dict | None = None) -> owner_marker.Owner:
    return owner_marker.Owner("ns", "svc", "svc-0", uid, disk_prepare.digests(fingerprint or {}))


FP = {"chunkSize": 256, "kvDtype": "auto", "model": "m"}


@pytest.mark.parametrize("previous, new, kept, why", [
    (owner("u1", FP), owner("u1", FP), True, "same resource and fingerprint"),
    (owner("u1", FP), owner("u1", {**FP, "chunkSize": 512}), False, "fingerprint changed (chunkSize)"),
    (owner("u1", FP), owner("u1", {**FP, "extra": 1}), False, "fingerprint changed (extra)"),
    (owner("u0", FP), owner("u1", FP), False, "another incarnation of ns/svc (uid u0)"),
    (owner("u1"), owner("u1", FP), False, "no fingerprint"),
    (None, owner("u1", FP), False, "no owner marker"),
    (owner("", FP), owner("", FP), False, "no resource uid"),
    (owner("u1", FP), owner("u1"), False, "never reads files an earlier process wrote"),
])
def test_decide(previous, new, kept, why):
    got = disk_prepare.decide(previous, new)
    assert got[0] is kept and why in got[1] and got[1].startswith("kept" if kept else "emptied"), got


def test_the_marker_holds_digests_only_and_round_trips():
    o = owner("u1", {"env": [{"name": "X", "value": "y" * 100_000}], **FP})
    data = owner_marker.encode(o)
    assert len(data) < owner_marker.MAX_BYTES and b"yyyy" not in data
    assert owner_marker.decode(data, "ns", "svc", "svc-0") == o


# ----------------------------------------------------------------------------- on real directories


def chunk(d: Path, name: str, size: int, age_s: int) -> Path:
    f = d / name
    f.write_bytes(b"k" * size)
    os.chown(f, 1000, 1000)  # as the server (UID 1000) leaves them
    t = 1_700_000_000 - age_s
    os.utime(f, (t, t))
    return f


@as_root
def test_a_restarted_pod_keeps_its_newest_chunks_and_nothing_else(tmp_path):
    parent = tmp_path / "lmcache" / "ns" / "svc"
    parent.mkdir(parents=True)
    first = disk_prepare.prepare_pod_dir(str(parent), owner("u1", FP), 1000, 1000, keep_bytes=300)
    assert not first.kept and "no owner marker" in first.why
    d = parent / "svc-0"
    for i, age in enumerate((10, 20, 30, 40)):  # 4 chunks of 100 bytes, chunk-0 the newest
        chunk(d, f"m@0x00000000@0@{i:02x}.data", 100, age)
    chunk(d, "m@0x00000000@0@ff.tmp", 50, 0)  # a killed writer's temporary file
    (d / "sub").mkdir()
    (d / "sub" / "x.data").write_bytes(b"s")
    (d / "link.data").symlink_to("/etc/hostname")  # never followed, never kept
    again = disk_prepare.prepare_pod_dir(str(parent), owner("u1", FP), 1000, 1000, keep_bytes=300)
    assert again.kept and (again.kept_files, again.kept_bytes) == (3, 300), again
    assert sorted(p.name for p in d.iterdir()) == [f"m@0x00000000@0@{i:02x}.data" for i in range(3)]
    assert (again.files, again.bytes) == (4, 100 + 50 + 1), again  # chunk-3 (the oldest), tmp, sub/x.data, link
    assert (d.stat().st_uid, d.stat().st_mode & 0o777) == (1000, 0o750)
    marker = json.loads((parent / owner_marker.file_name("svc-0")).read_text())
    assert marker["uid"] == "u1" and marker["fingerprint"] == dict(disk_prepare.digests(FP))
    report = again.report()
    assert report["disk"] == "kept" and report["keptBytes"] == 300 and len(json.dumps(report)) < 4096

    changed = disk_prepare.prepare_pod_dir(str(parent), owner("u1", {**FP, "kvDtype": "fp8"}), 1000, 1000,
                                           keep_bytes=300)
    assert not changed.kept and "kvDtype" in changed.why and list(d.iterdir()) == []
    chunk(d, "m@0x00000000@0@00.data", 100, 0)
    later = disk_prepare.prepare_pod_dir(str(parent), owner("u2", {**FP, "kvDtype": "fp8"}), 1000, 1000,
                                         keep_bytes=300)
    assert not later.kept and "uid u1" in later.why and list(d.iterdir()) == []  # a later incarnation: emptied


@as_root
def test_a_start_that_did_not_finish_leaves_no_fingerprint_so_the_next_empties(tmp_path):
    parent = tmp_path / "ns" / "svc"
    parent.mkdir(parents=True)
    disk_prepare.prepare_pod_dir(str(parent), owner("u1", FP), 1000, 1000, keep_bytes=300)
    d = parent / "svc-0"
    chunk(d, "a.data", 10, 0)
    # What the init step writes before it touches the directory (the uid, no fingerprint), as a killed start left it.
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        owner_marker.write(fd, owner("u1"))
    finally:
        os.close(fd)
    done = disk_prepare.prepare_pod_dir(str(parent), owner("u1", FP), 1000, 1000, keep_bytes=300)
    assert not done.kept and "no fingerprint" in done.why and list(d.iterdir()) == []


@as_root
def test_a_fingerprint_a_tenant_writes_in_its_own_directory_counts_for_nothing(tmp_path):
    parent = tmp_path / "ns" / "svc"
    parent.mkdir(parents=True)
    disk_prepare.prepare_pod_dir(str(parent), owner("u1", FP), 1000, 1000, keep_bytes=300)
    # The marker is root's in <name>/ (no tenant mounts it); one made by UID 1000 there is not believed.
    m = parent / owner_marker.file_name("svc-0")
    m.unlink()
    m.write_bytes(owner_marker.encode(owner("u1", FP)))
    os.chown(m, 1000, 1000)
    chunk(parent / "svc-0", "a.data", 10, 0)
    done = disk_prepare.prepare_pod_dir(str(parent), owner("u1", FP), 1000, 1000, keep_bytes=300)
    assert not done.kept and "no owner marker" in done.why and list((parent / "svc-0").iterdir()) == []


@as_root
def test_the_cli_keeps_and_reports(tmp_path, capsys):
    parent = tmp_path / "ns" / "svc"
    parent.mkdir(parents=True)
    report = tmp_path / "termination-log"
    argv = ["prepare-disk-tier", "--parent", str(parent), "--namespace", "ns", "--name", "svc", "--pod", "svc-0",
            "--owner-uid", "u1", "--chown", "1000:1000", "--fingerprint", json.dumps(FP), "--keep-bytes", "100",
            "--report", str(report)]
    assert cli_main.main(argv) == 0
    assert json.loads(report.read_text())["disk"] == "emptied"
    chunk(parent / "svc-0", "a.data", 10, 0)
    assert cli_main.main(argv) == 0
    assert json.loads(report.read_text()) == {"disk": "kept", "why": "kept: the same resource and fingerprint",
                                              "keptFiles": 1, "keptBytes": 10, "removedFiles": 0, "removedBytes": 0,
                                              "errors": 0}
    assert "kvoffload: kept ns/svc/svc-0: 1 files" in capsys.readouterr().out
    assert cli_main.main([*argv[:-2], "--report", str(tmp_path / "no" / "such" / "dir")]) == 0  # a detail lost only
    assert cli_main.main([*argv[:-6], "--fingerprint", "[1]"]) == 2  # not a JSON object
    assert cli_main.main([*argv[:-4], "--keep-bytes", "-1"]) == 2


# ----------------------------------------------------------------------------- what status says


def with_report(name: str, report: dict | None) -> dict:
    p = pod(name)
    if report is not None:
        p["status"]["initContainerStatuses"] = [
            {"name": render.DISK_INIT, "state": {"terminated": {"exitCode": 0, "message": json.dumps(report)}}}]
    return p


def disk_condition(pods: list[dict]) -> dict:
    st = conditions.status(body(), desired(replicas=len(pods)), None,
                           conditions.Observed(sts(replicas=len(pods), ready=len(pods), updated=len(pods)), pods), T0)
    return next(c for c in st["conditions"] if c["type"] == "DiskTierReady")


def test_disk_tier_ready_says_kept_or_emptied_and_why():
    kept = {"disk": "kept", "why": "kept: the same resource and fingerprint", "keptBytes": 3 * 2**30}
    emptied = {"disk": "emptied", "why": "emptied: the fingerprint changed (chunkSize)"}
    c = disk_condition([with_report("svc-0", kept), with_report("svc-1", emptied)])
    assert (c["status"], c["reason"]) == ("True", "DirectoriesKept")
    assert "svc-0 kept (3Gi): the same resource and fingerprint" in c["message"], c["message"]
    assert "svc-1 emptied: the fingerprint changed (chunkSize)" in c["message"], c["message"]
    assert "kept or emptied at pod start by the disk fingerprint" in c["message"]
    c = disk_condition([with_report("svc-0", emptied), with_report("svc-1", None)])  # svc-1: an older operator's pod
    assert (c["status"], c["reason"]) == ("True", "DirectoriesPrepared") and "svc-1" not in c["message"]
    assert "svc-0 emptied: the fingerprint changed (chunkSize)" in c["message"]
    assert "kept or emptied at pod start by the disk fingerprint" in c["message"]  # what this backend does
    lm = conditions.status(body(), pipeline.desired("svc", "ns", "u", spec(), Settings()), None,
                           conditions.Observed(sts(), [pod()]), T0)
    assert "emptied at every pod start" in next(c for c in lm["conditions"] if c["type"] == "DiskTierReady")["message"]


def test_kubectl_kvs_why_says_it():
    kept = {"disk": "kept", "why": "kept: the same resource and fingerprint", "keptBytes": 2**30}
    pods = [with_report("svc-0", kept)]
    st = conditions.status(body(), desired(), None, conditions.Observed(sts(), pods), T0)
    obj = {"metadata": {"name": "svc", "namespace": "ns", "generation": 1}, "status": st}
    text = why.explain(obj, None, pods, [], datetime(2026, 12, 3, tzinfo=timezone.utc))
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("DiskTierReady")]
    assert "DirectoriesKept" in line and "svc-0 kept (1Gi): the same resource and fingerprint" in line, line
