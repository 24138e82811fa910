"""`kvoffload run`: the operator process (kopf), scoped to namespaces or the whole cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="run the operator")
    p.add_argument("--namespace", "-n", action="append", default=[], help="watch only these namespaces (repeatable)")
    p.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    p.add_argument("--operator-config", help="operator settings YAML (chart: operator.config)")
    p.add_argument("--liveness", default="http://127.0.0.1:8080/healthz", help="liveness endpoint URL, or '' for none")
    p.add_argument("--metrics-listen", default="", metavar="ADDR:PORT",
                   help="serve the operator's own Prometheus metrics (reconciles by outcome, refused status writes, "
                        "dead tasks) on ADDR:PORT; '' for none")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--leader-election", action="store_true",
                   help="several replicas: only the holder of a coordination.k8s.io Lease reconciles "
                        "(default: standalone)")
    p.add_argument("--leader-election-namespace", default=None,
                   help="namespace of the Lease (default: the pod's own, else the one --namespace, else default)")
    p.add_argument("--lease-name", default=None, help="name of the Lease (default: kvoffload-operator)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import kopf

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # one "handler succeeded" line per pod event
    from ..api.settings import load
    from ..controller import handlers, leader  # handlers: registers the handlers
    from ..controller.kube import Kube, load_api_client

    settings = load(args.operator_config)  # a bad operator config stops here, naming the setting
    namespaces = [] if args.all_namespaces else args.namespace
    identity = leader.default_identity()
    lease = (leader.lease_config(args.leader_election_namespace, args.lease_name, namespaces, identity)
             if args.leader_election else None)

    async def operate() -> None:
        watched = await handlers.watch_optional_kinds(Kube(load_api_client()), settings)  # before kopf fixes its kinds
        decided = handlers.Decided(settings=watched.settings, namespaces=tuple(namespaces),
                                   metrics_listen=args.metrics_listen, lease=lease)
        await kopf.operator(
            # kopf's own default asks getpass.getuser(), which fails as a UID with no passwd entry (the
            # image runs as 65532 with none): give it the pod name + pid instead.
            identity=identity,  # type: ignore[arg-type]  # kopf's Identity: a str NewType it does not export
            clusterwide=not namespaces,
            namespaces=namespaces,
            # High availability is our Lease election (controller/leader.py), the only one: kopf's peering is off.
            standalone=True,
            liveness_endpoint=args.liveness or None,
            memo=kopf.Memo(decided=decided),  # handlers.configure reads it: the one way run's decisions reach them
        )

    asyncio.run(operate())
    return 0
