"""Disk-tier accounting: stays right while files are added, removed, grown and left behind by an
earlier process, and does not walk an unchanged directory."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from kvoffload.exporter import disk_tier
from kvoffload.exporter.disk_tier import DiskTierMonitor, DiskTierScanner
from kvoffload.exporter.sources import SourceHealth

OLD = 120.0  # seconds in the past: settled files and directories


def put(path: Path, size: int, age: float = OLD) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"k" * size)
    t = time.time() - age
    os.utime(path, (t, t))


def settle(directory: Path, age: float = OLD) -> None:
    """Age a directory's mtime as if nothing changed in it lately."""
    t = time.time() - age
    os.utime(directory, (t, t))


@pytest.fixture
def count_scandir(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = os.scandir

    def counting(path):  # type: ignore[no-untyped-def]
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", counting)
    return calls


def test_add_remove_and_subdirectories(tmp_path: Path) -> None:
    scanner = DiskTierScanner(str(tmp_path))
    for i in range(3):
        put(tmp_path / f"chunk{i}.pt", 1000)
    scan, problems = scanner.rescan(cutoff=None)
    assert (scan.bytes, scan.files, scan.removed_files, problems) == (3000, 3, 0, [])
    assert scan.free_bytes > 0 and scan.old_bytes is None

    put(tmp_path / "chunk3.pt", 500)
    put(tmp_path / "rank1" / "chunk0.pt", 2000)  # by_gpu sharding: one sub-directory per rank
    (tmp_path / "chunk0.pt").unlink()
    scan, _ = scanner.rescan(cutoff=None)
    assert (scan.bytes, scan.files, scan.removed_files) == (4500, 4, 1)

    (tmp_path / "rank1" / "chunk0.pt").unlink()
    (tmp_path / "rank1").rmdir()
    (tmp_path / "chunk1.pt").unlink()
    scan, _ = scanner.rescan(cutoff=None)
    assert (scan.bytes, scan.files, scan.removed_files) == (1500, 2, 3)


def test_symlinks_and_special_files_are_not_followed(tmp_path: Path) -> None:
    put(tmp_path / "outside" / "big.bin", 10_000)
    disk = tmp_path / "disk"
    put(disk / "chunk.pt", 100)
    (disk / "link").symlink_to(tmp_path / "outside")
    (disk / "filelink").symlink_to(tmp_path / "outside" / "big.bin")
    scan, _ = DiskTierScanner(str(disk)).rescan(cutoff=None)
    assert (scan.bytes, scan.files) == (100, 1)


def test_unchanged_directory_is_not_listed_again(tmp_path: Path, count_scandir: list[str]) -> None:
    for i in range(50):
        put(tmp_path / f"c{i}.pt", 10)
    settle(tmp_path)
    scanner = DiskTierScanner(str(tmp_path))
    assert scanner.rescan(cutoff=None)[0].files == 50
    listings = len(count_scandir)
    assert listings >= 1
    for _ in range(3):
        assert scanner.rescan(cutoff=None)[0].files == 50
    assert len(count_scandir) == listings  # one stat() per rescan, no listing
    put(tmp_path / "new.pt", 10)
    assert scanner.rescan(cutoff=None)[0].files == 51
    assert len(count_scandir) > listings


def test_file_still_being_written_is_measured_again(tmp_path: Path) -> None:
    chunk = tmp_path / "chunk.pt"
    chunk.write_bytes(b"k" * 100)  # mtime now: still settling
    settle(tmp_path)
    scanner = DiskTierScanner(str(tmp_path))
    assert scanner.rescan(cutoff=None)[0].bytes == 100
    with chunk.open("ab") as f:  # appending does not move the directory's mtime
        f.write(b"k" * 900)
    settle(tmp_path)
    assert scanner.rescan(cutoff=None)[0].bytes == 1000


def test_in_place_rewrite_caught_by_periodic_full_refresh(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_tier, "FULL_REFRESH_EVERY", 3)
    chunk = tmp_path / "chunk.pt"
    put(chunk, 100)
    settle(tmp_path)
    scanner = DiskTierScanner(str(tmp_path))
    assert scanner.rescan(cutoff=None)[0].bytes == 100
    put(chunk, 700)  # same name, old mtime, dir mtime unchanged: invisible to the cheap path
    settle(tmp_path)
    seen = [scanner.rescan(cutoff=None)[0].bytes for _ in range(3)]
    assert seen[0] == 100 and seen[-1] == 700


def test_files_left_by_a_previous_process(tmp_path: Path) -> None:
    engine_start = time.time() - 60
    put(tmp_path / "left-behind-1.pt", 3000, age=3600)
    put(tmp_path / "left-behind-2.pt", 4000, age=61 + 1)
    put(tmp_path / "mine.pt", 5000, age=30)
    scanner = DiskTierScanner(str(tmp_path))
    scan, _ = scanner.rescan(cutoff=engine_start)
    assert (scan.bytes, scan.old_bytes) == (12000, 7000)
    (tmp_path / "left-behind-1.pt").unlink()
    put(tmp_path / "mine-2.pt", 1000, age=1)
    scan, _ = scanner.rescan(cutoff=engine_start)
    assert (scan.bytes, scan.old_bytes, scan.removed_files) == (10000, 4000, 1)
    # the cutoff moves (vLLM restarted): everything before it is now left behind
    scan, _ = scanner.rescan(cutoff=time.time() + 5)
    assert scan.old_bytes == 10000


def test_missing_dir_counts_errors_and_recovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvoffload.exporter")
    root = tmp_path / "disk"
    monitor = DiskTierMonitor(str(root), interval=3600, health=SourceHealth("disk"))
    for _ in range(3):
        monitor.rescan_now()
    assert monitor.latest is None
    assert (monitor.health.errors, monitor.health.up) == (3, False)
    assert sum("source disk failing" in r.getMessage() for r in caplog.records) == 1  # logged once
    put(root / "c.pt", 10)
    monitor.rescan_now()
    assert monitor.latest is not None and monitor.latest.files == 1
    assert monitor.health.up and monitor.health.errors == 3
    assert any("source disk recovered" in r.getMessage() for r in caplog.records)


def test_dir_that_is_a_file_or_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    afile = tmp_path / "not-a-dir"
    afile.write_text("x")
    monitor = DiskTierMonitor(str(afile), interval=3600, health=SourceHealth("disk"))
    monitor.rescan_now()
    assert monitor.latest is None and monitor.health.errors == 1

    root = tmp_path / "disk"
    put(root / "c.pt", 10)
    put(root / "sub" / "d.pt", 20)
    monitor = DiskTierMonitor(str(root), interval=3600, health=SourceHealth("disk"))
    monitor.rescan_now()
    assert monitor.latest is not None and monitor.latest.bytes == 30
    put(root / "sub" / "e.pt", 5)
    put(root / "f.pt", 1)
    real = os.scandir

    def deny_sub(path):  # type: ignore[no-untyped-def]
        if str(path).endswith("sub"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", deny_sub)
    monitor.rescan_now()  # sub-directory unreadable: last known figures kept, source marked failing
    assert monitor.latest is not None and monitor.latest.bytes == 31
    assert (monitor.health.up, monitor.health.errors) == (False, 1)

    monkeypatch.setattr(os, "scandir", lambda path: (_ for _ in ()).throw(PermissionError(13, "denied")))
    monitor.rescan_now()  # root unreadable: no stale figures served
    assert monitor.latest is None and monitor.health.errors == 2
    monkeypatch.setattr(os, "scandir", real)
    monitor.rescan_now()
    assert monitor.latest is not None and monitor.latest.bytes == 36 and monitor.health.up


def test_background_thread_rescans(tmp_path: Path) -> None:
    monitor = DiskTierMonitor(str(tmp_path), interval=0.05, health=SourceHealth("disk"))
    monitor.start()
    try:
        put(tmp_path / "c.pt", 42)
        deadline = time.monotonic() + 5
        while (monitor.latest is None or monitor.latest.bytes != 42) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert monitor.latest is not None and monitor.latest.bytes == 42
    finally:
        monitor.stop()
