"""`kvoffload clean-disk`: remove this node's disk-tier directories of deleted KVOffloadServes.

Run it on a node (the chart's DaemonSet with the allowed roots mounted, or by hand) with the live
KVOffloadServes from a file (`kubectl get kvs -A -o json`) or from the API. Only pod directories of
incarnations (metadata.uid, from the root-owned owner marker beside each) that no longer exist and whose
final reclaimPolicy was Delete are removed. With --interval and the API it watches KVOffloadServes and records
each deleted incarnation's final policy in --state at once; one-shot runs read that file, and an incarnation
it does not name gets --unknown-policy.
Exit status: 0 done, 1 some entries could not be removed (see the report), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from ..api import crd
from ..api.errors import ConfigError
from ..api.quantity import human
from ..node.disk_cleaner import POLICIES, RETAIN, Report, live_from_json
from ..node.janitor import Incarnations, JanitorMetrics, Listed, Source, SweepConfig, loop, sweep, watch


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("clean-disk", help="remove disk-tier directories of "
                                                 "deleted KVOffloadServes from this node",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", action="append", required=True, metavar="DIR",
                   help="an allowed disk root on this node (operator.config.allowedDiskRoots, holding "
                        "<rel>/<namespace>/<name>/<pod>); repeatable")
    live = p.add_mutually_exclusive_group(required=True)
    live.add_argument("--live-json", metavar="FILE",
                      help="live KVOffloadServes: `kubectl get kvs -A -o json` output ('-' reads stdin)")
    live.add_argument("--kubeconfig", metavar="FILE",
                      help="list the live KVOffloadServes from the API server with this kubeconfig")
    live.add_argument("--in-cluster", action="store_true",
                      help="list them with the pod's service account (get/list kvoffloadserves)")
    p.add_argument("--state", metavar="FILE",
                   help="JSON file of deleted incarnations' final reclaimPolicy (written by the watching janitor, read "
                        "by one-shot runs); must lie outside every --root")
    p.add_argument("--unknown-policy", choices=POLICIES, default=RETAIN,
                   help="policy of a deleted resource that no earlier run "
                        "saw (default: %(default)s, i.e. keep its files)")
    p.add_argument("--min-age", type=float, default=600, metavar="SECONDS",
                   help="leave pod directories modified less than this long ago (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="report what would be removed and the bytes freed; change nothing")
    p.add_argument("--output", "-o", choices=("text", "json"), default="text")
    janitor = p.add_argument_group("janitor mode (the chart's DaemonSet)")
    janitor.add_argument("--interval", type=float, default=0, metavar="SECONDS",
                         help="sweep again every SECONDS until SIGTERM (default: "
                              "once); a failed sweep is retried, never fatal")
    janitor.add_argument("--metrics-listen", metavar="HOST:PORT",
                         help="serve kvoffload_janitor_* metrics (bytes reclaimed, "
                              "sweeps, errors) on HOST:PORT, with --interval")
    p.set_defaults(func=run)


def _read_json(path: str, what: str) -> Any:
    try:
        if path == "-":
            return json.load(sys.stdin)
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(what, f"cannot read {path} as JSON: {exc}") from None


def _api(kubeconfig: str | None, in_cluster: bool) -> Any:
    from kubernetes import client, config

    if in_cluster:
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config(config_file=kubeconfig)


def live_from_api(kubeconfig: str | None, in_cluster: bool) -> dict[tuple[str, str], str | None]:
    """Every KVOffloadServe in the cluster. A failure raises: an unreadable live set must never read as 'none live'."""
    from kubernetes import client

    api = _api(kubeconfig, in_cluster)
    source = "--in-cluster" if in_cluster else "--kubeconfig"
    with api:
        try:
            body = client.CustomObjectsApi(api).list_cluster_custom_object(crd.GROUP, crd.VERSION, crd.PLURAL)
        except client.ApiException as exc:
            raise ConfigError(source, f"cannot list {crd.PLURAL}.{crd.GROUP} ({exc.status} {exc.reason}); "
                                      "nothing was removed (the janitor needs get/list on them)") from None
    return live_from_json(body, source)


def _live(args: argparse.Namespace) -> dict[tuple[str, str], str | None]:
    if args.live_json:
        return live_from_json(_read_json(args.live_json, "--live-json"))
    return live_from_api(args.kubeconfig, args.in_cluster)


def _serve_metrics(listen: str, metrics: JanitorMetrics) -> None:
    from prometheus_client import start_http_server

    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError("--metrics-listen", f"{listen!r} is not HOST:PORT (e.g. 127.0.0.1:9401)")
    start_http_server(int(port), addr=host, registry=metrics.registry)


def check_state_outside(state: str | None, roots: list[str]) -> None:
    """A state file below a root is reachable by a tenant's spec path (kubelet would create a directory of
    its name and every later sweep would fail): refuse it."""
    if not state:
        return
    where = os.path.realpath(os.path.dirname(os.path.abspath(state)))
    for root in roots:
        real = os.path.realpath(root)
        if where == real or where.startswith(real.rstrip("/") + "/"):
            raise ConfigError("--state", f"{state} lies below --root {root}, where a tenant's spec.offload.disk.path "
                                         "can reach it; keep it outside every root (the chart's janitor.statePath)")


def run(args: argparse.Namespace) -> int:
    check_state_outside(args.state, args.root)
    cfg = SweepConfig(roots=tuple(args.root), state=args.state, unknown_policy=args.unknown_policy,
                      min_age=args.min_age, dry_run=args.dry_run)
    if args.interval > 0:
        if args.live_json == "-":
            raise ConfigError("--live-json", "cannot read stdin again at every --interval; give a file or the API")
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        metrics = JanitorMetrics()
        if args.metrics_listen:
            _serve_metrics(args.metrics_listen, metrics)
        stop = threading.Event()
        source: Source
        if args.live_json:
            source = Listed(lambda: _live(args), args.state)
        else:
            store = Incarnations(args.state, dry_run=args.dry_run)
            api = _api(args.kubeconfig, args.in_cluster)
            threading.Thread(target=watch, args=(store, stop, api), name="watch", daemon=True).start()
            for _ in range(600):  # the first sweep waits for the first listing (a minute at most)
                if store.synced or stop.wait(0.1):
                    break
            source = store
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            loop(cfg, source, metrics, args.interval, stop, lambda reports: _print(args, reports))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 0
    if args.metrics_listen:
        raise ConfigError("--metrics-listen", "needs --interval (a single run exits before anything scrapes it)")
    reports = sweep(cfg, Listed(lambda: _live(args), args.state).view())
    return _print(args, reports)


def _print(args: argparse.Namespace, reports: list[Report]) -> int:
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
              f"{f'; {errors} errors' if errors else ''}", flush=True)
    return 1 if errors else 0
