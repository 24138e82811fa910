"""Backend lmcache-server: an LMCache server (`lmcache server`, LMCache 0.5.3's multiprocess server) in a
native sidecar of the serving pod, reached by vLLM's LMCacheMPConnector over ZMQ on the pod's loopback.
Its L1 is a named /dev/shm segment vLLM's workers copy into (engine-driven transfer: the server needs no
GPU); the L1 survives vLLM container restarts, and the L2's files a replaced pod on the same node (the
disk-tier init step keeps them while the resource's disk fingerprint is unchanged: docs/disk-tier.md).

Memory: the server holds the whole replica's L1 (--l1-size-gb) as a named /dev/shm segment, so
/dev/shm = the NCCL/IPC share + L1. Who first faults the segment in decides which container's cgroup
is charged: LMCache 0.5.3 allocates it with c_ops' alloc_shm_pinned_ptr when the server process sees
a CUDA device (it writes one byte per page, then cudaHostRegister: the server is charged), and with
torch_ops' fallback when it sees none (SharedMemory, untouched: the vLLM workers that map and pin it
are charged). Which case a GPU node gives is not measured, so both containers' LIMITS hold the L1
while only the vLLM container's REQUEST does: scheduling and the pod total count it once, and neither
container is OOM-killed for pages it faulted. The server's request is its own process
(server_baseline + headroom)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

# The server's ZMQ port, and its HTTP /healthcheck and /status (L1/L2 usage, registered engines; not /metrics in 0.5.3):
# declared with the pod's other ports in api/managed.py, which spec.metrics.port may not reuse.
from ..api.managed import SERVER_HTTP_PORT, SERVER_ZMQ_PORT
from ..api.quantity import format_bytes, gib
from .base import (
    DISK_DIR,
    NODE_NAME_ENV,
    SERVER_STATUS,
    VLLM,
    Backend,
    BudgetView,
    DiskReuse,
    MemoryTerm,
    Reasons,
    Refusal,
    Seen,
    Sidecar,
    Sizing,
)

if TYPE_CHECKING:
    from ..api.spec import Spec

# One server per /dev/shm, so one name: the pod's own /dev/shm (Sidecar), or the resource's directory on the node,
# which one server per resource and node uses (PerNode).
SERVER_SHM_NAME = "lmcache_l1_pool_kvoffload"
# The segment a killed server leaves (a crash or an OOM kill runs no clean-up) stays in its tmpfs: the pod's
# memory-backed /dev/shm, which outlives a container restart, or the PerNode directory, which outlives the pod. LMCache
# 0.5.3 checks the tmpfs's free room for a whole L1 before it replaces the segment and, short of it, falls back to
# pickled transfer (H200, 4 Dec 2026: "Insufficient /dev/shm capacity", stores at ~150 MB/s, no hit from the L2 after
# the restart). One server per /dev/shm (a pod's own; PerNode: strategy Recreate), so the name is this server's: it is
# removed before the server starts. rm removes a link itself, never what it names.
SERVER_PRELUDE = f'rm -f "/dev/shm/{SERVER_SHM_NAME}"; exec "$0" "$@"'
SERVER_COMMAND = ["/bin/sh", "-c", SERVER_PRELUDE, "lmcache", "server"]
SERVER_TRANSFER_MODE = "engine_driven"  # the server has no GPU: vLLM's workers copy KV into its /dev/shm L1
# PerNode: how long vLLM's connector waits for an answer from the server (LMCache's lmcache.mp.mq_timeout, 300 s by
# default). A shared server can die while its replicas live; this bounds what an in-flight request waits before it
# is recomputed, and what a vLLM start waits for the server (vLLM asks it its chunk size then): an H200 32K-token
# reload took 0.17 s, so 20 s leaves two orders of magnitude for a loaded server. H200, the server SIGKILLed under
# load: the requests in flight took 20.0 s, none failed (docs/benchmarks.md).
SHARED_MQ_TIMEOUT_S = 20.0


def kv_transfer_config(host: str, extra: dict[str, Any] | None = None) -> str:
    """vLLM's --kv-transfer-config: LMCacheMPConnector to the server at `host` (a zmq tcp:// URL without the port)."""
    return json.dumps({
        "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": host, "lmcache.mp.port": SERVER_ZMQ_PORT,
                                      "lmcache.mp.mp_transfer_mode": SERVER_TRANSFER_MODE, **(extra or {})}},
        separators=(",", ":"))


MP_KV_TRANSFER_CONFIG = kv_transfer_config("tcp://127.0.0.1")  # the sidecar, on the pod's loopback


