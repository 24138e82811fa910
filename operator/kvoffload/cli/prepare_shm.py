"""`kvoffload prepare-shared-memory`: the init step of a PerNode resource's server pod and serving pods
(spec.offload.server; docs/shared-cache.md). Run as root with CHOWN and FOWNER only, in the operator's image.

  kvoffload prepare-shared-memory --dir /dev/shm --chown 1000:1000

DIR is the resource's own directory of the admin's tmpfs root, <sharedMemoryRoot>/<namespace>/<name>, which kubelet
created root-owned and bind-mounted there (a subPathExpr: kubelet opened each component with O_NOFOLLOW). It is handed
to the serving user, mode 0700: the LMCache server and vLLM's workers (that user, in different pods) create and map
the L1 segment there; nobody else on the node may. Nothing in it is removed: the node's server and replicas share it.
Exit status: 0 done, 2 bad input (not a directory, a link).
"""

from __future__ import annotations

import argparse
import os

from ..api.errors import ConfigError
from .prepare_disk import _ids

MODE = 0o700


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prepare-shared-memory", help="hand a PerNode resource's shared /dev/shm directory to "
                              "the serving user", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, metavar="DIR", help="the mounted <root>/<namespace>/<name> directory")
    p.add_argument("--chown", required=True, metavar="UID:GID", help="hand it to this user")
    p.set_defaults(func=run)


def prepare(path: str, uid: int, gid: int) -> tuple[int, int, int]:
    """Owner and mode of the directory at `path` set through one descriptor that is the directory itself (a link at
    `path` is refused, never followed); returns (uid, gid, mode) as set.

    An O_PATH descriptor: once an earlier pod handed the directory over (0700, UID 1000), root without DAC_OVERRIDE
    may not open it for reading (seen on the real node: "Permission denied"), but may still name it. Owner and mode
    are changed through /proc/self/fd/N, the descriptor's own object, which nothing can swap."""
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError("--dir", f"{path!r} is not a directory (or is a link): {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid, st.st_mode & 0o7777) != (uid, gid, MODE):
            os.chown(f"/proc/self/fd/{fd}", uid, gid)
            os.chmod(f"/proc/self/fd/{fd}", MODE)
            st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_uid, st.st_gid, st.st_mode & 0o7777


def run(args: argparse.Namespace) -> int:
    uid, gid = _ids(args.chown)
    owner, group, mode = prepare(args.dir, uid, gid)
    print(f"kvoffload: {args.dir} handed to {owner}:{group}, mode {mode:04o}", flush=True)
    return 0
