"""The disk-tier cleaner on real directory trees: what goes, what stays, and that nothing outside the root is touched."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.api.errors import ConfigError
from kvoffload.cli import clean_disk
from kvoffload.node import disk_cleaner
from kvoffload.node.disk_cleaner import DELETE, RETAIN, clean, decide, live_from_json, load_state, next_state

LIVE = {("ns-a", "live-svc"): DELETE}
REMEMBERED = {("ns-a", "gone"): DELETE, ("ns-d", "retained"): RETAIN,
              ("ns-c", "gone2"): DELETE, ("ns-c", "gone3"): DELETE, ("ns-e", "gone4"): DELETE}


def write(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"k" * size)
    return path


def snapshot(top: Path) -> dict[str, tuple[str, int | str]]:
    """Every entry below `top` (links not followed): relative path -> (kind, size or link target)."""
    out: dict[str, tuple[str, int | str]] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(top))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", 0)
            else:
                out[rel] = ("file", p.stat().st_size)
    return out


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """A disk-tier root with live, deleted, retained and hostile entries, and precious files outside it."""
    outside = tmp_path / "outside"
    secret = write(outside / "secret.txt", 11)
    write(outside / "dir" / "precious.bin", 22)
    root = tmp_path / "nvme" / "lmcache"
    # A live serve: never touched.
    write(root / "ns-a" / "live-svc" / "live-svc-0" / "chunk-1.pt", 100)
    # A deleted serve (reclaimPolicy Delete): both pod directories go, links inside are removed themselves only.
    gone0 = root / "ns-a" / "gone" / "gone-0"
    write(gone0 / "chunk-1.pt", 1000)
    write(gone0 / "sub" / "chunk-2.pt", 500)
    (gone0 / "link-to-outside-dir").symlink_to(outside / "dir")
    (gone0 / "link-to-secret").symlink_to(secret)
    (gone0 / "sub" / "dotdot-link").symlink_to("../../../../../outside")
    os.link(secret, gone0 / "hardlink-to-secret")  # unlinking it leaves the outside file in place
    write(root / "ns-a" / "gone" / "gone-1" / "chunk-3.pt", 2000)
    # Not a pod directory of `gone`: left (so `gone` itself stays).
    write(root / "ns-a" / "gone" / "scratch" / "notes.txt", 5)
    # A namespace directory that is a symlink to outside: never entered.
    (root / "ns-b").symlink_to(outside)
    # A file where a name directory is expected, and a file where a pod directory is expected.
    write(root / "ns-c" / "gone2", 7)
    write(root / "ns-c" / "gone3" / "gone3-0", 9)
    # A pod directory that is a symlink to outside.
    (root / "ns-e" / "gone4").mkdir(parents=True)
    (root / "ns-e" / "gone4" / "gone4-0").symlink_to(outside / "dir")
    # A deleted serve with reclaimPolicy Retain (remembered): kept.
    write(root / "ns-d" / "retained" / "retained-0" / "chunk.pt", 300)
    # Not ours at all.
    write(root / "lost+found" / "x", 1)
    write(root / ".hidden", 1)
    return {"root": root, "outside": outside, "secret": secret, "tmp": tmp_path}


def test_removes_only_pod_directories_of_deleted_serves_with_delete_policy(tree):
    outside_before = snapshot(tree["outside"])
    report = clean(str(tree["root"]), LIVE, remembered=REMEMBERED, min_age=0)
    root = tree["root"]
    assert [r["path"] for r in report.removed] == ["ns-a/gone/gone-0", "ns-a/gone/gone-1"]
    assert all(r["complete"] for r in report.removed)
    assert report.bytes_freed == 1000 + 500 + 11 + 2000  # regular files, the hard link counts its size; links count 0
    assert report.removed[0]["files"] == 6
    assert not (root / "ns-a" / "gone" / "gone-0").exists() and not (root / "ns-a" / "gone" / "gone-1").exists()
    assert (root / "ns-a" / "gone" / "scratch" / "notes.txt").exists()  # not ours, so `gone` stays too
    assert (root / "ns-a" / "live-svc" / "live-svc-0" / "chunk-1.pt").stat().st_size == 100
    assert (root / "ns-d" / "retained" / "retained-0" / "chunk.pt").exists()
    assert snapshot(tree["outside"]) == outside_before
    assert tree["secret"].read_bytes() == b"k" * 11
    assert not report.errors
    kept = {k["path"]: k["reason"] for k in report.kept}
    assert "exists" in kept["ns-a/live-svc"] and "Retain" in kept["ns-d/retained"]
    skipped = {s["path"]: s["reason"] for s in report.skipped}
    assert "symbolic link" in skipped["ns-b"]
    assert "not a directory" in skipped["ns-c/gone2"]
    assert "not a directory" in skipped["ns-c/gone3/gone3-0"]
    assert "symbolic link" in skipped["ns-e/gone4/gone4-0"]
    assert "not a pod directory" in skipped["ns-a/gone/scratch"]
    assert "lost+found" in skipped and ".hidden" in skipped
    assert (root / "ns-b").is_symlink() and (root / "ns-e" / "gone4" / "gone4-0").is_symlink()


def test_empty_name_and_namespace_directories_go_too(tmp_path):
    root = tmp_path / "kv"
    write(root / "team" / "old" / "old-0" / "a", 10)
    write(root / "team" / "old" / "old-3" / "b", 20)
    report = clean(str(root), {}, unknown_policy=DELETE, min_age=0)
    assert report.bytes_freed == 30 and not report.errors
    assert list(root.iterdir()) == []
    assert report.present == set()


def test_dry_run_changes_nothing_and_reports_the_same(tree):
    before = snapshot(tree["tmp"])
    dry = clean(str(tree["root"]), LIVE, remembered=REMEMBERED, dry_run=True, min_age=0)
    assert snapshot(tree["tmp"]) == before
    assert dry.dry_run and [r["path"] for r in dry.removed] == ["ns-a/gone/gone-0", "ns-a/gone/gone-1"]
    real = clean(str(tree["root"]), LIVE, remembered=REMEMBERED, min_age=0)
    assert real.bytes_freed == dry.bytes_freed == 3511


def test_unknown_policy_keeps_files_unless_the_admin_says_delete(tree):
    kept = clean(str(tree["root"]), LIVE, min_age=0)
    assert kept.removed == [] and any("unknown" in k["reason"] for k in kept.kept)
    assert (tree["root"] / "ns-a" / "gone" / "gone-0").is_dir()
    deleted = clean(str(tree["root"]), LIVE, unknown_policy=DELETE, min_age=0)
    assert {r["path"] for r in deleted.removed} == {"ns-a/gone/gone-0", "ns-a/gone/gone-1", "ns-d/retained/retained-0"}


def test_recently_modified_pod_directories_are_left(tree):
    report = clean(str(tree["root"]), LIVE, remembered=REMEMBERED, min_age=3600)
    assert report.removed == []
    assert any("min-age" in k["reason"] for k in report.kept)


@pytest.mark.parametrize("bad", ["relative/dir", "", "/", "//"])
def test_root_must_be_absolute_and_not_slash(bad):
    with pytest.raises(ConfigError) as err:
        clean(bad, {})
    assert err.value.field == "--root"


def test_root_that_is_a_symlink_is_refused(tree):
    link = tree["tmp"] / "link-root"
    link.symlink_to(tree["root"])
    before = snapshot(tree["tmp"])
    with pytest.raises(ConfigError, match="symbolic link"):
        clean(str(link), {}, unknown_policy=DELETE, min_age=0)
    assert snapshot(tree["tmp"]) == before


def test_root_that_is_missing_or_a_file_is_refused(tmp_path):
    write(tmp_path / "file", 1)
    for bad in (tmp_path / "missing", tmp_path / "file"):
        with pytest.raises(ConfigError) as err:
            clean(str(bad), {})
        assert err.value.field == "--root"


def test_a_directory_swapped_for_a_symlink_during_the_walk_is_not_followed(tree, monkeypatch):
    """The race rmtree-by-path loses: after listing, an attacker replaces a directory with a link to outside."""
    outside_before = snapshot(tree["outside"])
    sub = tree["root"] / "ns-a" / "gone" / "gone-0" / "sub"
    real_open = disk_cleaner._open_dir

    def swapping_open(parent_fd, name, expected=None):
        if name == "sub" and sub.is_dir() and not sub.is_symlink():
            os.rename(sub, sub.with_name("sub-moved"))
            sub.symlink_to(tree["outside"] / "dir")
        return real_open(parent_fd, name, expected)

    monkeypatch.setattr(disk_cleaner, "_open_dir", swapping_open)
    report = clean(str(tree["root"]), LIVE, remembered=REMEMBERED, min_age=0)
    assert snapshot(tree["outside"]) == outside_before
    assert any(e["path"] == "ns-a/gone/gone-0/sub" for e in report.errors)
    assert sub.is_symlink()  # left for the admin, and reported
    assert [r["path"] for r in report.removed if r["complete"]] == ["ns-a/gone/gone-1"]


def test_a_directory_replaced_by_another_directory_is_refused(tree, monkeypatch):
    """Same name, different inode: the cleaner only deletes what it listed."""
    pod = tree["root"] / "ns-a" / "gone" / "gone-1"
    real_open = disk_cleaner._open_dir

    def replacing_open(parent_fd, name, expected=None):
        if name == "gone-1" and not (pod.parent / "gone-1-old").exists():
            os.rename(pod, pod.parent / "gone-1-old")
            write(pod / "new-file", 3)
        return real_open(parent_fd, name, expected)

    monkeypatch.setattr(disk_cleaner, "_open_dir", replacing_open)
    report = clean(str(tree["root"]), LIVE, remembered=REMEMBERED, min_age=0)
    assert (pod / "new-file").exists()
    assert any(e["path"] == "ns-a/gone/gone-1" and "replaced" in e["error"] for e in report.errors)


def test_permission_errors_are_reported_and_the_rest_goes_on(tree, monkeypatch):
    real_unlink = os.unlink

    def unlink(path, *, dir_fd=None):
        if path == "chunk-3.pt":
            raise PermissionError(13, "Permission denied", path)
        return real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(disk_cleaner.os, "unlink", unlink)
    report = clean(str(tree["root"]), LIVE, remembered=REMEMBERED, min_age=0)
    assert report.errors == [{"path": "ns-a/gone/gone-1/chunk-3.pt", "error": "Permission denied"}]
    assert (tree["root"] / "ns-a" / "gone" / "gone-1" / "chunk-3.pt").exists()
    assert not (tree["root"] / "ns-a" / "gone" / "gone-0").exists()
    assert ("ns-a", "gone") in report.present


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unreadable_directory_is_reported(tree):
    locked = tree["root"] / "ns-a" / "gone" / "gone-1"
    locked.chmod(0)
    try:
        report = clean(str(tree["root"]), LIVE, remembered=REMEMBERED, min_age=0)
    finally:
        locked.chmod(0o755)
    assert any(e["path"] == "ns-a/gone/gone-1" for e in report.errors)
    assert (locked / "chunk-3.pt").exists()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to drop CAP_DAC_OVERRIDE")
def test_real_permission_errors_without_dac_override(tmp_path):
    """Run the cleaner without the capabilities that bypass file permissions, on read-only pod directories:
    every removal fails with EACCES, each one is reported, nothing goes and the run still finishes."""
    root = tmp_path / "kv"
    for pod in ("old-0", "old-1"):
        write(root / "ns" / "old" / pod / "chunk", 10)
        (root / "ns" / "old" / pod).chmod(0o555)
    code = ("import json, sys; from kvoffload.node.disk_cleaner import clean; "
            "r = clean(sys.argv[1], {}, unknown_policy='Delete', min_age=0); print(json.dumps(r.to_dict()))")
    try:
        res = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--inh-caps", "-all",
                              sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60)
    finally:
        for pod in ("old-0", "old-1"):
            (root / "ns" / "old" / pod).chmod(0o755)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert {(e["path"], e["error"]) for e in report["errors"]} == {("ns/old/old-0/chunk", "Permission denied"),
                                                                   ("ns/old/old-1/chunk", "Permission denied")}
    assert report["removed"] == [] and report["bytesFreed"] == 0
    assert (root / "ns" / "old" / "old-0" / "chunk").exists() and (root / "ns" / "old" / "old-1" / "chunk").exists()


def test_too_deep_trees_are_left_for_the_admin(tmp_path):
    root = tmp_path / "kv"
    deep = root / "ns" / "old" / "old-0"
    for i in range(disk_cleaner.MAX_DEPTH + 3):
        deep = deep / f"d{i}"
    write(deep / "f", 1)
    report = clean(str(root), {}, unknown_policy=DELETE, min_age=0)
    assert any("deeper" in s["reason"] for s in report.skipped)
    assert (root / "ns" / "old" / "old-0").is_dir()


# ----------------------------------------------------------------------------- pure parts


def test_decide():
    assert decide(("a", "b"), {("a", "b"): RETAIN}, {}) == (False, "the KVOffloadServe exists")
    assert decide(("a", "b"), {}, {("a", "b"): DELETE})[0] is True
    assert decide(("a", "b"), {}, {("a", "b"): RETAIN})[0] is False
    assert decide(("a", "b"), {}, {})[0] is False
    assert decide(("a", "b"), {}, {}, unknown_policy=DELETE)[0] is True


def test_live_set_from_kubectl_list_and_simple_entries():
    kubectl_list = {"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe", "metadata": {"namespace": "a", "name": "x"},
         "spec": {"offload": {"disk": {"path": "/mnt/nvme/kv", "size": "1Gi", "reclaimPolicy": "Retain"}}}},
        {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe", "metadata": {"namespace": "a", "name": "y"},
         "spec": {"offload": {"cpu": {"size": "1Gi"}}}}]}
    assert live_from_json(kubectl_list) == {("a", "x"): RETAIN, ("a", "y"): DELETE}
    assert live_from_json([{"namespace": "b", "name": "z"}]) == {("b", "z"): DELETE}
    assert live_from_json({"items": []}) == {}


@pytest.mark.parametrize("bad", [None, "x", {"kind": "List"}, [1], [{"name": "x"}],
                                 [{"namespace": "a", "name": "b", "reclaimPolicy": "Keep"}],
                                 {"items": [{"kind": "Pod", "metadata": {"namespace": "a", "name": "p"}}]}])
def test_bad_live_input_is_an_error_never_an_empty_set(bad):
    with pytest.raises(ConfigError) as err:
        live_from_json(bad)
    assert err.value.field == "--live-json"


def test_state_remembers_live_policies_and_forgets_what_is_gone():
    remembered = load_state({"policies": {"a/old": "Delete", "a/kept": "Retain", "junk": "Delete"}})
    assert remembered == {("a", "old"): DELETE, ("a", "kept"): RETAIN}
    state = next_state(remembered, {("b", "new"): RETAIN}, present={("a", "kept")})
    assert state == {"policies": {"a/kept": "Retain", "b/new": "Retain"}}
    assert load_state(state) == {("a", "kept"): RETAIN, ("b", "new"): RETAIN}
    with pytest.raises(ConfigError):
        load_state({"policies": []})


# ----------------------------------------------------------------------------- the CLI


def cli(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="kvoffload")
    clean_disk.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["clean-disk", *argv])
    return args.func(args), args


def test_cli_learns_policies_then_cleans_after_deletion(tree, tmp_path, capsys):
    root, state = tree["root"], tmp_path / "state.json"
    live_file = tmp_path / "live.json"
    # Run 1: `gone` still exists (reclaimPolicy Delete) and `retained` too (Retain): nothing goes, policies are remembered.
    live_file.write_text(json.dumps({"kind": "List", "items": [
        {"kind": "KVOffloadServe", "metadata": {"namespace": "ns-a", "name": n}, "spec": {"offload": {"disk": {"reclaimPolicy": p}}}}
        for n, p in (("live-svc", "Delete"), ("gone", "Delete"))] + [
        {"kind": "KVOffloadServe", "metadata": {"namespace": "ns-d", "name": "retained"},
         "spec": {"offload": {"disk": {"reclaimPolicy": "Retain"}}}}]}))
    rc, _ = cli("--root", str(root), "--live-json", str(live_file), "--state", str(state), "--min-age", "0")
    assert rc == 0 and (root / "ns-a" / "gone" / "gone-0").is_dir()
    assert json.loads(state.read_text())["policies"] == {"ns-a/gone": "Delete", "ns-a/live-svc": "Delete", "ns-d/retained": "Retain"}
    # Run 2, dry: both are deleted now; the state says what each one's policy was.
    live_file.write_text(json.dumps({"items": [{"namespace": "ns-a", "name": "live-svc"}]}))
    capsys.readouterr()
    rc, _ = cli("--root", str(root), "--live-json", str(live_file), "--state", str(state), "--min-age", "0", "--dry-run")
    out = capsys.readouterr().out
    assert rc == 0 and "would remove ns-a/gone/gone-0" in out and "would free" in out and "(3511 bytes)" in out
    assert (root / "ns-a" / "gone" / "gone-0").is_dir()
    # Run 3, for real, JSON report.
    rc, _ = cli("--root", str(root), "--live-json", str(live_file), "--state", str(state), "--min-age", "0", "-o", "json")
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["bytesFreed"] == 3511
    assert [r["path"] for r in report["roots"][0]["removed"]] == ["ns-a/gone/gone-0", "ns-a/gone/gone-1"]
    assert (root / "ns-d" / "retained" / "retained-0").is_dir()
    # `gone` still has a foreign directory, so it is still remembered; `retained` too.
    assert json.loads(state.read_text())["policies"] == {"ns-a/gone": "Delete", "ns-a/live-svc": "Delete", "ns-d/retained": "Retain"}


def test_cli_reads_stdin_and_exits_1_on_errors(tree, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps([{"namespace": "ns-a", "name": "live-svc"}])))
    real_rmdir = os.rmdir

    def rmdir(path, *, dir_fd=None):
        if path == "gone-1":
            raise PermissionError(1, "Operation not permitted", path)
        return real_rmdir(path, dir_fd=dir_fd)

    monkeypatch.setattr(disk_cleaner.os, "rmdir", rmdir)
    rc, _ = cli("--root", str(tree["root"]), "--live-json", "-", "--unknown-policy", "Delete", "--min-age", "0")
    captured = capsys.readouterr()
    assert rc == 1 and "ERROR ns-a/gone/gone-1: Operation not permitted" in captured.err


def test_cli_bad_live_file_is_a_config_error(tmp_path):
    bad = tmp_path / "live.json"
    bad.write_text("not json")
    with pytest.raises(ConfigError) as err:
        cli("--root", str(tmp_path), "--live-json", str(bad))
    assert err.value.field == "--live-json"


def test_cli_needs_a_live_source(tmp_path):
    with pytest.raises(SystemExit):
        cli("--root", str(tmp_path))
