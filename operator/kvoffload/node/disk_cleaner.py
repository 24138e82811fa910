"""Node-side cleaner for the disk tier: remove the per-pod directories of KVOffloadServes that are gone.

Every serving pod writes LMCache's disk tier into `<path>/<namespace>/<name>/<pod>` on its node
(a hostPath under an admin-allowed root). The init container empties that directory whenever a
pod starts, but nothing runs on a node after the resource is deleted: its files stay there until
this cleaner removes them. It removes `<root>/<ns>/<name>/<pod>` only when
- `<ns>/<name>` is not a live KVOffloadServe, and
- its reclaimPolicy was Delete: the policy of a deleted resource is what an earlier run saw while it
  was live (the state file), else `unknown_policy` (Retain unless the admin says otherwise), and
- the pod directory was not modified for `min_age` seconds (a resource deleted and re-created
  under the same name between the listing and the removal keeps its fresh files), and
- the entries look like ours: namespace and name are DNS labels, pods are `<name>-<ordinal>`.

It never follows a symbolic link and never leaves the root: every directory is opened relative to
its parent's file descriptor with O_NOFOLLOW | O_DIRECTORY and checked to be the entry that was
listed (same device and inode); files and links are unlinked relative to that descriptor, so a
link inside a pod directory is removed itself and whatever it points to is never touched. A root
that is itself a symbolic link is refused, and other file systems mounted below the root are not
entered. Anything unexpected (a file where a directory should be, a link, a permission error) is
left in place and reported. Dry-run mode reports what would go and the bytes it would free.

Pure parts (deciding, reading the live set and the state) are separate from the I/O (the walk).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..api import crd
from ..api.errors import ConfigError

DELETE, RETAIN = "Delete", "Retain"
POLICIES = (DELETE, RETAIN)
Key = tuple[str, str]  # (namespace, name)

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_NAME = re.compile(crd.NAME_PATTERN.removeprefix("^").removesuffix("$"))
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
MAX_DEPTH = 32  # below a pod directory; LMCache writes a flat directory


@dataclass
class Report:
    root: str
    dry_run: bool
    removed: list[dict[str, Any]] = field(default_factory=list)  # {"path", "bytes", "files", "complete", "reason"}
    kept: list[dict[str, str]] = field(default_factory=list)  # {"path", "reason"}: ours, deliberately left
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"path", "reason"}: not ours or not safe to enter
    errors: list[dict[str, str]] = field(default_factory=list)  # {"path", "error"}
    present: set[Key] = field(default_factory=set)  # (namespace, name) directories still on disk afterwards

    @property
    def bytes_freed(self) -> int:
        return sum(r["bytes"] for r in self.removed)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "dryRun": self.dry_run, "bytesFreed": self.bytes_freed, "removed": self.removed,
                "kept": self.kept, "skipped": self.skipped, "errors": self.errors}


# ----------------------------------------------------------------------------- pure parts


def decide(key: Key, live: Mapping[Key, str], remembered: Mapping[Key, str], unknown_policy: str = RETAIN) -> tuple[bool, str]:
    """(remove?, why) for the directories of one (namespace, name)."""
    if key in live:
        return False, "the KVOffloadServe exists"
    policy = remembered.get(key)
    source = "last seen" if policy else "unknown, deleted before the cleaner saw it; --unknown-policy"
    policy = policy or unknown_policy
    if policy != DELETE:
        return False, f"deleted, reclaimPolicy {policy} ({source})"
    return True, f"deleted, reclaimPolicy {DELETE} ({source})"


def _policy_of(item: Mapping[str, Any]) -> str:
    disk = ((item.get("spec") or {}).get("offload") or {}).get("disk") or {}
    policy = disk.get("reclaimPolicy") or crd.default_at("offload.disk.reclaimPolicy")
    return policy if policy in POLICIES else RETAIN  # an unexpected value never deletes


def live_from_json(data: Any, source: str = "--live-json") -> dict[Key, str]:
    """The live set from `kubectl get kvs -A -o json` (a List), a list of KVOffloadServes, or a list of
    {"namespace", "name", "reclaimPolicy"} entries. Anything else is an error, never an empty set."""
    items = data.get("items") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ConfigError(source, "must be a JSON list, or an object with `items` (kubectl get kvs -A -o json)")
    live: dict[Key, str] = {}
    for item in items:
        if not isinstance(item, dict):
            raise ConfigError(source, f"{item!r} is not an object")
        if "metadata" in item:
            if item.get("kind", crd.KIND) != crd.KIND:
                raise ConfigError(source, f"holds a {item.get('kind')}, not {crd.KIND}s")
            meta = item["metadata"] or {}
            ns, name, policy = meta.get("namespace"), meta.get("name"), _policy_of(item)
        else:
            ns, name, policy = item.get("namespace"), item.get("name"), item.get("reclaimPolicy", DELETE)
        if not isinstance(ns, str) or not isinstance(name, str) or not ns or not name or policy not in POLICIES:
            raise ConfigError(source, f"entry {item!r} needs a namespace, a name and a reclaimPolicy of Delete or Retain")
        live[(ns, name)] = policy
    return live


def load_state(data: Any) -> dict[Key, str]:
    """Policies remembered from earlier runs: {"policies": {"<namespace>/<name>": "Delete"|"Retain"}}."""
    policies = (data or {}).get("policies", {}) if isinstance(data, dict) else None
    if not isinstance(policies, dict):
        raise ConfigError("--state", "must be a JSON object with `policies`")
    out: dict[Key, str] = {}
    for key, policy in policies.items():
        ns, _, name = str(key).partition("/")
        if ns and name and policy in POLICIES:
            out[(ns, name)] = policy
    return out


def next_state(remembered: Mapping[Key, str], live: Mapping[Key, str], present: Iterable[Key]) -> dict[str, Any]:
    """Remember every live resource's policy; forget deleted ones whose directories are gone."""
    still = set(present)
    merged = {**{k: v for k, v in remembered.items() if k in still}, **live}
    return {"policies": {f"{ns}/{name}": merged[(ns, name)] for ns, name in sorted(merged)}}


