"""The disk-tier init container (`kvoffload prepare-disk-tier`): an empty pod directory for LMCache.

LMCache 0.5.6 starts with an empty index and never counts files of an earlier process against its budget, so
the pod's directory is emptied at every pod start or the disk fills past its budget.

hostPath form: the container mounts `<root>/<rel>/<namespace>/<name>` (kubelet made it, root-owned, after opening
every component the tenant chose with O_NOFOLLOW) and runs as root in the operator's own image. It
1. makes `<pod>` there if missing and opens it with O_NOFOLLOW | O_DIRECTORY (a link is refused, never followed),
2. writes the root-owned owner marker (node/owner_marker.py) with the resource's uid, before anything else,
3. empties `<pod>` fd-relative with the node cleaner's walk (links are unlinked, never followed; another file
   system mounted inside is not entered),
4. hands `<pod>` to the serving user (chown, chmod 0750: the exporter reads it through fsGroup).
Ephemeral-volume form: the volume is the pod's own; the container empties it in place as the serving user.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from ..api.errors import ConfigError
from . import owner_marker
from .disk_cleaner import _OPEN_DIR, Report, _Walk

POD_DIR_MODE = 0o750


@dataclass(frozen=True)
class Prepared:
    path: str
    files: int
    bytes: int
    errors: list[dict[str, str]]


def _open(path: str, what: str) -> int:
    try:
        return os.open(path, _OPEN_DIR)
    except OSError as exc:
        raise ConfigError(what, f"{path}: {exc.strerror}") from None


def _empty(fd: int, rel: str) -> Prepared:
    report = Report(root=rel, dry_run=False)
    freed, files, _complete = _Walk(report, os.fstat(fd).st_dev, dry_run=False).empty(fd, rel)
    return Prepared(rel, files, freed, report.errors)


def empty_in_place(directory: str) -> Prepared:
    """The ephemeral-volume form: empty the mounted volume itself."""
    fd = _open(directory, "--dir")
    try:
        return _empty(fd, directory)
    finally:
        os.close(fd)


def prepare_pod_dir(parent: str, owner: owner_marker.Owner, uid: int, gid: int) -> Prepared:
    """The hostPath form: `<parent>/<pod>` made, marked, emptied and handed to uid:gid (see the module doc)."""
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
            # The marker first: from now on the janitor decides on this directory by this incarnation's uid.
            owner_marker.write(parent_fd, owner)
            done = _empty(fd, f"{owner.namespace}/{owner.name}/{owner.pod}")
            os.fchmod(fd, POD_DIR_MODE)
            os.fchown(fd, uid, gid)
            return done
        finally:
            os.close(fd)
    finally:
        os.close(parent_fd)
