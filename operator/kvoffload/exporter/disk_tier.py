"""The disk-tier directory, rescanned in the background at a bounded rate; a scrape only reads the
last result. A rescan is incremental: each directory is stat()ed, and only one whose mtime moved is
listed again, and then only names not seen before are stat()ed. 100,000 chunk files that did not
change cost one stat() per directory."""

from __future__ import annotations

import os
import threading
import time
from array import array
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field

from .sources import SourceHealth

# A file or directory modified this recently may still change without its parent's mtime moving
# (a chunk still being written; mtime granularity): look at it again on the next rescan.
SETTLE_S = 5.0
# Every Nth rescan re-stats every file, catching in-place rewrites that leave no mtime trace on the dir.
FULL_REFRESH_EVERY = 30


@dataclass(slots=True)
class _Dir:
    """What is known of one directory. Files are kept as three aligned arrays sorted by hash(name)
    (24 bytes a file instead of ~250 in dicts of names): 100,000 chunk files cost 2.4 MiB, which
    keeps the sidecar in its memory budget. A 64-bit hash collision inside one directory would
    merge two files in the count, nothing worse."""

    mtime_ns: int = -1  # -1: list it again on the next rescan
    listed_at: float = 0.0
    keys: array = field(default_factory=lambda: array("q"))  # sorted hash(name) of regular files
    sizes: array = field(default_factory=lambda: array("Q"))
    mtimes: array = field(default_factory=lambda: array("q"))  # whole seconds
    subdirs: list[str] = field(default_factory=list)
    bytes: int = 0
    unsettled: bool = False  # a file was still being written when listed
    old_bytes: int = 0
    old_cutoff: float | None = None  # the cutoff old_bytes was computed for; None: recompute


@dataclass(frozen=True)
class DiskScan:
    bytes: int  # bytes in regular files under the directory (symlinks not followed)
    files: int
    free_bytes: int  # available to unprivileged writers on that filesystem (statvfs f_bavail)
    old_bytes: int | None  # bytes in files last modified before the cutoff; None without a cutoff
    removed_files: int  # files seen once and gone since the exporter started (monotonic)
    finished_at: float  # wall clock
    duration_s: float


