"""`kvoffload prepare-disk-tier`: the disk-tier init container (node/disk_prepare.py).

hostPath form (as root, the operator's image):
  kvoffload prepare-disk-tier --parent DIR --namespace NS --name NAME --pod POD --owner-uid UID --chown 1000:1000
Ephemeral-volume form (as the serving user):
  kvoffload prepare-disk-tier --dir DIR
Exit status: 0 done, 1 some entries could not be removed, 2 bad input (a link where the pod directory belongs).
"""

from __future__ import annotations

import argparse
import re
import sys

from ..api.errors import ConfigError
from ..api.quantity import human
from ..node import disk_prepare, owner_marker

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prepare-disk-tier", help="empty (and, for a hostPath, create and mark) a pod's "
                              "disk-tier directory", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--parent", metavar="DIR",
                       help="the mounted <root>/<rel>/<namespace>/<name> directory (hostPath)")
    where.add_argument("--dir", metavar="DIR", help="the pod's own volume, emptied in place (ephemeral volume)")
    p.add_argument("--namespace", help="the pod's namespace (with --parent)")
    p.add_argument("--name", help="the KVOffloadServe's name (with --parent)")
    p.add_argument("--pod", help="the pod's name, <name>-<ordinal> (with --parent)")
    p.add_argument("--owner-uid", default="", help="the KVOffloadServe's metadata.uid, written to the owner marker")
    p.add_argument("--chown", metavar="UID:GID", help="hand the pod directory to this user (with --parent)")
    p.set_defaults(func=run)


def _ids(value: str | None) -> tuple[int, int]:
    uid, sep, gid = (value or "").partition(":")
    if not sep or not uid.isdigit() or not gid.isdigit():
        raise ConfigError("--chown", f"{value!r} must be UID:GID (numbers), e.g. 1000:1000")
    return int(uid), int(gid)


def run(args: argparse.Namespace) -> int:
    if args.dir:
        done = disk_prepare.empty_in_place(args.dir)
    else:
        for flag in ("namespace", "name", "pod"):
            if not _DNS_LABEL.fullmatch(getattr(args, flag) or ""):
                raise ConfigError(f"--{flag}", f"{getattr(args, flag)!r} must be a DNS label (with --parent)")
        if not args.pod.startswith(args.name + "-") or not args.pod[len(args.name) + 1:].isdigit():
            raise ConfigError("--pod", f"{args.pod!r} must be <name>-<ordinal> ({args.name}-0, ...)")
        uid, gid = _ids(args.chown)
        owner = owner_marker.Owner(args.namespace, args.name, args.pod, args.owner_uid)
        done = disk_prepare.prepare_pod_dir(args.parent, owner, uid, gid)
    for err in done.errors:
        print(f"kvoffload: ERROR {err['path']}: {err['error']}", file=sys.stderr)
    print(f"kvoffload: emptied {done.path} ({done.files} files, {human(done.bytes)})", flush=True)
    return 1 if done.errors else 0