def server_args(spec: Spec, budget: BudgetView) -> list[str]:
    """`lmcache server` flags (LMCache 0.5.3's own parser, checked in the fidelity tests): the whole
    replica's L1 (one server serves every TP rank), LRU, and the disk tier as an `fs_native` L2 adapter
    whose max_capacity_gb caps it (the plain `fs` adapter has no capacity limit), writing with O_DIRECT. The L1 is eager
    (--no-l1-use-lazy) so that vLLM's workers and the server share it through /dev/shm. A sidecar listens on the pod's
    loopback; a shared server (PerNode) on its pod's addresses, fenced by its NetworkPolicy (rendering/shared_cache.py):
    its replicas reach it through a Service, and kubelet's probes and the exporters read its HTTP port."""
    host = "0.0.0.0" if spec.offload.shared else "127.0.0.1"
    args = ["--host", host, "--port", str(SERVER_ZMQ_PORT),
            "--chunk-size", str(spec.offload.chunk_size),
            "--l1-size-gb", repr(round(gib(budget.tier("cpu").bytes), 6)),
            "--eviction-policy", spec.offload.eviction_policy,
            # Eager L1: LMCache 0.5.3 defaults to a lazy L1 on GPU hosts, which turns the /dev/shm
            # transfer off; KV then travels pickled over ZMQ (H200: ~144 MB/s stores, and a retrieve
            # over 4 GiB fails msgpack's limit, hanging vLLM for mq_timeout and killing its engine).
            "--no-l1-use-lazy",
            # The L1's /dev/shm segment, named: LMCache 0.5.3 names one itself when the flag is absent, 0.5.6
            # disables it (`--shm-name ""` is its default), and KV then travels pickled over ZMQ the same way
            # (H200, 3 Dec 2026: "Creating EngineDrivenContextPickle", a 32K prompt's store over msgpack's 4 GiB
            # limit, and the server OOM-killed under load). LMCache prefixes the name with lmcache_l1_pool_.
            "--shm-name", SERVER_SHM_NAME,
            "--supported-transfer-mode", SERVER_TRANSFER_MODE,
            "--http-host", host, "--http-port", str(SERVER_HTTP_PORT),
            "--instance-id", "$(POD_NAME)"]
    if spec.offload.disk:
        # O_DIRECT: buffered L2 writes leave page cache charged to the server's cgroup, whose limit is the L1
        # + a few GiB; at that limit every write waits for reclaim and writeback (H200, 1 Dec: the server sat
        # at its limit and reloads after the first took 1.2-1.4 s instead of 0.15 s; docs/benchmarks.md).
        adapter = {**L2_LAYOUT, "base_path": DISK_DIR, "max_capacity_gb": round(gib(budget.tier("disk").bytes), 6),
                   # Without an `eviction` block LMCache never evicts from L2: max_capacity_gb only feeds its usage
                   # figures (0.5.3 and 0.5.6: storage_manager.py builds an L2 eviction state only for an adapter
                   # config with one; 0.5.6's fs_native warns "will NOT bound disk usage").
                   "eviction": {"eviction_policy": spec.offload.eviction_policy, **L2_EVICTION}}
        args += ["--l2-adapter", json.dumps(adapter, separators=(",", ":"), sort_keys=True)]
    return args


# The L2 adapter's fields that decide what its files hold: part of the disk tier's fingerprint (rendering/disk_tier.py).
L2_LAYOUT = {"type": "fs_native", "use_odirect": True}
# LMCache's own defaults (0.5.3 and 0.5.6 EvictionConfig), written out: the kept share below is derived from them.
# Its L2 eviction loop (once a second) deletes eviction_ratio of the keys it tracks once usage reaches the watermark.
L2_EVICTION = {"trigger_watermark": 0.8, "eviction_ratio": 0.2}


def kept_bytes(disk_bytes: int) -> int:
    """What a restarted pod keeps of its L2 directory. The fs_native adapter finds kept files (a lookup is a file
    existence check) but never counts nor evicts them (its usage and LRU start empty), so the init step caps them:
    the share above the eviction watermark, and the directory stays near its budget (tracked files ≈ watermark)."""
    return round(disk_bytes * (1 - L2_EVICTION["trigger_watermark"]))


def offload_active(vllm: Any, server: Any) -> bool:
    """lmcache-server: vLLM consulted its connector, and the server is healthy with an engine registered."""
    return (vllm is not None and server is not None and server.healthy and server.engines > 0
            and (vllm.external_queries or 0) > 0)