def _pod_pattern(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(name) + r"-(0|[1-9][0-9]{0,5})")


# ----------------------------------------------------------------------------- I/O: the walk


def _open_dir(parent_fd: int, name: str, expected: os.stat_result | None = None) -> int:
    """Open `name` below `parent_fd` as a directory without following a link; make sure it is the entry
    that was listed (a swap between the listing and the open raises ESTALE)."""
    fd = os.open(name, _OPEN_DIR, dir_fd=parent_fd)
    if expected is not None:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (expected.st_dev, expected.st_ino):
            os.close(fd)
            raise OSError(errno.ESTALE, "replaced while the cleaner was looking at it", name)
    return fd


def _entries(fd: int) -> list[tuple[str, os.stat_result | None]]:
    """Names in a directory with their lstat (None if the entry vanished), sorted for stable reports."""
    with os.scandir(fd) as it:
        names = sorted(e.name for e in it)
    out: list[tuple[str, os.stat_result | None]] = []
    for n in names:
        try:
            out.append((n, os.stat(n, dir_fd=fd, follow_symlinks=False)))
        except FileNotFoundError:
            out.append((n, None))
    return out


def _what(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link (never followed)"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    return "a directory"


class _Walk:
    def __init__(self, report: Report, root_dev: int, dry_run: bool) -> None:
        self.report, self.root_dev, self.dry_run = report, root_dev, dry_run

    def error(self, path: str, exc: BaseException) -> None:
        msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        self.report.errors.append({"path": path, "error": msg})

    def empty(self, fd: int, rel: str, depth: int = 0) -> tuple[int, int, bool]:
        """Remove everything in the open directory `fd` (fd-relative, never following a link).
        Returns (bytes, files, complete)."""
        freed = files = 0
        complete = True
        try:
            for child, cst in _entries(fd):
                if cst is None:
                    continue
                child_rel = f"{rel}/{child}"
                if stat.S_ISDIR(cst.st_mode):
                    b, f, ok = self.remove_tree(fd, child, cst, child_rel, depth + 1)
                    freed, files, complete = freed + b, files + f, complete and ok
                    continue
                try:
                    if not self.dry_run:
                        os.unlink(child, dir_fd=fd)  # a link is removed itself, its target is never touched
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    self.error(child_rel, exc)
                    complete = False
                    continue
                files += 1
                if stat.S_ISREG(cst.st_mode):
                    freed += cst.st_size
        except OSError as exc:
            self.error(rel, exc)
            complete = False
        return freed, files, complete

    def remove_tree(self, parent_fd: int, name: str, st: os.stat_result, rel: str, depth: int = 0) -> tuple[int, int, bool]:
        """Remove directory `name` (listed as `st`) and everything in it. Returns (bytes, files, complete)."""
        if st.st_dev != self.root_dev:
            self.report.skipped.append({"path": rel, "reason": "another file system is mounted here; not crossing it"})
            return 0, 0, False
        if depth > MAX_DEPTH:
            self.report.skipped.append({"path": rel, "reason": f"nested deeper than {MAX_DEPTH} directories; left for the admin"})
            return 0, 0, False
        try:
            fd = _open_dir(parent_fd, name, st)
        except OSError as exc:
            self.error(rel, exc)
            return 0, 0, False
        try:
            freed, files, complete = self.empty(fd, rel, depth)
        finally:
            os.close(fd)
        if complete and not self.dry_run:
            try:
                os.rmdir(name, dir_fd=parent_fd)
            except OSError as exc:
                self.error(rel, exc)
                complete = False
        return freed, files, complete


def _subdirs(walk: _Walk, fd: int, rel: str, pattern: re.Pattern[str], what: str) -> Iterable[tuple[str, os.stat_result]]:
    """Real directories below `fd` whose names match `pattern`; everything else is reported and left alone."""
    for name, st in _entries(fd):
        path = f"{rel}/{name}" if rel else name
        if st is None:
            continue
        if not pattern.fullmatch(name):
            walk.report.skipped.append({"path": path, "reason": f"not a {what} directory of kvoffload"})
        elif not stat.S_ISDIR(st.st_mode):
            walk.report.skipped.append({"path": path, "reason": f"expected a {what} directory, found {_what(st)}"})
        elif st.st_dev != walk.root_dev:
            walk.report.skipped.append({"path": path, "reason": "another file system is mounted here; not crossing it"})
        else:
            yield name, st


def open_root(root: str) -> int:
    if not isinstance(root, str) or not root.startswith("/") or os.path.normpath(root) in ("/", "//"):
        raise ConfigError("--root", f"{root!r} must be an absolute directory below / (the disk tier's spec.offload.disk.path)")
    try:
        return os.open(root, _OPEN_DIR)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and os.path.islink(root)):
            raise ConfigError("--root", f"{root} is a symbolic link; give the real directory") from None
        raise ConfigError("--root", f"{root}: {exc.strerror}") from None


