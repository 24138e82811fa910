"""The disk-tier init container (`kvoffload prepare-disk-tier`): a pod directory LMCache can trust.

Kept or emptied. LMCache's in-process disk tier starts with an empty index and never counts files of an earlier
process against its budget, so for it the pod's directory is emptied at every pod start or the disk fills past its
budget. The LMCache server's fs_native L2 (backend lmcache-server) finds a chunk by its file name, so a new server
reads what an earlier one wrote: with a fingerprint (rendering/disk_tier.py) the directory keeps its chunk files
when the same incarnation of the resource prepared it last for the same fingerprint, capped at --keep-bytes (the
newest first; LMCache never counts or evicts them), and is emptied otherwise (docs/disk-tier.md).

hostPath form: the container mounts `<root>/<rel>/<namespace>/<name>` (kubelet made it, root-owned, after opening
every component the tenant chose with O_NOFOLLOW) and runs as root in the operator's own image. It
1. makes `<pod>` there if missing and opens it with O_NOFOLLOW | O_DIRECTORY (a link is refused, never followed),
2. reads the earlier root-owned owner marker (node/owner_marker.py) and decides: keep or empty,
3. writes the marker with the resource's uid and no fingerprint, before anything else,
4. empties `<pod>` fd-relative with the node cleaner's walk (links are unlinked, never followed; another file
   system mounted inside is not entered), or, when kept, removes all but the newest chunk files up to the cap,
5. writes the fingerprint into the marker (only when nothing failed: an interrupted start empties next time),
6. hands `<pod>` to the serving user (chown, chmod 0750: the exporter reads it through fsGroup).
The marker sits in `<name>/`, which no tenant container mounts: a tenant cannot forge the fingerprint it is kept by.
Ephemeral-volume form: the volume is the pod's own; the container empties it in place as the serving user.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import stat
from dataclasses import dataclass

from ..api.errors import ConfigError
from . import owner_marker
from .disk_cleaner import _OPEN_DIR, Report, _entries, _Walk

POD_DIR_MODE = 0o750


CHUNK_SUFFIX = ".data"  # LMCache's fs and fs_native L2 chunk files (fs_l2_adapter.py _FILE_EXT); other files go
FINGERPRINT_FIELDS, FIELD_NAME_MAX = 32, 32  # bounds on what --fingerprint may hold: the marker stays small


@dataclass(frozen=True)
class Prepared:
    path: str
    files: int  # removed
    bytes: int  # removed
    errors: list[dict[str, str]]
    kept: bool = False
    why: str = "emptied"
    kept_files: int = 0
    kept_bytes: int = 0

    def report(self) -> dict[str, object]:
        """What the operator reads back (kubelet's termination message, at most 4 KiB): kept or emptied, and why."""
        return {"disk": "kept" if self.kept else "emptied", "why": self.why[:512],
                "keptFiles": self.kept_files, "keptBytes": self.kept_bytes,
                "removedFiles": self.files, "removedBytes": self.bytes, "errors": len(self.errors)}


def digests(fingerprint: dict[str, object]) -> tuple[tuple[str, str], ...]:
    """One short digest per field: the marker stays small whatever the spec holds, and a mismatch names its fields."""
    if len(fingerprint) > FINGERPRINT_FIELDS or any(len(k) > FIELD_NAME_MAX for k in fingerprint):
        raise ConfigError("--fingerprint", f"at most {FINGERPRINT_FIELDS} fields of at most {FIELD_NAME_MAX} "
                                           "characters")
    return tuple(sorted((k, hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16])
                        for k, v in fingerprint.items()))


def decide(previous: owner_marker.Owner | None, owner: owner_marker.Owner) -> tuple[bool, str]:
    """Keep the directory's files, or empty it, and why. Kept only when this very incarnation (uid) prepared it
    last for this very fingerprint: a later resource of the same name, another spec or an unfinished start empties."""
    if not owner.fingerprint:
        return False, "emptied: the backend's engine never reads files an earlier process wrote (index lost)"
    if not owner.uid:
        return False, "emptied: no resource uid to tie the files to (rendered without an API server)"
    if previous is None:
        return False, "emptied: no owner marker (the directory's first pod, or one from before markers)"
    if previous.uid != owner.uid:
        return False, f"emptied: another incarnation of {owner.namespace}/{owner.name} (uid {previous.uid}) wrote it"
    if not previous.fingerprint:
        return False, "emptied: no fingerprint (the earlier pod's start did not finish, or it did not keep)"
    before, now = dict(previous.fingerprint), dict(owner.fingerprint)
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    if changed:
        return False, f"emptied: the fingerprint changed ({', '.join(changed)})"
    return True, "kept: the same resource and fingerprint"