class LMCacheServer(Backend):
    name = "lmcache-server"
    summary = ("an LMCache server in a sidecar container of the serving pod (vLLM's LMCacheMPConnector over ZMQ on "
               "127.0.0.1); its L1 survives vLLM container restarts, its disk tier a replaced pod on the same node "
               "while the disk fingerprint holds. With spec.offload.server PerNode, one server pod per node instead, "
               "shared by the resource's replicas there.")
    # vLLM 0.26.0 registers LMCacheMPConnector; LMCache 0.5.3 ships `lmcache server` and the engine-driven
    # shared-memory transfer (checked in the installed sources of that pair; older pairs were not checked).
    min_vllm, min_lmcache = (0, 26, 0), (0, 5, 3)
    refuses = {"offload.cpu.evictionPolicy": Refusal("the only policy the LMCache server offers", allowed=("LRU",))}
    sources = (VLLM, SERVER_STATUS)
    # KV events: the GPU tier's only. LMCache 0.5.3's LMCacheMPConnector publishes none; 0.5.6's publishes the
    # server's CPU stores and evictions in whole LMCache chunks (block_size = chunkSize), and vllm-router 0.1.17
    # admits only events in the engine's 16-token blocks.
    proof = ("the LMCache server's /status is healthy and lists at least one registered engine "
             "(vLLM's workers registered their KV caches with it over ZMQ)")
    reasons = Reasons(
        "LMCacheMPConnector to the pod's LMCache server", "LMCacheServerConnected", "NoOffloadActivity",
        "vLLM registered with the LMCache server and asks it for prompt tokens",
        "vLLM has not asked the LMCache server for prompt tokens yet, or no vLLM worker registered with it "
        "(kvoffload_lmcache_server_engines is 0)")

    def cpu_tier(self, s: Sizing) -> MemoryTerm:
        if s.shared:
            return MemoryTerm("cpu_tier", 0, "none here: the L1 is held by the node's shared LMCache server pod "
                                             "(spec.offload.server PerNode), whose limit holds it")
        return MemoryTerm("cpu_tier", s.cpu_size,
                          "LMCache server's L1, a /dev/shm segment shared with the server: charged to whichever "
                          f"container faults it in first (the server when it sees a GPU, else the {s.tp} vLLM "
                          "worker(s) that pin it), so both limits hold it; requested here only")

    def vllm_limit_only(self, s: Sizing) -> MemoryTerm | None:
        if not s.shared:
            return None
        # Not measured between pods: a server that sees no GPU leaves the L1 untouched, and the vLLM workers that map
        # and pin it are charged (docs/backends.md, "Memory"). The node's server requests the L1; every replica's
        # limit holds it too, so neither is OOM-killed for pages it faulted (the segment's pages exist once).
        return MemoryTerm("l1_limit_only", s.cpu_size,
                          "the node server's L1 segment, in the limit only: charged here if this pod's workers fault "
                          "it in first (a server that sees no GPU touches none of it); the server pod requests it")

    def shm_extra(self, s: Sizing) -> int:
        # The L1 segment lives there; LMCache falls back to slow pickling if it does not fit. PerNode: it lives in the
        # resource's directory on the admin's tmpfs, which the pod's /dev/shm is.
        return 0 if s.shared else s.cpu_size

    def sidecar_memory(self, s: Sizing) -> tuple[list[MemoryTerm], MemoryTerm | None]:
        if s.shared:
            # Its own pod: request = limit. It faults the L1 in itself when it sees a GPU; when it does not, vLLM's
            # workers do (charged to them: docs/backends.md, "Memory"), which is not measured across pods yet.
            return [MemoryTerm("server_baseline", s.server_baseline, "LMCache server process (ZMQ + HTTP, torch)"),
                    MemoryTerm("l1", s.cpu_size, "the L1, a /dev/shm segment pinned in full at start-up, once per "
                                                 "node for every replica of this resource there")], None
        # The request is the server process; the limit adds the L1, which it faults in itself when it sees a GPU.
        l1 = MemoryTerm("l1_limit_only", s.cpu_size,
                        "the L1 segment, in the limit only: LMCache's alloc_shm_pinned_ptr writes every page and pins "
                        "it when the server sees a GPU, charging it here; the pod's requests count it once, in the "
                        "vLLM container")
        return [MemoryTerm("server_baseline", s.server_baseline, "LMCache server process (ZMQ + HTTP, torch)")], l1

    def vllm_args(self, spec: Spec, budget: BudgetView) -> list[str]:
        if spec.offload.shared:
            return ["--kv-transfer-config", kv_transfer_config(f"tcp://{spec.offload.shared_address}",
                                                              {"lmcache.mp.mq_timeout": SHARED_MQ_TIMEOUT_S})]
        return ["--kv-transfer-config", MP_KV_TRANSFER_CONFIG]

    def sidecars(self, spec: Spec, budget: BudgetView, pod: Sidecar) -> list[dict[str, Any]]:
        """The LMCache server as a native sidecar (an init container that keeps running): it starts, and
        must answer /healthcheck, before vLLM starts, and it outlives vLLM container restarts, so the
        L1 in the pod's /dev/shm and the L2 directory stay warm. It needs no GPU (engine-driven transfer).
        PerNode: none; the node's server pod runs server_container (rendering/shared_cache.py)."""
        return [] if spec.offload.shared else [server_container(spec, budget, pod)]

    def shared_server(self, spec: Spec, budget: BudgetView, pod: Sidecar) -> list[dict[str, Any]]:
        return [server_container(spec, budget, pod, sidecar=False)]

    def disk_reuse(self, spec: Spec, budget: BudgetView) -> DiskReuse | None:
        # The server's fs_native L2 finds a chunk by its file's name, so a new server reads what an earlier one wrote.
        return DiskReuse(layout=L2_LAYOUT, keep_bytes=kept_bytes(budget.tier("disk").bytes))

    def exporter_args(self, spec: Spec, budget: BudgetView) -> list[str]:
        # PerNode: the node's server through the resource's node-local Service (its NetworkPolicy admits this pod).
        host = spec.offload.shared_address if spec.offload.shared else "127.0.0.1"
        args = ["--backend", self.name, "--cpu-capacity-bytes", str(budget.tier("cpu").bytes),
                "--lmcache-server-url", f"http://{host}:{SERVER_HTTP_PORT}/status"]
        if spec.offload.shared:
            # The figures are the node's server's, which every replica there reads: the exporter labels them with the
            # node (NODE_NAME: the pod's spec.nodeName, from the downward API) as tier="shared".
            args += ["--shared-node", f"$({NODE_NAME_ENV})"]
        if spec.offload.disk:
            args += ["--disk-capacity-bytes", str(budget.tier("disk").bytes)]
        return args

    def offload_active(self, seen: Seen) -> bool:
        return offload_active(seen.vllm, seen.server)


