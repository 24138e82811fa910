"""The disk-tier cleaner on real directory trees: what goes, what stays, and that nothing outside the root is touched.

Trees are laid out as the serving pods and their init container leave them (<root>/<rel>/<ns>/<name>/<pod>, a
root-owned owner marker beside each pod directory, pod directories owned by UID 1000), plus what a hostile tenant
could plant in its own pod directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.api.errors import ConfigError
from kvoffload.cli import main as cli_main
from kvoffload.node import disk_cleaner, disk_prepare, owner_marker
from kvoffload.node.disk_cleaner import DELETE, RETAIN, clean, decide, live_from_json, load_state

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="owner markers are root's; the tests chown to UID 1000")

LIVE = {("ns-a", "live-svc"): "uid-live"}
DELETED = {"uid-gone": DELETE, "uid-retained": RETAIN}


def write(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"k" * size)
    return path


def pod(root: Path, rel: str, ns: str, name: str, ordinal: int, uid: str) -> Path:
    """What kubelet and `kvoffload prepare-disk-tier` leave: a marked pod directory handed to UID 1000."""
    parent = root / rel / ns / name
    parent.mkdir(parents=True, exist_ok=True)
    disk_prepare.prepare_pod_dir(str(parent), owner_marker.Owner(ns, name, f"{name}-{ordinal}", uid), 1000, 1000)
    return parent / f"{name}-{ordinal}"


def snapshot(top: Path) -> dict[str, tuple[str, int | str]]:
    """Every entry below `top` (links not followed): relative path -> (kind, size or link target)."""
    out: dict[str, tuple[str, int | str]] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(top))
            out[rel] = (("link", os.readlink(p)) if p.is_symlink() else ("dir", 0) if p.is_dir()
                        else ("file", p.stat().st_size))
    return out


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    outside = tmp_path / "outside"
    secret = write(outside / "secret.txt", 11)
    write(outside / "dir" / "precious.bin", 22)
    root = tmp_path / "nvme"
    write(pod(root, "lmcache", "ns-a", "live-svc", 0, "uid-live") / "chunk-1.pt", 100)
    gone0 = pod(root, "lmcache", "ns-a", "gone", 0, "uid-gone")
    write(gone0 / "chunk-1.pt", 1000)
    write(gone0 / "sub" / "chunk-2.pt", 500)
    (gone0 / "link-to-outside-dir").symlink_to(outside / "dir")
    (gone0 / "link-to-secret").symlink_to(secret)
    (gone0 / "sub" / "dotdot-link").symlink_to("../../../../../../outside")
    os.link(secret, gone0 / "hardlink-to-secret")  # unlinking it leaves the outside file in place
    write(pod(root, "a/b/c", "ns-a", "gone", 1, "uid-gone") / "chunk-3.pt", 2000)  # a deeper <rel>
    write(pod(root, "lmcache", "ns-d", "retained", 0, "uid-retained") / "chunk.pt", 300)
    # A tenant plants a fake layout with a marker of its own inside its pod directory: not root's, not believed.
    fake = gone0.parent / "gone-0" / "sub" / "ns-x" / "victim"
    fake.mkdir(parents=True)
    owner = owner_marker.Owner("ns-x", "victim", "victim-0", "uid-gone")
    (fake / owner_marker.file_name("victim-0")).write_bytes(owner_marker.encode(owner))
    os.chown(fake / owner_marker.file_name("victim-0"), 1000, 1000)
    # A pod directory whose marker names another directory, and a root-owned link where a directory could be.
    odd = pod(root, "lmcache", "ns-c", "odd", 0, "uid-gone")
    (odd.parent / owner_marker.file_name("odd-0")).write_bytes(owner_marker.encode(
        owner_marker.Owner("ns-z", "odd", "odd-0", "uid-gone")))
    (root / "lmcache" / "ns-b").symlink_to(outside)
    write(root / "lost+found" / "x", 1)
    old = 1_000_000_000  # everything "long ago", so --min-age does not get in the way
    for dirpath, dirnames, _ in os.walk(root):
        for n in dirnames:
            os.utime(Path(dirpath) / n, (old, old), follow_symlinks=False)
    return {"root": root, "outside": outside, "secret": secret, "tmp": tmp_path}


def test_removes_only_pod_directories_of_deleted_incarnations_with_delete_policy(tree):
    outside_before = snapshot(tree["outside"])
    report = clean(str(tree["root"]), LIVE, deleted=DELETED, min_age=0)
    root = tree["root"]
    assert sorted(r["path"] for r in report.removed) == ["a/b/c/ns-a/gone/gone-1", "lmcache/ns-a/gone/gone-0"]
    assert all(r["complete"] for r in report.removed) and not report.errors
    fake = len(owner_marker.encode(owner_marker.Owner("ns-x", "victim", "victim-0", "uid-gone")))
    assert report.bytes_freed == 1000 + 500 + 11 + 2000 + fake  # the hard link counts its size; links 0
    assert not (root / "lmcache" / "ns-a").joinpath("gone").exists()  # name and namespace levels go when empty
    assert not (root / "a" / "b" / "c" / "ns-a").exists() and (root / "a" / "b" / "c").is_dir()  # <rel> stays
    assert (root / "lmcache" / "ns-a" / "live-svc" / "live-svc-0" / "chunk-1.pt").stat().st_size == 100
    assert (root / "lmcache" / "ns-d" / "retained" / "retained-0" / "chunk.pt").exists()
    assert (root / "lmcache" / "ns-c" / "odd" / "odd-0").is_dir()  # its marker names another directory
    assert snapshot(tree["outside"]) == outside_before and tree["secret"].read_bytes() == b"k" * 11
    kept = {k["path"]: k["reason"] for k in report.kept}
    assert "exists" in kept["lmcache/ns-a/live-svc/live-svc-0"]
    assert "Retain (the final spec of uid uid-retained)" in kept["lmcache/ns-d/retained/retained-0"]
    assert "not one kvoffload wrote" in {s["path"]: s["reason"] for s in report.skipped}["lmcache/ns-c/odd/odd-0"]
    assert (root / "lmcache" / "ns-b").is_symlink()
    assert report.referenced == {"uid-live", "uid-retained"}


def test_dry_run_changes_nothing_and_reports_the_same(tree):
    before = snapshot(tree["tmp"])
    dry = clean(str(tree["root"]), LIVE, deleted=DELETED, dry_run=True, min_age=0)
    assert snapshot(tree["tmp"]) == before
    real = clean(str(tree["root"]), LIVE, deleted=DELETED, min_age=0)
    assert [r["path"] for r in dry.removed] == [r["path"] for r in real.removed] and real.bytes_freed == dry.bytes_freed


def test_an_incarnation_whose_deletion_was_not_seen_gets_the_unknown_policy(tree):
    clean(str(tree["root"]), LIVE, deleted={}, min_age=0)
    assert (tree["root"] / "lmcache" / "ns-a" / "gone" / "gone-0").is_dir()  # Retain by default
    report = clean(str(tree["root"]), LIVE, deleted={}, unknown_policy=DELETE, min_age=0)
    assert not (tree["root"] / "lmcache" / "ns-a" / "gone").exists()
    assert "deleted while the janitor was not watching" in report.removed[0]["reason"]


def test_a_live_name_with_a_new_uid_does_not_protect_the_old_incarnations_directories(tree):
    report = clean(str(tree["root"]), {("ns-a", "gone"): "uid-new"}, deleted=DELETED, min_age=0)
    assert len(report.removed) == 2  # both marked uid-gone, deleted with Delete


def test_recently_modified_pod_directories_are_left(tree):
    os.utime(tree["root"] / "lmcache" / "ns-a" / "gone" / "gone-0")
    report = clean(str(tree["root"]), LIVE, deleted=DELETED, min_age=600)
    assert [r["path"] for r in report.removed] == ["a/b/c/ns-a/gone/gone-1"]
    assert (tree["root"] / "lmcache" / "ns-a" / "gone" / "gone-0").is_dir()


@pytest.mark.parametrize("bad", ["relative/dir", "", "/", "//"])
def test_root_must_be_absolute_and_not_slash(bad):
    with pytest.raises(ConfigError) as err:
        clean(bad, {})
    assert err.value.field == "--root"


def test_root_that_is_a_symlink_is_refused(tree):
    link = tree["tmp"] / "link-root"
    link.symlink_to(tree["root"])
    with pytest.raises(ConfigError, match="symbolic link"):
        clean(str(link), {}, unknown_policy=DELETE, min_age=0)


def test_a_directory_swapped_for_a_symlink_during_the_walk_is_not_followed(tree, monkeypatch):
    """The race rmtree-by-path loses: after listing, an attacker replaces a directory with a link to outside."""
    outside_before = snapshot(tree["outside"])
    sub = tree["root"] / "lmcache" / "ns-a" / "gone" / "gone-0" / "sub"
    real_open = disk_cleaner._open_dir

    def swapping_open(parent_fd, name, expected=None):
        if name == "sub" and sub.is_dir() and not sub.is_symlink():
            os.rename(sub, sub.with_name("sub-moved"))
            sub.symlink_to(tree["outside"] / "dir")
        return real_open(parent_fd, name, expected)

    monkeypatch.setattr(disk_cleaner, "_open_dir", swapping_open)
    report = clean(str(tree["root"]), LIVE, deleted=DELETED, min_age=0)
    assert snapshot(tree["outside"]) == outside_before
    assert any(e["path"] == "lmcache/ns-a/gone/gone-0/sub" for e in report.errors)
    assert sub.is_symlink()  # left for the admin, and reported


def test_a_pod_directory_re_marked_by_a_new_incarnation_meanwhile_is_kept(tree, monkeypatch):
    real_read = owner_marker.read
    calls = {"n": 0}

    def read(dir_fd, ns, name, pod_name):
        got = real_read(dir_fd, ns, name, pod_name)
        if pod_name == "gone-0":
            calls["n"] += 1
            if calls["n"] == 2 and got:  # the init container of uid-new wrote its marker between the two reads
                return owner_marker.Owner(ns, name, pod_name, "uid-new")
        return got

    monkeypatch.setattr(owner_marker, "read", read)
    report = clean(str(tree["root"]), LIVE, deleted=DELETED, min_age=0)
    assert "owner changed" in {k["path"]: k["reason"] for k in report.kept}["lmcache/ns-a/gone/gone-0"]


def test_permission_errors_are_reported_and_the_rest_goes_on(tree, monkeypatch):
    real_unlink = os.unlink

    def unlink(path, *, dir_fd=None):
        if path == "chunk-3.pt":
            raise PermissionError(13, "Permission denied", path)
        return real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(disk_cleaner.os, "unlink", unlink)
    report = clean(str(tree["root"]), LIVE, deleted=DELETED, min_age=0)
    assert report.errors == [{"path": "a/b/c/ns-a/gone/gone-1/chunk-3.pt", "error": "Permission denied"}]
    assert (tree["root"] / "a/b/c/ns-a/gone/gone-1/chunk-3.pt").exists()
    assert not (tree["root"] / "lmcache" / "ns-a" / "gone" / "gone-0").exists()
    assert "uid-gone" in report.referenced  # still on disk: its final policy is remembered


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv to drop CAP_DAC_OVERRIDE")
def test_real_permission_errors_without_dac_override(tmp_path):
    """Without the capabilities that bypass file permissions, on read-only pod directories: every removal fails
    with EACCES, each one is reported, nothing goes and the run still finishes."""
    root = tmp_path / "kv"
    for i in (0, 1):
        d = pod(root, "r", "ns", "old", i, "uid-old")
        write(d / "chunk", 10)
        d.chmod(0o555)
    code = ("import json, sys; from kvoffload.node.disk_cleaner import clean; "
            "r = clean(sys.argv[1], {}, deleted={'uid-old': 'Delete'}, min_age=0); print(json.dumps(r.to_dict()))")
    res = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--inh-caps", "-all",
                          sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert {e["error"] for e in report["errors"]} == {"Permission denied"} and report["bytesFreed"] == 0
    assert (root / "r/ns/old/old-0/chunk").exists() and (root / "r/ns/old/old-1/chunk").exists()


def test_too_deep_trees_are_left_for_the_admin(tmp_path):
    root = tmp_path / "kv"
    deep = pod(root, "r", "ns", "old", 0, "uid-old")
    for i in range(disk_cleaner.MAX_DEPTH + 3):
        deep = deep / f"d{i}"
    write(deep / "f", 1)
    report = clean(str(root), {}, deleted={"uid-old": DELETE}, min_age=0)
    assert any("deeper" in s["reason"] for s in report.skipped)
    assert (root / "r" / "ns" / "old" / "old-0").is_dir()


# ----------------------------------------------------------------------------- the init container's half


def test_prepare_refuses_a_link_where_the_pod_directory_belongs_and_never_follows_it(tmp_path):
    parent, outside = tmp_path / "root" / "ns" / "svc", tmp_path / "outside"
    parent.mkdir(parents=True)
    write(outside / "keep", 5)
    (parent / "svc-0").symlink_to(outside)
    with pytest.raises(ConfigError, match="symbolic link"):
        disk_prepare.prepare_pod_dir(str(parent), owner_marker.Owner("ns", "svc", "svc-0", "u"), 1000, 1000)
    assert (outside / "keep").read_bytes() == b"kkkkk" and oct(outside.stat().st_mode & 0o777) != "0o750"


def test_prepare_empties_marks_and_hands_over_the_pod_directory(tmp_path):
    parent = tmp_path / "root" / "lmcache" / "ns" / "svc"
    d = pod(tmp_path / "root", "lmcache", "ns", "svc", 0, "uid-1")
    write(d / "old-chunk", 7)
    (d / "link").symlink_to("/etc")
    done = disk_prepare.prepare_pod_dir(str(parent), owner_marker.Owner("ns", "svc", "svc-0", "uid-2"), 1000, 1000)
    assert (done.files, done.bytes) == (2, 7) and list(d.iterdir()) == []
    assert (d.stat().st_uid, d.stat().st_gid, d.stat().st_mode & 0o777) == (1000, 1000, 0o750)
    marker = parent / owner_marker.file_name("svc-0")
    assert marker.stat().st_uid == 0 and json.loads(marker.read_text())["uid"] == "uid-2"


def test_prepare_cli(tmp_path, capsys):
    parent = tmp_path / "ns" / "svc"
    parent.mkdir(parents=True)
    argv = ["prepare-disk-tier", "--parent", str(parent), "--namespace", "ns", "--name", "svc", "--pod", "svc-3",
            "--owner-uid", "u-1", "--chown", "1000:1000"]
    assert cli_main.main(argv) == 0 and (parent / "svc-3").is_dir()
    assert "emptied ns/svc/svc-3 (0 files" in capsys.readouterr().out
    assert cli_main.main([*argv[:8], "other-0", *argv[9:]]) == 2  # not <name>-<ordinal>
    assert cli_main.main(["prepare-disk-tier", "--dir", str(parent / "svc-3")]) == 0


# ----------------------------------------------------------------------------- pure parts


def test_decide():
    owner = owner_marker.Owner("ns", "a", "a-0", "u1")
    assert decide(owner, ("ns", "a"), {("ns", "a"): "u1"}, {}) == (False, "the KVOffloadServe exists")
    assert decide(owner, ("ns", "a"), {("ns", "a"): None}, {})[0] is False  # a live set without uids: keep
    assert decide(owner, ("ns", "a"), {("ns", "a"): "u2"}, {"u1": DELETE})[0] is True
    assert decide(owner, ("ns", "a"), {}, {"u1": RETAIN})[0] is False
    assert decide(owner, ("ns", "a"), {}, {})[0] is False and decide(owner, ("ns", "a"), {}, {}, DELETE)[0] is True


def test_live_set_from_kubectl_list_and_simple_entries():
    listed = {"kind": "List", "items": [{"kind": "KVOffloadServe",
                                         "metadata": {"namespace": "n", "name": "a", "uid": "u"}}]}
    assert live_from_json(listed) == {("n", "a"): "u"}
    assert live_from_json([{"namespace": "n", "name": "b"}]) == {("n", "b"): None}


@pytest.mark.parametrize("bad", [None, "x", {"kind": "List"}, [1], [{"name": "x"}],
                                 [{"kind": "Pod", "metadata": {"namespace": "n", "name": "p"}}]])
def test_bad_live_input_is_an_error_never_an_empty_set(bad):
    with pytest.raises(ConfigError):
        live_from_json(bad)


def test_state_of_the_earlier_format_is_not_trusted():
    assert load_state({"policies": {"ns/a": "Delete"}}) == {}
    assert load_state({"deleted": {"u": {"namespace": "ns", "name": "a", "reclaimPolicy": "Retain"}}}) == {"u": RETAIN}
