"""`kvoffload exporter`: the flags (the operator renders them into the pod: names are a contract)
and the run loop."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector

from .. import backends
from ..api.errors import ConfigError
from ..backends.base import SERVER_STATUS
from .capacity import TierCapacity, load_capacity
from .collector import ExporterConfig, TierCollector
from .disk_tier import DiskTierMonitor
from .server import parse_listen, start_server
from .sources import SourceHealth

log = logging.getLogger("kvoffload.exporter")

DESCRIPTION = ("Serve per-tier KV-cache metrics (kvoffload_*) for the vLLM + LMCache beside it, "
               "on /metrics, with /healthz.")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("exporter", help="run the tier-metrics exporter sidecar",
                                   description=DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:9400", metavar="HOST:PORT",
                   help="address to serve /metrics and /healthz on (default %(default)s)")
    p.add_argument("--vllm-metrics-url", default="http://127.0.0.1:8000/metrics", metavar="URL",
                   help="vLLM's Prometheus endpoint, plain http (default %(default)s)")
    p.add_argument("--multiproc-dir", metavar="DIR",
                   help="the PROMETHEUS_MULTIPROC_DIR LMCache writes to; without it, lmcache:* "
                        "metrics are taken from vLLM's page")
    p.add_argument("--disk-dir", metavar="DIR", help="the pod's LMCache disk-tier directory")
    p.add_argument("--lmcache-config", metavar="PATH",
                   help="LMCache YAML (max_local_cpu_size / max_local_disk_size: GiB per worker)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="TP workers per replica; multiplies the per-worker LMCache sizes")
    p.add_argument("--kv-bytes-per-token", type=int, default=0, metavar="N",
                   help="KV bytes per token for one replica (all TP ranks); gives the gpu tier's "
                        "capacity from vllm:cache_config_info. 0: unknown")
    p.add_argument("--backend", choices=backends.NAMES, default=backends.DEFAULT,
                   help="who holds the offload tiers (spec.offload.backend): which sources are read and what "
                        "proves offloading (default %(default)s)")
    p.add_argument("--lmcache-server-url", metavar="URL",
                   help="the LMCache server's /status (backend lmcache-server)")
    p.add_argument("--shared-node", metavar="NODE",
                   help="the node whose shared LMCache server --lmcache-server-url reaches (spec.offload.server "
                        "PerNode): its L1 and L2 are served as tier=\"shared\" with this node's name, not as the "
                        "pod's cpu and disk tiers")
    p.add_argument("--cpu-capacity-bytes", type=int, metavar="N",
                   help="CPU tier of the whole pod, for backends without an LMCache YAML")
    p.add_argument("--disk-capacity-bytes", type=int, metavar="N",
                   help="disk tier of the whole pod, for backends without an LMCache YAML")
    p.add_argument("--engine-versions-file", metavar="PATH",
                   help="JSON the serving image's init container wrote ({vllm, lmcache, torch}); "
                        "served as kvoffload_engine_info")
    p.add_argument("--scrape-timeout", type=float, default=2.0, metavar="SECONDS",
                   help="longest wait for vLLM during one scrape (default %(default)s)")
    p.add_argument("--disk-rescan-interval", type=float, default=30.0, metavar="SECONDS",
                   help="seconds between background rescans of --disk-dir (default %(default)s)")
    p.add_argument("--unloaded-grace-seconds", type=float, default=25.0, metavar="SECONDS",
                   help="how long vLLM's external hits may go without an LMCache retrieve before "
                        "kvoffload_external_hits_unloaded_tokens reports them (LMCache publishes its "
                        "counters every 10 s; default %(default)s)")


def build(args: argparse.Namespace) -> tuple[CollectorRegistry, TierCollector, tuple[str, int]]:
    """Validate the flags and assemble the registry (nothing started yet)."""
    address = parse_listen(args.listen)
    if args.tensor_parallel_size < 1:
        raise ConfigError("--tensor-parallel-size", "must be >= 1")
    if args.kv_bytes_per_token < 0:
        raise ConfigError("--kv-bytes-per-token", "must be >= 0")
    if not args.scrape_timeout > 0:
        raise ConfigError("--scrape-timeout", "must be > 0 seconds")
    if not args.disk_rescan_interval > 0:
        raise ConfigError("--disk-rescan-interval", "must be > 0 seconds")
    if SERVER_STATUS in backends.get(args.backend, "--backend").sources and not args.lmcache_server_url:
        raise ConfigError("--lmcache-server-url", f"is required with --backend {args.backend}")
    if args.shared_node is not None and not args.lmcache_server_url:
        raise ConfigError("--shared-node", "needs --lmcache-server-url (the node's shared server)")
    for name in ("cpu_capacity_bytes", "disk_capacity_bytes"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise ConfigError("--" + name.replace("_", "-"), "must be >= 0")
    capacity = load_capacity(args.lmcache_config, args.tensor_parallel_size)
    if args.cpu_capacity_bytes or args.disk_capacity_bytes:
        capacity = TierCapacity(cpu_bytes=args.cpu_capacity_bytes or capacity.cpu_bytes,
                                disk_bytes=args.disk_capacity_bytes or capacity.disk_bytes)
    if not args.unloaded_grace_seconds >= 0:
        raise ConfigError("--unloaded-grace-seconds", "must be >= 0 seconds")
    config = ExporterConfig(
        vllm_metrics_url=args.vllm_metrics_url,
        multiproc_dir=args.multiproc_dir,
        scrape_timeout=args.scrape_timeout,
        kv_bytes_per_token=args.kv_bytes_per_token,
        engine_versions_file=args.engine_versions_file,
        capacity=capacity,
        backend=args.backend,
        server_status_url=args.lmcache_server_url,
        shared_node=args.shared_node or None,
        unloaded_grace_s=args.unloaded_grace_seconds,
    )
    disk = None
    if args.disk_dir:
        disk = DiskTierMonitor(args.disk_dir, args.disk_rescan_interval, SourceHealth("disk"))
    collector = TierCollector(config, disk)
    # A private registry: nothing of prometheus_client's default (multiprocess-aware) one.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)  # the sidecar's own RSS/CPU, to check its budget
    return registry, collector, address


def run(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    registry, collector, (host, port) = build(args)
    try:
        server = start_server(registry, host, port)
    except OSError as exc:
        raise ConfigError("--listen", f"cannot bind {args.listen}: {exc.strerror or exc}") from None
    if collector.disk is not None:
        collector.disk.start()
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    bound_host, bound_port = server.server_address[:2]
    log.info("kvoffload exporter listening on http://%s:%d/metrics", bound_host, bound_port)
    # A timed wait: a blocking one in the main thread sleeps through a SIGTERM the kernel delivered to another
    # thread (Python runs its handler in the main thread only when that thread wakes), and kubelet would kill us.
    while not stop.wait(1.0):
        pass
    log.info("stopping")
    server.shutdown()
    server.server_close()
    if collector.disk is not None:
        collector.disk.stop()
    return 0
