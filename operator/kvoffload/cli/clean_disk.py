"""`kvoffload clean-disk`: remove this node's disk-tier directories of deleted KVOffloadServes.

Run it on a node (a CronJob or DaemonSet with the disk root mounted, or by hand) with the live
KVOffloadServes from a file (`kubectl get kvs -A -o json`) or from the API. Only directories of
resources that no longer exist and whose reclaimPolicy was Delete are removed; `--state` remembers
each resource's policy while it is live, so the next run knows it after the resource is gone.
Exit status: 0 done, 1 some entries could not be removed (see the report), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from ..api import crd
from ..api.errors import ConfigError
from ..api.quantity import human
from ..node.disk_cleaner import POLICIES, RETAIN, clean, live_from_json, load_state, next_state


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("clean-disk", help="remove disk-tier directories of deleted KVOffloadServes from this node",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", action="append", required=True, metavar="DIR",
                   help="a disk-tier path on this node (spec.offload.disk.path, holding <namespace>/<name>/<pod>); repeatable")
    live = p.add_mutually_exclusive_group(required=True)
    live.add_argument("--live-json", metavar="FILE", help="live KVOffloadServes: `kubectl get kvs -A -o json` output ('-' reads stdin)")
    live.add_argument("--kubeconfig", metavar="FILE", help="list the live KVOffloadServes from the API server with this kubeconfig")
    live.add_argument("--in-cluster", action="store_true", help="list them with the pod's service account (get/list kvoffloadserves)")
    p.add_argument("--state", metavar="FILE",
                   help="JSON file that remembers each resource's reclaimPolicy between runs (read, then rewritten unless --dry-run)")
    p.add_argument("--unknown-policy", choices=POLICIES, default=RETAIN,
                   help="policy of a deleted resource that no earlier run saw (default: %(default)s, i.e. keep its files)")
    p.add_argument("--min-age", type=float, default=600, metavar="SECONDS",
                   help="leave pod directories modified less than this long ago (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="report what would be removed and the bytes freed; change nothing")
    p.add_argument("--output", "-o", choices=("text", "json"), default="text")
    p.set_defaults(func=run)


def _read_json(path: str, what: str) -> Any:
    try:
        if path == "-":
            return json.load(sys.stdin)
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(what, f"cannot read {path} as JSON: {exc}") from None


def live_from_api(kubeconfig: str | None, in_cluster: bool) -> dict[tuple[str, str], str]:
    """Every KVOffloadServe in the cluster. A failure raises: an unreadable live set must never read as 'none live'."""
    from kubernetes import client, config

    if in_cluster:
        config.load_incluster_config()
        api = client.ApiClient()
    else:
        api = config.new_client_from_config(config_file=kubeconfig)
    with api:
        body = client.CustomObjectsApi(api).list_cluster_custom_object(crd.GROUP, crd.VERSION, crd.PLURAL)
    return live_from_json(body, "--kubeconfig")


def _write_state(path: str, state: dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".kvoffload-cleaner-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(state, fh, indent=1, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run(args: argparse.Namespace) -> int:
    if args.live_json:
        live = live_from_json(_read_json(args.live_json, "--live-json"))
    else:
        live = live_from_api(args.kubeconfig, args.in_cluster)
    remembered = load_state(_read_json(args.state, "--state")) if args.state and os.path.exists(args.state) else {}
    reports = [clean(root, live, remembered=remembered, unknown_policy=args.unknown_policy, dry_run=args.dry_run,
                     min_age=args.min_age) for root in args.root]
    if args.state and not args.dry_run:
        _write_state(args.state, next_state(remembered, live, set().union(*(r.present for r in reports))))
    errors = sum(len(r.errors) for r in reports)
    if args.output == "json":
        print(json.dumps({"dryRun": args.dry_run, "bytesFreed": sum(r.bytes_freed for r in reports),
                          "roots": [r.to_dict() for r in reports]}, indent=2))
    else:
        verb = "would remove" if args.dry_run else "removed"
        for r in reports:
            for item in r.removed:
                print(f"{r.root}: {verb} {item['path']} ({human(item['bytes'])}, {item['files']} files)")
            for item in r.kept:
                print(f"{r.root}: kept {item['path']} ({item['reason']})")
            for item in r.skipped:
                print(f"{r.root}: skipped {item['path']} ({item['reason']})")
            for item in r.errors:
                print(f"{r.root}: ERROR {item['path']}: {item['error']}", file=sys.stderr)
        freed = sum(r.bytes_freed for r in reports)
        pods = sum(len(r.removed) for r in reports)
        print(f"{'would free' if args.dry_run else 'freed'} {human(freed)} ({freed} bytes) in {pods} pod directories"
              f"{f'; {errors} errors' if errors else ''}")
    return 1 if errors else 0
