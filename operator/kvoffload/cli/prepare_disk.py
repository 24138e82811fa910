"""`kvoffload prepare-disk-tier`: the disk-tier init container (node/disk_prepare.py).

hostPath form (as root, the operator's image):
  kvoffload prepare-disk-tier --parent DIR --namespace NS --name NAME --pod POD --owner-uid UID --chown 1000:1000 \
      [--fingerprint JSON --keep-bytes N] [--report FILE]
  With --fingerprint the directory keeps up to N bytes of its newest chunk files when this incarnation (UID)
  prepared it last for the same fingerprint; without, it is emptied.
Ephemeral-volume form (as the serving user):
  kvoffload prepare-disk-tier --dir DIR
Exit status: 0 done, 1 some entries could not be removed, 2 bad input (a link where the pod directory belongs).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from ..api.errors import ConfigError
from ..api.quantity import human
from ..node import disk_prepare, owner_marker
from ..rendering import shared_cache

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
    p.add_argument("--fingerprint", metavar="JSON", help="the disk tier's fingerprint, a JSON object (with --parent): "
                   "keep the directory's chunk files while it and the owner uid are unchanged")
    p.add_argument("--keep-bytes", type=int, default=0, help="at most this many bytes of chunk files are kept")
    p.add_argument("--report", metavar="FILE", help="write kept or emptied, and why, as JSON to FILE (kubelet's "
                   "termination message)")
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
        ordinal = args.pod.startswith(args.name + "-") and args.pod[len(args.name) + 1:].isdigit()
        if not ordinal and args.pod != shared_cache.server_dir(args.name):
            raise ConfigError("--pod", f"{args.pod!r} must be <name>-<ordinal> ({args.name}-0, ...) or, for the "
                                       f"shared server (PerNode), {shared_cache.server_dir(args.name)}")
        uid, gid = _ids(args.chown)
        owner = owner_marker.Owner(args.namespace, args.name, args.pod, args.owner_uid, _fingerprint(args.fingerprint))
        if args.keep_bytes < 0:
            raise ConfigError("--keep-bytes", f"{args.keep_bytes} must be 0 or more")
        done = disk_prepare.prepare_pod_dir(args.parent, owner, uid, gid, keep_bytes=args.keep_bytes)
    for err in done.errors:
        print(f"kvoffload: ERROR {err['path']}: {err['error']}", file=sys.stderr)
    if done.kept:
        print(f"kvoffload: kept {done.path}: {done.kept_files} files, {human(done.kept_bytes)} "
              f"({done.why}); removed {done.files} files, {human(done.bytes)}", flush=True)
    else:
        print(f"kvoffload: emptied {done.path} ({done.files} files, {human(done.bytes)}): {done.why}", flush=True)
    if args.report:
        try:
            with open(args.report, "w") as fh:
                json.dump(done.report(), fh, sort_keys=True)
        except OSError as exc:  # status loses a detail; the pod must still start
            print(f"kvoffload: WARNING cannot write the report to {args.report}: {exc.strerror}", file=sys.stderr)
    return 1 if done.errors else 0


def _fingerprint(value: str | None) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    try:
        body = json.loads(value)
    except ValueError:
        body = None
    if not isinstance(body, dict) or not body:
        raise ConfigError("--fingerprint", "must be a non-empty JSON object")
    return disk_prepare.digests(body)
