"""Node-side cleaner for the disk tier: remove the per-pod directories of KVOffloadServes that are gone.

Every serving pod writes LMCache's disk tier into `<root>/<rel>/<namespace>/<name>/<pod>` on its node: `<root>` is
an admin-allowed root (the hostPath volume), `<rel>` the tenant's part of spec.offload.disk.path. The init container
empties the pod directory whenever a pod starts and writes a root-owned owner marker next to it
(node/owner_marker.py: the resource's metadata.uid), but nothing runs on a node after the resource is deleted.
This cleaner walks each root and removes `<...>/<namespace>/<name>/<pod>` only when
- its marker's incarnation (uid) is not a live KVOffloadServe, and
- that incarnation's reclaimPolicy was Delete: the policy in its final spec, recorded when the janitor's watch
  saw it deleted (`deleted`, uid -> policy); an incarnation whose deletion was not seen (the janitor was down, or
  one-shot runs) or a directory without a marker gets `unknown_policy` (Retain unless the admin says otherwise), and
- the pod directory was not modified for `min_age` seconds.

Where it looks: only directories owned by root (kubelet makes `<rel>/<namespace>/<name>` as root; pods own only
their pod directories, as UID 1000), never through a link, never onto another file system, at most MAX_WALK deep.
A directory holding root-owned markers is a `<namespace>/<name>` directory; the markers name their pods.

It never follows a symbolic link and never leaves the root: every directory is opened relative to
its parent's file descriptor with O_NOFOLLOW | O_DIRECTORY and checked to be the entry that was
listed (same device and inode); files and links are unlinked relative to that descriptor, so a
link inside a pod directory is removed itself and whatever it points to is never touched. A root
that is itself a symbolic link is refused. Anything unexpected is left in place and reported.
Dry-run mode reports what would go and the bytes it would free.

Pure parts (deciding, reading the live set and the state) are separate from the I/O (the walk).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..api import crd
from ..api.errors import ConfigError
from . import owner_marker

DELETE, RETAIN = "Delete", "Retain"
POLICIES = (DELETE, RETAIN)
Key = tuple[str, str]  # (namespace, name)
Live = Mapping[Key, "str | None"]  # live KVOffloadServes: (namespace, name) -> metadata.uid (None: not known)

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_NAME = re.compile(crd.NAME_PATTERN.removeprefix("^").removesuffix("$"))
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
MAX_DEPTH = 32  # below a pod directory; LMCache writes a flat directory
MAX_WALK = 64  # root-owned directories below a root: <rel> (the CRD bounds the path to 512 characters) + ns/name


@dataclass
class Report:
    root: str
    dry_run: bool
    removed: list[dict[str, Any]] = field(default_factory=list)  # {"path", "bytes", "files", "complete", "reason"}
    kept: list[dict[str, str]] = field(default_factory=list)  # {"path", "reason"}: ours, deliberately left
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"path", "reason"}: not ours or not safe to enter
    errors: list[dict[str, str]] = field(default_factory=list)  # {"path", "error"}
    referenced: set[str] = field(default_factory=set)  # uids that owner markers on disk still name afterwards

    @property
    def bytes_freed(self) -> int:
        return sum(r["bytes"] for r in self.removed)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "dryRun": self.dry_run, "bytesFreed": self.bytes_freed, "removed": self.removed,
                "kept": self.kept, "skipped": self.skipped, "errors": self.errors}


# ----------------------------------------------------------------------------- pure parts


def decide(owner: owner_marker.Owner | None, key: Key, live: Live, deleted: Mapping[str, str],
           unknown_policy: str = RETAIN) -> tuple[bool, str]:
    """(remove?, why) for one pod directory, by the incarnation its owner marker names."""
    uid = owner.uid if owner else ""
    if key in live and (not uid or live[key] in (None, uid)):
        return False, "the KVOffloadServe exists"
    if uid and uid in deleted:
        policy, source = deleted[uid], f"the final spec of uid {uid}"
    elif uid:
        policy, source = unknown_policy, f"uid {uid} was deleted while the janitor was not watching; --unknown-policy"
    else:
        policy, source = unknown_policy, "no owner uid in its marker; --unknown-policy"
    if policy != DELETE:
        return False, f"deleted, reclaimPolicy {policy} ({source})"
    return True, f"deleted, reclaimPolicy {DELETE} ({source})"


def policy_of(item: Mapping[str, Any]) -> str:
    disk = ((item.get("spec") or {}).get("offload") or {}).get("disk") or {}
    policy = disk.get("reclaimPolicy") or crd.default_at("offload.disk.reclaimPolicy")
    return policy if policy in POLICIES else RETAIN  # an unexpected value never deletes


def live_from_json(data: Any, source: str = "--live-json") -> dict[Key, str | None]:
    """The live set from `kubectl get kvs -A -o json` (a List), a list of KVOffloadServes, or a list of
    {"namespace", "name", "uid"?} entries. Anything else is an error, never an empty set."""
    items = data.get("items") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ConfigError(source, "must be a JSON list, or an object with `items` (kubectl get kvs -A -o json)")
    live: dict[Key, str | None] = {}
    for item in items:
        if not isinstance(item, dict):
            raise ConfigError(source, f"{item!r} is not an object")
        if "metadata" in item:
            if item.get("kind", crd.KIND) != crd.KIND:
                raise ConfigError(source, f"holds a {item.get('kind')}, not {crd.KIND}s")
            meta = item["metadata"] or {}
            ns, name, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
        else:
            ns, name, uid = item.get("namespace"), item.get("name"), item.get("uid")
        if (not isinstance(ns, str) or not isinstance(name, str) or not ns or not name
                or not isinstance(uid, (str, type(None)))):
            raise ConfigError(source, f"entry {item!r} needs a namespace and a name (and a uid, if any, as a string)")
        live[(ns, name)] = uid or None
    return live


def load_state(data: Any) -> dict[str, str]:
    """Final policies of deleted incarnations: {"deleted": {"<uid>": {"namespace", "name", "reclaimPolicy"}}}.
    A state of the earlier format ({"policies": {"<ns>/<name>": ...}}, by name, not by incarnation) is not
    trusted: it reads as empty, so those resources get --unknown-policy."""
    deleted = (data or {}).get("deleted", {}) if isinstance(data, dict) else None
    if not isinstance(deleted, dict):
        raise ConfigError("--state", "must be a JSON object with `deleted`")
    return {str(uid): entry["reclaimPolicy"] for uid, entry in deleted.items()
            if isinstance(entry, dict) and entry.get("reclaimPolicy") in POLICIES}


def dump_state(deleted: Mapping[str, dict[str, str]]) -> dict[str, Any]:
    return {"deleted": {uid: dict(deleted[uid]) for uid in sorted(deleted)}}


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
                b, f, ok = self.remove(fd, child, cst, f"{rel}/{child}", depth + 1)
                freed, files, complete = freed + b, files + f, complete and ok
        except OSError as exc:
            self.error(rel, exc)
            complete = False
        return freed, files, complete

    def remove(self, fd: int, name: str, st: os.stat_result, rel: str, depth: int) -> tuple[int, int, bool]:
        """Remove one entry of the open directory `fd`: a directory with everything in it, anything else itself (a
        link is removed, its target is never touched). Returns (bytes, files, complete)."""
        if stat.S_ISDIR(st.st_mode):
            return self.remove_tree(fd, name, st, rel, depth)
        try:
            if not self.dry_run:
                os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return 0, 0, True
        except OSError as exc:
            self.error(rel, exc)
            return 0, 0, False
        return (st.st_size if stat.S_ISREG(st.st_mode) else 0), 1, True

    def remove_tree(self, parent_fd: int, name: str, st: os.stat_result, rel: str,
                    depth: int = 0) -> tuple[int, int, bool]:
        """Remove directory `name` (listed as `st`) and everything in it. Returns (bytes, files, complete)."""
        if st.st_dev != self.root_dev:
            self.report.skipped.append({"path": rel, "reason": "another file system is mounted here; not crossing it"})
            return 0, 0, False
        if depth > MAX_DEPTH:
            self.report.skipped.append({"path": rel,
                                        "reason": f"nested deeper than {MAX_DEPTH} directories; left for the admin"})
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


def open_root(root: str) -> int:
    if not isinstance(root, str) or not root.startswith("/") or os.path.normpath(root) in ("/", "//"):
        raise ConfigError("--root", f"{root!r} must be an absolute directory below / "
                                    "(an allowed disk root, operator.config.allowedDiskRoots)")
    try:
        return os.open(root, _OPEN_DIR)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and os.path.islink(root)):
            raise ConfigError("--root", f"{root} is a symbolic link; give the real directory") from None
        raise ConfigError("--root", f"{root}: {exc.strerror}") from None


def clean(root: str, live: Live, *, deleted: Mapping[str, str] | None = None, unknown_policy: str = RETAIN,
          dry_run: bool = False, min_age: float = 600.0, now: float | None = None) -> Report:
    """Remove pod directories of deleted incarnations whose reclaimPolicy is Delete below `root` (the module doc)."""
    if unknown_policy not in POLICIES:
        raise ConfigError("--unknown-policy", f"{unknown_policy!r} must be Delete or Retain")
    report = Report(root=root, dry_run=dry_run)
    root_fd = open_root(root)
    try:
        walk = _Walk(report, os.fstat(root_fd).st_dev, dry_run)
        sweep = _Sweep(walk, live, deleted or {}, unknown_policy, min_age, time.time() if now is None else now)
        sweep.visit(root_fd, ())
    finally:
        os.close(root_fd)
    return report


NAME_EMPTIED, NAMESPACE_TRY = 2, 1  # what visit() asks of its caller: remove me (and try my parent), or try me


@dataclass
class _Sweep:
    walk: _Walk
    live: Live
    deleted: Mapping[str, str]
    unknown_policy: str
    min_age: float
    now: float

    def visit(self, fd: int, parts: tuple[str, ...]) -> int:
        """Clean the root-owned directory `fd` (at `parts` below the root) and what lies below it.
        Returns NAME_EMPTIED for a `<namespace>/<name>` directory the sweep emptied, NAMESPACE_TRY for the
        directory above one it removed, else 0: only those two levels go, the tenant's `<rel>` may be shared."""
        entries = [(n, st) for n, st in _entries(fd) if st is not None]
        pods = {p for n, st in entries
                if (p := owner_marker.pod_of(n)) and stat.S_ISREG(st.st_mode) and st.st_uid == 0}
        result = 0
        if pods and len(parts) >= 2:
            result = NAME_EMPTIED if self.incarnations(fd, parts, pods, dict(entries)) else 0
        for name, st in entries:
            if (name in pods or not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_dev != self.walk.root_dev
                    or len(parts) >= MAX_WALK):
                continue  # pods' own directories (UID 1000's), files, links, other file systems: never walked
            rel = "/".join((*parts, name))
            try:
                child = _open_dir(fd, name, st)
            except OSError as exc:
                self.walk.error(rel, exc)
                continue
            try:
                asks = self.visit(child, (*parts, name))
            finally:
                os.close(child)
            if not asks or self.walk.dry_run:
                continue
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    self.walk.error(rel, exc)
                continue
            if asks == NAME_EMPTIED and not result:
                result = NAMESPACE_TRY
        return result

    def incarnations(self, fd: int, parts: tuple[str, ...], pods: set[str], entries: dict[str, os.stat_result]) -> bool:
        """One `<namespace>/<name>` directory: decide on each marked pod directory by its owner's uid.
        True when nothing is left in it afterwards (not in dry-run)."""
        ns, name = parts[-2], parts[-1]
        rel, report = "/".join(parts), self.walk.report
        if not _NAMESPACE.fullmatch(ns) or not _NAME.fullmatch(name):
            report.skipped.append({"path": rel, "reason": "not a <namespace>/<name> directory of kvoffload"})
            return False
        pod_name = _pod_pattern(name)
        for pod in sorted(pods):
            pod_rel = f"{rel}/{pod}"
            owner = owner_marker.read(fd, ns, name, pod)
            if owner is None or not pod_name.fullmatch(pod):
                report.skipped.append({"path": pod_rel, "reason": "its owner marker is not one kvoffload wrote; left"})
                continue
            remove, why = decide(owner, (ns, name), self.live, self.deleted, self.unknown_policy)
            st = entries.get(pod)
            if not remove:
                report.kept.append({"path": pod_rel, "reason": why})
                if owner.uid:
                    report.referenced.add(owner.uid)
                continue
            if st is not None and not stat.S_ISDIR(st.st_mode):
                report.skipped.append({"path": pod_rel, "reason": f"expected a pod directory, found {_what(st)}"})
                continue
            if st is not None:
                age = self.now - st.st_mtime
                if age < self.min_age:
                    report.kept.append({"path": pod_rel, "reason": f"modified {age:.0f}s ago, less than --min-age "
                                                                   f"{self.min_age:g}s"})
                    report.referenced.add(owner.uid)
                    continue
                if owner_marker.read(fd, ns, name, pod) != owner:  # a new incarnation's pod took it meanwhile
                    report.kept.append({"path": pod_rel, "reason": "its owner changed while the janitor looked"})
                    continue
                freed, files, ok = self.walk.remove_tree(fd, pod, st, pod_rel)
                if ok or files:  # a partial removal still freed something; its errors are reported
                    report.removed.append({"path": pod_rel, "bytes": freed, "files": files, "complete": ok,
                                           "reason": why})
                if not ok:
                    report.referenced.add(owner.uid)
                    continue
            if not self.walk.dry_run:
                owner_marker.remove(fd, pod)
        if self.walk.dry_run:
            return False
        return not any(st is not None for _, st in _entries(fd))