def _open(path: str, what: str) -> int:
    try:
        return os.open(path, _OPEN_DIR)
    except OSError as exc:
        raise ConfigError(what, f"{path}: {exc.strerror}") from None


def _empty(fd: int, rel: str, why: str = "emptied") -> Prepared:
    report = Report(root=rel, dry_run=False)
    freed, files, _complete = _Walk(report, os.fstat(fd).st_dev, dry_run=False).empty(fd, rel)
    return Prepared(rel, files, freed, report.errors, why=why)


def _trim(fd: int, rel: str, keep_bytes: int, why: str) -> Prepared:
    """Keep the newest chunk files (by modification time: when LMCache stored them) up to `keep_bytes`; remove
    the rest, and everything that is not a chunk file (temporary files of a killed writer, directories, links)."""
    report = Report(root=rel, dry_run=False)
    walk = _Walk(report, os.fstat(fd).st_dev, dry_run=False)
    freed = files = kept_files = kept = 0
    chunks = []
    for name, st in _entries(fd):
        if st is None:
            continue
        if stat.S_ISREG(st.st_mode) and name.endswith(CHUNK_SUFFIX):
            chunks.append((-st.st_mtime_ns, name, st))
            continue
        b, f, _ = walk.remove(fd, name, st, f"{rel}/{name}", 1)  # a link is removed itself, never followed
        freed, files = freed + b, files + f
    full = False
    for _, name, st in sorted(chunks):
        full = full or kept + st.st_size > keep_bytes  # newest first: once one does not fit, every older one goes
        if not full:
            kept, kept_files = kept + st.st_size, kept_files + 1
            continue
        b, f, _ = walk.remove(fd, name, st, f"{rel}/{name}", 1)
        freed, files = freed + b, files + f
    return Prepared(rel, files, freed, report.errors, kept=True, why=why, kept_files=kept_files, kept_bytes=kept)


def empty_in_place(directory: str) -> Prepared:
    """The ephemeral-volume form: empty the mounted volume itself."""
    fd = _open(directory, "--dir")
    try:
        return _empty(fd, directory, "emptied: the pod's own ephemeral volume, new with each pod")
    finally:
        os.close(fd)


def prepare_pod_dir(parent: str, owner: owner_marker.Owner, uid: int, gid: int, keep_bytes: int = 0) -> Prepared:
    """The hostPath form: `<parent>/<pod>` made, marked, kept or emptied, and handed to uid:gid (the module doc).
    `owner.fingerprint` empty: always emptied."""
    parent_fd = _open(parent, "--parent")
    try:
        try:
            os.mkdir(owner.pod, POD_DIR_MODE, dir_fd=parent_fd)
        except FileExistsError:
            pass
        try:
            fd = os.open(owner.pod, _OPEN_DIR, dir_fd=parent_fd)
        except OSError as exc:
            why = "is a symbolic link (never followed)" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else exc.strerror
            raise ConfigError("--pod", f"{parent}/{owner.pod} {why}") from None
        try:
            keep, why = decide(owner_marker.read(parent_fd, owner.namespace, owner.name, owner.pod), owner)
            # The marker first: from now on the janitor decides on this directory by this incarnation's uid. No
            # fingerprint until the directory is ready, so a start killed halfway empties it next time.
            owner_marker.write(parent_fd, dataclasses.replace(owner, fingerprint=()))
            rel = f"{owner.namespace}/{owner.name}/{owner.pod}"
            done = _trim(fd, rel, keep_bytes, why) if keep else _empty(fd, rel, why)
            if owner.fingerprint and not done.errors:
                owner_marker.write(parent_fd, owner)
            os.fchmod(fd, POD_DIR_MODE)
            os.fchown(fd, uid, gid)
            return done
        finally:
            os.close(fd)
    finally:
        os.close(parent_fd)
