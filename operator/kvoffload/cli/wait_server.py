"""`kvoffload wait-for-shared-cache`: a PerNode serving pod's init step (spec.offload.server; docs/shared-cache.md).

  kvoffload wait-for-shared-cache --address HOST:PORT [--timeout SECONDS]

Waits until a TCP connection to HOST:PORT (the resource's node-local Service: its node's LMCache server) opens. vLLM's
LMCacheMPConnector asks the server its chunk size when vLLM starts and fails the start when none answers; once started
it runs degraded without one. Exit status: 0 connected, 1 timed out (kubelet runs the step again), 2 bad input.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

from ..api.errors import ConfigError

INTERVAL_S = 2.0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("wait-for-shared-cache", help="wait for the node's shared LMCache server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True, metavar="HOST:PORT")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds (default 600)")
    p.set_defaults(func=run)


def wait(host: str, port: int, timeout: float, interval: float = INTERVAL_S) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=interval).close()
            return True
        except OSError:
            if time.monotonic() + interval > deadline:
                return False
            time.sleep(interval)


def run(args: argparse.Namespace) -> int:
    host, sep, port = args.address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError("--address", f"{args.address!r} must be HOST:PORT")
    t0 = time.monotonic()
    if wait(host, int(port), args.timeout):
        print(f"kvoffload: the shared LMCache server at {args.address} answers ({time.monotonic() - t0:.1f}s)",
              flush=True)
        return 0
    print(f"kvoffload: no LMCache server at {args.address} after {args.timeout:g}s (is the node's server pod "
          "running? kubectl get kvs shows SharedCacheReady)", file=sys.stderr)
    return 1
