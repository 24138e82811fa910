"""Which incarnation of a KVOffloadServe last prepared a pod directory: a root-owned marker next to it.

A hostPath disk tier lives in `<root>/<rel>/<namespace>/<name>/<pod>`. kubelet makes every directory down to
`<name>` as root when it expands the init container's subPath, and tenant containers only ever mount the `<pod>`
directories below it, so `<name>/` is a place a tenant cannot write. The disk-tier init container (the operator's
image, as root; node/disk_prepare.py) writes `.kvoffload-owner-<pod>.json` there before it hands `<pod>` to the
serving user: the namespace, name, pod and the resource's metadata.uid (and, once the directory is ready, the
digests of its disk fingerprint, by which a later pod start keeps or empties it: node/disk_prepare.py). The janitor
decides on a pod directory by that uid, so a later KVOffloadServe of the same name never decides for an earlier
one's files.

Only a regular file owned by root, opened without following a link, is believed; anything else reads as "no
marker" (the janitor then applies its unknown policy, Retain by default).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

PREFIX, SUFFIX = ".kvoffload-owner-", ".json"
MAX_BYTES = 4096
_O_NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class Owner:
    namespace: str
    name: str
    pod: str
    uid: str  # the KVOffloadServe's metadata.uid; empty when rendered offline (no API server, no uid)
    # The disk tier's fingerprint the pod directory was prepared for, one digest per field (rendering/disk_tier.py;
    # node/disk_prepare.py): written once the directory is ready, empty while it is being emptied or never kept.
    fingerprint: tuple[tuple[str, str], ...] = ()


def file_name(pod: str) -> str:
    return f"{PREFIX}{pod}{SUFFIX}"


def pod_of(entry: str) -> str | None:
    """The pod a marker file name is about, or None for any other name."""
    if entry.startswith(PREFIX) and entry.endswith(SUFFIX) and len(entry) > len(PREFIX) + len(SUFFIX):
        return entry[len(PREFIX):-len(SUFFIX)]
    return None


def encode(owner: Owner) -> bytes:
    body: dict[str, object] = {"namespace": owner.namespace, "name": owner.name, "pod": owner.pod, "uid": owner.uid}
    if owner.fingerprint:
        body["fingerprint"] = dict(owner.fingerprint)
    return (json.dumps(body, sort_keys=True) + "\n").encode()


def decode(data: bytes, namespace: str, name: str, pod: str) -> Owner:
    """The marker's owner; ValueError unless it names exactly the directory it sits in."""
    body = json.loads(data)
    if not isinstance(body, dict) or not isinstance(body.get("uid"), str):
        raise ValueError("not a kvoffload owner marker")
    if (body.get("namespace"), body.get("name"), body.get("pod")) != (namespace, name, pod):
        raise ValueError(f"names {body.get('namespace')}/{body.get('name')}/{body.get('pod')}, "
                         f"not {namespace}/{name}/{pod}")
    fp = body.get("fingerprint") or {}
    if not isinstance(fp, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in fp.items()):
        fp = {}  # not one this code wrote: no fingerprint, so the directory is emptied
    return Owner(namespace, name, pod, body["uid"], tuple(sorted(fp.items())))


def write(dir_fd: int, owner: Owner) -> None:
    """Atomically (a temporary file renamed over the marker), relative to `dir_fd`, never through a link."""
    final, tmp = file_name(owner.pod), f"{file_name(owner.pod)}.tmp"
    try:
        os.unlink(tmp, dir_fd=dir_fd)  # left by a killed earlier attempt
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW, 0o644, dir_fd=dir_fd)
    try:
        os.write(fd, encode(owner))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def read(dir_fd: int, namespace: str, name: str, pod: str) -> Owner | None:
    """The marker of `pod` in the open `<name>` directory, or None when there is none worth believing."""
    try:
        fd = os.open(file_name(pod), os.O_RDONLY | _O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_size > MAX_BYTES:
            return None  # only root writes markers; a file another user made is not one
        return decode(os.read(fd, MAX_BYTES), namespace, name, pod)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def remove(dir_fd: int, pod: str) -> None:
    try:
        os.unlink(file_name(pod), dir_fd=dir_fd)
    except FileNotFoundError:
        pass