def clean(root: str, live: Mapping[Key, str], *, remembered: Mapping[Key, str] | None = None,
          unknown_policy: str = RETAIN, dry_run: bool = False, min_age: float = 600.0, now: float | None = None) -> Report:
    """Remove `<root>/<ns>/<name>/<pod>` of deleted KVOffloadServes whose reclaimPolicy is Delete (see the module doc)."""
    if unknown_policy not in POLICIES:
        raise ConfigError("--unknown-policy", f"{unknown_policy!r} must be Delete or Retain")
    remembered = remembered or {}
    now = time.time() if now is None else now
    report = Report(root=root, dry_run=dry_run)
    root_fd = open_root(root)
    try:
        walk = _Walk(report, os.fstat(root_fd).st_dev, dry_run)
        for ns, ns_st in _subdirs(walk, root_fd, "", _NAMESPACE, "namespace"):
            try:
                ns_fd = _open_dir(root_fd, ns, ns_st)
            except OSError as exc:
                walk.error(ns, exc)
                continue
            try:
                emptied = _clean_namespace(walk, ns_fd, ns, live, remembered, unknown_policy, min_age, now)
            finally:
                os.close(ns_fd)
            if emptied and not dry_run:
                try:
                    os.rmdir(ns, dir_fd=root_fd)
                except OSError as exc:
                    if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        walk.error(ns, exc)
    finally:
        os.close(root_fd)
    return report


def _clean_namespace(walk: _Walk, ns_fd: int, ns: str, live: Mapping[Key, str], remembered: Mapping[Key, str],
                     unknown_policy: str, min_age: float, now: float) -> bool:
    """Clean one namespace directory; True when something was removed and nothing of ours is left in it."""
    report, removed_any, left_any = walk.report, False, False
    for name, name_st in _subdirs(walk, ns_fd, ns, _NAME, "KVOffloadServe"):
        rel = f"{ns}/{name}"
        remove, why = decide((ns, name), live, remembered, unknown_policy)
        if not remove:
            report.kept.append({"path": rel, "reason": why})
            report.present.add((ns, name))
            left_any = True
            continue
        try:
            name_fd = _open_dir(ns_fd, name, name_st)
        except OSError as exc:
            walk.error(rel, exc)
            report.present.add((ns, name))
            left_any = True
            continue
        complete = True
        try:
            for pod, pod_st in _subdirs(walk, name_fd, rel, _pod_pattern(name), "pod"):
                pod_rel = f"{rel}/{pod}"
                age = now - pod_st.st_mtime
                if age < min_age:
                    report.kept.append({"path": pod_rel, "reason": f"modified {age:.0f}s ago, less than --min-age {min_age:g}s"})
                    complete = False
                    continue
                freed, files, ok = walk.remove_tree(name_fd, pod, pod_st, pod_rel)
                complete = complete and ok
                if ok or files:  # a partial removal still freed something; its errors are reported
                    report.removed.append({"path": pod_rel, "bytes": freed, "files": files, "complete": ok, "reason": why})
            leftovers = [n for n, st in _entries(name_fd) if st is not None]
        finally:
            os.close(name_fd)
        if walk.dry_run:
            report.present.add((ns, name))
            removed_any = True
            continue
        if complete and not leftovers:
            try:
                os.rmdir(name, dir_fd=ns_fd)
                removed_any = True
                continue
            except OSError as exc:
                walk.error(rel, exc)
        report.present.add((ns, name))
        left_any = True
    return removed_any and not left_any and not walk.dry_run