class DiskTierScanner:
    """Incremental accounting of one directory tree (not thread-safe: one caller at a time)."""

    def __init__(self, root: str, clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self._clock = clock
        self._dirs: dict[str, _Dir] = {}
        self._removed = 0
        self._scans = 0

    def rescan(self, cutoff: float | None) -> tuple[DiskScan, list[str]]:
        """One pass. Raises OSError when the root is missing or unreadable; a subdirectory that
        cannot be read keeps its last known figures and is returned as a problem."""
        started = time.monotonic()
        now = self._clock()
        full = self._scans % FULL_REFRESH_EVERY == FULL_REFRESH_EVERY - 1
        self._scans += 1
        vfs = os.statvfs(self.root)
        problems: list[str] = []
        seen: dict[str, _Dir] = {}
        stack = [self.root]
        while stack:
            path = stack.pop()
            try:
                d = self._refresh(path, now, full)
            except FileNotFoundError:
                if path == self.root:
                    raise
                continue  # removed since its parent was listed: its files count as removed
            except OSError as exc:
                if path == self.root:
                    raise
                problems.append(f"cannot read {path}: {type(exc).__name__}")
                if path not in self._dirs:
                    continue
                d = self._dirs[path]
            seen[path] = d
            if cutoff is not None and d.old_cutoff != cutoff:
                # +1: mtimes are kept in whole seconds; count a file only if surely older
                d.old_bytes = sum(size for size, mtime in zip(d.sizes, d.mtimes) if mtime + 1 <= cutoff)
                d.old_cutoff = cutoff
            stack.extend(os.path.join(path, name) for name in d.subdirs)
        for path in self._dirs.keys() - seen.keys():
            self._removed += len(self._dirs[path].keys)
        self._dirs = seen
        scan = DiskScan(
            bytes=sum(d.bytes for d in seen.values()),
            files=sum(len(d.keys) for d in seen.values()),
            free_bytes=vfs.f_bavail * vfs.f_frsize,
            old_bytes=None if cutoff is None else sum(d.old_bytes for d in seen.values()),
            removed_files=self._removed,
            finished_at=self._clock(),
            duration_s=time.monotonic() - started,
        )
        return scan, problems

    def _refresh(self, path: str, now: float, full: bool) -> _Dir:
        st = os.stat(path)
        d = self._dirs.get(path)
        if d is None or full or st.st_mtime_ns != d.mtime_ns:
            d = self._list(path, d or _Dir(), now, full)
        settled = now - st.st_mtime >= SETTLE_S and not d.unsettled
        d.mtime_ns = st.st_mtime_ns if settled else -1
        return d

    def _list(self, path: str, old: _Dir, now: float, full: bool) -> _Dir:
        """List `path` again; stat only files not known, still settling when last seen, or all of
        them when `full`. `old` is left untouched, so a listing that fails keeps the last state."""
        new = _Dir(listed_at=now)
        unsorted = array("q")
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    new.subdirs.append(entry.name)
                elif entry.is_file(follow_symlinks=False):
                    unsorted.append(hash(entry.name))
        new.keys = array("q", sorted(unsorted))
        del unsorted
        new.sizes = array("Q", [0]) * len(new.keys)
        new.mtimes = array("q", [0]) * len(new.keys)

        # Merge with the previous listing (both sorted by key): carry over settled figures.
        settled_before = old.listed_at - SETTLE_S
        need: set[int] = set()
        kept, i, n_old = 0, 0, len(old.keys)
        for j, key in enumerate(new.keys):
            while i < n_old and old.keys[i] < key:
                i += 1
            if i < n_old and old.keys[i] == key:
                kept += 1
                if not full and old.mtimes[i] + 1 <= settled_before:
                    new.sizes[j], new.mtimes[j] = old.sizes[i], old.mtimes[i]
                    continue
            need.add(key)

        if need:  # second listing: the names of the files to stat
            with os.scandir(path) as entries:
                for entry in entries:
                    key = hash(entry.name)
                    if key not in need or not entry.is_file(follow_symlinks=False):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    need.discard(key)
                    j = bisect_left(new.keys, key)
                    new.sizes[j], new.mtimes[j] = st.st_size, int(st.st_mtime)
            if need:  # gone between the two listings
                kept -= sum(1 for key in need if _contains(old.keys, key))
                _drop(new, need)
        self._removed += n_old - kept
        new.bytes = sum(new.sizes)
        new.unsettled = bool(new.mtimes) and max(new.mtimes) + 1 > now - SETTLE_S
        return new


def _contains(keys: array, key: int) -> bool:
    j = bisect_left(keys, key)
    return j < len(keys) and keys[j] == key


def _drop(d: _Dir, gone: set[int]) -> None:
    keep = [j for j, key in enumerate(d.keys) if key not in gone]
    d.keys = array("q", (d.keys[j] for j in keep))
    d.sizes = array("Q", (d.sizes[j] for j in keep))
    d.mtimes = array("q", (d.mtimes[j] for j in keep))


class DiskTierMonitor:
    """Runs the scanner every `interval` seconds in a daemon thread; `latest` is what scrapes read
    (None until a first rescan succeeds, and after a failed one: no stale figures are served)."""

    def __init__(self, root: str, interval: float, health: SourceHealth,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.interval = interval
        self.health = health
        self.latest: DiskScan | None = None
        self._scanner = DiskTierScanner(root, clock)
        # Files older than this were left by an earlier process: the exporter's own start until
        # the collector learns vLLM's (process_start_time_seconds).
        self.cutoff: float = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def rescan_now(self) -> None:
        with self._lock:
            try:
                scan, problems = self._scanner.rescan(self.cutoff)
            except OSError as exc:
                self.latest = None
                self.health.fail(f"cannot read disk dir {self.root}: {type(exc).__name__}")
                return
            except Exception as exc:  # a bug here must not kill the thread; count it instead
                self.latest = None
                self.health.fail(f"disk rescan failed: {type(exc).__name__}: {exc}")
                return
            self.latest = scan
            if problems:
                self.health.fail(problems[0])
            else:
                self.health.ok()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="disk-rescan", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.rescan_now()
            self._stop.wait(self.interval)
