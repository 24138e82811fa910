"""The disk-tier directory, rescanned in the background at a bounded rate; a scrape only reads the
last result. A rescan is incremental: each directory is stat()ed, and only one whose mtime moved is
listed again, and then only names not seen before are stat()ed. 100,000 chunk files that did not
change cost one stat() per directory."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .sources import SourceHealth

log = logging.getLogger("kvoffload.exporter")

# A file or directory modified this recently may still change without its parent's mtime moving
# (a chunk still being written; mtime granularity): look at it again on the next rescan.
SETTLE_S = 5.0
# Every Nth rescan re-stats every file, catching in-place rewrites that leave no mtime trace on the dir.
FULL_REFRESH_EVERY = 30

# One int per cached file instead of a (size, mtime) tuple keyed by name: 100,000 files cost
# ~14 MiB rather than ~30 MiB, which keeps the sidecar under its memory budget.
_SIZE_BITS = 40  # sizes up to 1 TiB per file; LMCache chunk files are a few MiB
_SIZE_MASK = (1 << _SIZE_BITS) - 1


def _pack(size: int, mtime: float) -> int:
    return (int(mtime) << _SIZE_BITS) | min(size, _SIZE_MASK)


def _size(packed: int) -> int:
    return packed & _SIZE_MASK


def _mtime_s(packed: int) -> int:
    return packed >> _SIZE_BITS


@dataclass(slots=True)
class _Dir:
    mtime_ns: int = -1  # -1: list it again on the next rescan
    # hash(name) -> packed size/mtime. Keys are hashes, not names, to save memory; a 64-bit
    # collision inside one directory would merge two files in the count, nothing worse.
    files: dict[int, int] = field(default_factory=dict)
    young: set[str] = field(default_factory=set)  # names still settling: stat them again
    subdirs: list[str] = field(default_factory=list)
    bytes: int = 0
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
                d: _Dir | None = self._refresh(path, now, full)
            except FileNotFoundError:
                if path == self.root:
                    raise
                continue  # removed since its parent was listed: its files count as removed
            except OSError as exc:
                if path == self.root:
                    raise
                problems.append(f"cannot read {path}: {type(exc).__name__}")
                d = self._dirs.get(path)
                if d is None:
                    continue
            seen[path] = d
            if cutoff is not None and d.old_cutoff != cutoff:
                # +1: mtimes are kept in whole seconds; count a file only if surely older
                d.old_bytes = sum(_size(p) for p in d.files.values() if _mtime_s(p) + 1 <= cutoff)
                d.old_cutoff = cutoff
            stack.extend(os.path.join(path, name) for name in d.subdirs)
        for path in self._dirs.keys() - seen.keys():
            self._removed += len(self._dirs[path].files)
        self._dirs = seen
        scan = DiskScan(
            bytes=sum(d.bytes for d in seen.values()),
            files=sum(len(d.files) for d in seen.values()),
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
        if d is not None and not full and st.st_mtime_ns == d.mtime_ns:
            if d.young:
                self._restat_young(path, d, now)
        else:
            d = self._list(path, d or _Dir(), now, full)
        d.mtime_ns = st.st_mtime_ns if now - st.st_mtime >= SETTLE_S else -1
        return d

    def _list(self, path: str, old: _Dir, now: float, full: bool) -> _Dir:
        # Builds a new _Dir and leaves `old` untouched, so a listing that fails half-way keeps
        # the last known state.
        new = _Dir()
        matched = 0
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    new.subdirs.append(entry.name)
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                key = hash(entry.name)
                packed = old.files.get(key)
                if packed is not None:
                    matched += 1
                if packed is None or full or entry.name in old.young:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed while listing
                    packed = _pack(st.st_size, st.st_mtime)
                    if now - st.st_mtime < SETTLE_S:
                        new.young.add(entry.name)
                new.files[key] = packed
                new.bytes += _size(packed)
        self._removed += len(old.files) - matched
        return new

    def _restat_young(self, path: str, d: _Dir, now: float) -> None:
        for name in list(d.young):
            key = hash(name)
            before = d.files.get(key)
            try:
                st = os.stat(os.path.join(path, name), follow_symlinks=False)
            except FileNotFoundError:
                d.young.discard(name)
                if before is not None:
                    del d.files[key]
                    d.bytes -= _size(before)
                    self._removed += 1
                continue
            packed = _pack(st.st_size, st.st_mtime)
            d.files[key] = packed
            d.bytes += _size(packed) - (_size(before) if before is not None else 0)
            if now - st.st_mtime >= SETTLE_S:
                d.young.discard(name)
        d.old_cutoff = None


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
