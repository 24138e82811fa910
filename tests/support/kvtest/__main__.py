"""`python -m kvtest up|down|status [--nodes-config FILE]`: the local control plane (make cluster-up/down/status)."""

from __future__ import annotations

import argparse
import sys
import time

from .cluster import Cluster, log
from .fleet import load_fleet


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtest",
                                 description="A real local Kubernetes control plane for tests and the demo.")
    ap.add_argument("command", choices=["up", "down", "status", "bin-dir", "load-images"])
    ap.add_argument("images", nargs="*",
                    help="load-images: any of kvtest.images NAMES (operator, "
                         "standin-slim, router, ...) into the real node")
    ap.add_argument("--nodes-config", help="fleet YAML (default tests/cluster/nodes.yaml)")
    ap.add_argument("--real-node", action="store_true",
                    help="a real kubelet + containerd node beside the kwok fleet (root; tests/cluster/build-node.sh)")
    a = ap.parse_args(argv)
    c = Cluster(real_node=True) if a.real_node else Cluster()
    if a.command == "bin-dir":  # for shell scripts (demo.sh): where helm and the control plane live
        print(c.bin)
        return 0
    if a.command == "load-images":  # podman images into the running real node (demo.sh)
        if not c.real_node:
            ap.error(f"the cluster in {c.dir} has no real node (kvtest up --real-node)")
        from . import node

        log(f"loaded {node.load_images(c, a.images) or 'nothing new'}")
        return 0
    if a.command == "up":
        t0 = time.monotonic()
        pools = load_fleet(a.nodes_config) if a.nodes_config else None
        started = c.up(pools)
        log(("started" if started else "reusing running cluster") +
            f" in {time.monotonic() - t0:.1f}s; export KUBECONFIG={c.kubeconfig}")
        print(c.kubeconfig)
        return 0
    if a.command == "down":
        problems = c.down()
        for p in problems:
            print(f"PROBLEM: {p}", file=sys.stderr)
        print("down" if not problems else "down with problems")
        return 1 if problems else 0
    print(c.status_text())
    return 0 if c.healthy() else 1


sys.exit(main())
