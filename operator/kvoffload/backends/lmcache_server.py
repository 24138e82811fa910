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

SERVER_SHM_NAME = "lmcache_l1_pool_kvoffload"  # one server per pod, so one name: the pod's own /dev/shm
SERVER_TRANSFER_MODE = "engine_driven"  # the server has no GPU: vLLM's workers copy KV into its /dev/shm L1
MP_KV_TRANSFER_CONFIG = json.dumps({
    "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": SERVER_ZMQ_PORT,
                                  "lmcache.mp.mp_transfer_mode": SERVER_TRANSFER_MODE}}, separators=(",", ":"))


def server_args(spec: Spec, budget: BudgetView) -> list[str]:
    """`lmcache server` flags (LMCache 0.5.3's own parser, checked in the fidelity tests): the whole
    replica's L1 (one server serves every TP rank), LRU, and the disk tier as an `fs_native` L2 adapter
    whose max_capacity_gb caps it (the plain `fs` adapter has no capacity limit), writing with O_DIRECT. The L1 is eager
    (--no-l1-use-lazy) so that vLLM's workers and the server share it through /dev/shm."""
    args = ["--host", "127.0.0.1", "--port", str(SERVER_ZMQ_PORT),
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
            "--http-host", "127.0.0.1", "--http-port", str(SERVER_HTTP_PORT),
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
               "while the disk fingerprint holds.")
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
        return MemoryTerm("cpu_tier", s.cpu_size,
                          "LMCache server's L1, a /dev/shm segment shared with the server: charged to whichever "
                          f"container faults it in first (the server when it sees a GPU, else the {s.tp} vLLM "
                          "worker(s) that pin it), so both limits hold it; requested here only")

    def shm_extra(self, s: Sizing) -> int:
        return s.cpu_size  # the L1 segment lives there; LMCache falls back to slow pickling if it does not fit

    def sidecar_memory(self, s: Sizing) -> tuple[list[MemoryTerm], MemoryTerm | None]:
        # The request is the server process; the limit adds the L1, which it faults in itself when it sees a GPU.
        l1 = MemoryTerm("l1_limit_only", s.cpu_size,
                        "the L1 segment, in the limit only: LMCache's alloc_shm_pinned_ptr writes every page and pins "
                        "it when the server sees a GPU, charging it here; the pod's requests count it once, in the "
                        "vLLM container")
        return [MemoryTerm("server_baseline", s.server_baseline, "LMCache server process (ZMQ + HTTP, torch)")], l1

    def vllm_args(self, spec: Spec, budget: BudgetView) -> list[str]:
        return ["--kv-transfer-config", MP_KV_TRANSFER_CONFIG]

    def sidecars(self, spec: Spec, budget: BudgetView, pod: Sidecar) -> list[dict[str, Any]]:
        """The LMCache server as a native sidecar (an init container that keeps running): it starts, and
        must answer /healthcheck, before vLLM starts, and it outlives vLLM container restarts, so the
        L1 in the pod's /dev/shm and the L2 directory stay warm. It needs no GPU (engine-driven transfer)."""
        # Request: the server process. Limit: + the L1, which the server faults in itself when it sees a
        # GPU (LMCache's alloc_shm_pinned_ptr); the vLLM container requests it, so the pod counts it once.
        request, limit = format_bytes(budget.server_memory), format_bytes(budget.server_memory_limit)
        health = ("import urllib.request; urllib.request.urlopen("
                  f"'http://127.0.0.1:{SERVER_HTTP_PORT}/healthcheck', timeout=4)")
        exec_probe = {"exec": {"command": ["python3", "-c", health]}, "timeoutSeconds": 5}
        mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, pod.tmp_mount,
                  *([pod.disk_mount] if pod.disk_mount else [])]
        return [{
            "name": "lmcache-server",
            "image": pod.image,
            "restartPolicy": "Always",
            "command": ["lmcache", "server"],
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
        }]

    def disk_reuse(self, spec: Spec, budget: BudgetView) -> DiskReuse | None:
        # The server's fs_native L2 finds a chunk by its file's name, so a new server reads what an earlier one wrote.
        return DiskReuse(layout=L2_LAYOUT, keep_bytes=kept_bytes(budget.tier("disk").bytes))

    def exporter_args(self, spec: Spec, budget: BudgetView) -> list[str]:
        args = ["--backend", self.name, "--cpu-capacity-bytes", str(budget.tier("cpu").bytes),
                "--lmcache-server-url", f"http://127.0.0.1:{SERVER_HTTP_PORT}/status"]
        if spec.offload.disk:
            args += ["--disk-capacity-bytes", str(budget.tier("disk").bytes)]
        return args

    def offload_active(self, seen: Seen) -> bool:
        return offload_active(seen.vllm, seen.server)


BACKEND = LMCacheServer()