def server_container(spec: Spec, budget: BudgetView, pod: Sidecar, *, sidecar: bool = True) -> dict[str, Any]:
    """The `lmcache server` container: the serving pod's native sidecar (an init container that keeps running), or
    the shared server pod's one container (PerNode)."""
    # Sidecar: request the server process; limit + the L1, which the server faults in itself when it sees a GPU
    # (LMCache's alloc_shm_pinned_ptr); the vLLM container requests it, so the pod counts it once. PerNode: both hold
    # the L1 (Budget: request = limit).
    request, limit = format_bytes(budget.server_memory), format_bytes(budget.server_memory_limit)
    health = ("import urllib.request; urllib.request.urlopen("
              f"'http://127.0.0.1:{SERVER_HTTP_PORT}/healthcheck', timeout=4)")
    exec_probe = {"exec": {"command": ["python3", "-c", health]}, "timeoutSeconds": 5}
    mounts = [pod.shm_mount or {"name": "dshm", "mountPath": "/dev/shm"}, pod.tmp_mount,
              *([pod.disk_mount] if pod.disk_mount else [])]
    return {
        "name": "lmcache-server",
        "image": pod.image,
        **({"restartPolicy": "Always"} if sidecar else {}),
        "command": list(SERVER_COMMAND),
        "args": server_args(spec, budget),
        # LMCache 0.5.3's token hasher is a numba function with cache=True: numba needs a writable cache
        # directory, and UID 1000 can write neither site-packages nor a HOME (none is set here). Seen on a
        # GPU host: "cannot cache function 'rolling_hash_windows_numba': no locator available", exit 1.
        # The root file system is read-only: the cache goes to the pod's /tmp (pod.tmp_mount).
        "env": [*pod.env, {"name": "NUMBA_CACHE_DIR", "value": "/tmp/numba-cache"}],
        "resources": {"requests": {"cpu": "1", "memory": request}, "limits": {"memory": limit}},
        "volumeMounts": mounts,
        # Importing LMCache takes seconds to tens of seconds; vLLM starts once this passes.
        "startupProbe": {**exec_probe, "periodSeconds": 5, "failureThreshold": 60},
        "livenessProbe": {**exec_probe, "periodSeconds": 10, "failureThreshold": 6},
        "securityContext": pod.security_context,
    }


BACKEND = LMCacheServer()
