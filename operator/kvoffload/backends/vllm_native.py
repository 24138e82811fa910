"""Backend vllm-native: vLLM's own CPU offloading (--kv-offloading-backend native, the
OffloadingConnector), no LMCache, CPU tier only.

Memory: the CPU tier is torch pinned memory of each vLLM worker (--kv-offloading-size is the total
over TP ranks), stored in whole vLLM KV blocks (16 tokens), no staging buffers, no disk tier. vLLM
0.26.0 (CPUOffloadingSpec / CPUOffloadingWorker) pins one tensor per KV-cache tensor (one per
attention layer) of num_blocks × page bytes, num_blocks = cpu_bytes // (tp × per-worker KV bytes of
one block over all layers), and torch's CachingHostAllocator rounds every pinned allocation up to a
power of two: the cpu_tier term charges what is pinned (native_pinned), e.g. 64 GiB for a 40 GiB
tier of a 32-layer model (1.25 GiB tensors → 2 GiB). vLLM 0.33.0 keeps the tier in one /dev/shm region
instead (SHARED_REGION_FROM): the tier's size, in the pod's /dev/shm volume. Models with both
sliding-window and full layers keep vLLM's hybrid KV cache manager with this connector (it supports
HMA), which shares tensors between layer groups; their tensor count is not modelled, so they are
charged the bound: 2 × the tier (a power-of-two ceiling is < 2 × its argument)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..api.quantity import gib, human
from ..api.rules import SIDECAR
from ..engine import flags
from .base import VLLM, VLLM_OFFLOAD, Backend, BudgetView, MemoryTerm, ModelShape, Reasons, Refusal, Seen, Sizing

if TYPE_CHECKING:
    from ..api.spec import Spec

NATIVE_BLOCK_TOKENS = flags.BLOCK_TOKENS  # vLLM's CUDA KV block size: the unit vllm-native offloads


def native_offloading_size_gib(size: int) -> float:
    """The rendered --kv-offloading-size: GiB over all TP ranks, 6 decimals."""
    return round(gib(size), 6)


def native_cpu_bytes(size: int) -> int:
    """vLLM's cpu_bytes_to_use for that flag (VllmConfig: kv_offloading_size × 2**30, then int)."""
    return int(native_offloading_size_gib(size) * (1 << 30))


def power_of_two_ceil(n: int) -> int:
    """c10::llvm::PowerOf2Ceil: torch's CachingHostAllocator rounds every pinned allocation to it."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class NativePinned:
    """What vLLM 0.26.0's CPUOffloadingWorker pins for --kv-offloading-size."""
    tensors: int  # pinned CPU tensors per worker: one per KV-cache tensor (per attention layer)
    num_blocks: int  # CPUOffloadingSpec.num_blocks: 16-token blocks each tensor holds
    tensor_bytes: int  # num_blocks × one layer's block page: what vLLM asks torch for
    allocated_bytes: int  # the same rounded up to a power of two: what torch pins
    per_worker: int
    total: int  # per_worker × tp
    exact: bool  # False: a hybrid (sliding + full layers) model, charged the 2 × tier bound


def native_pinned(model: ModelShape, tp: int, size: int, per_gpu_bpt: int) -> NativePinned:
    """vLLM: num_blocks = cpu_bytes // (tp × per-worker KV bytes of one block, all layers)
    (vllm/v1/kv_offload/cpu/spec.py, blocks_per_chunk 1: the operator sets no block_size), then each
    worker pins torch.zeros((num_blocks, page), pin_memory=True) per KV-cache tensor
    (vllm/v1/kv_offload/cpu/gpu_worker.py), which torch rounds up to a power of two."""
    if not size:
        return NativePinned(model.layers, 0, 0, 0, 0, 0, True)
    page = per_gpu_bpt // model.layers * NATIVE_BLOCK_TOKENS  # K and V of one layer, one block, one worker
    num_blocks = native_cpu_bytes(size) // (page * model.layers * tp)
    tensor = num_blocks * page
    allocated = power_of_two_ceil(tensor)
    exact = not (model.sliding_window and model.sliding_window_layers and model.full_layers)
    per_worker = allocated * model.layers if exact else 2 * -(-native_cpu_bytes(size) // tp)
    return NativePinned(model.layers, num_blocks, tensor, allocated, per_worker, per_worker * tp, exact)


# From vLLM 0.33.0 on (the offered pair after 0.26.0), CPUOffloadingSpec keeps the whole tier in one mmap'd
# /dev/shm region (SharedOffloadRegion, vllm/v1/kv_offload/cpu/spec.py create_worker) of num_chunks page-aligned
# chunks, and refuses to start when /dev/shm has less free space ("Insufficient space in /dev/shm for CPU KV
# offload shared region": H200, 3 Dec 2026, with the 2 GiB NCCL share). The pod's /dev/shm must hold it.
SHARED_REGION_FROM = (0, 33, 0)
PAGE = 4096  # mmap.PAGESIZE on x86_64: SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT


def shared_region_bytes(s: Sizing) -> int:
    """vLLM >= 0.33.0: num_chunks × the chunk (every rank's copy of one 16-token block, all layers) rounded up
    to a page, num_chunks = cpu_bytes // that (CPUOffloadingSpec.__init__, blocks_per_chunk 1)."""
    chunk = -(-s.kv_bytes_per_token_per_gpu * NATIVE_BLOCK_TOKENS * s.tp // PAGE) * PAGE
    return native_cpu_bytes(s.cpu_size) // chunk * chunk


def _shared(s: Sizing) -> bool:
    return s.vllm >= SHARED_REGION_FROM and s.cpu_size > 0


def _pinned(s: Sizing) -> NativePinned:
    return native_pinned(s.model, s.tp, s.cpu_size, s.kv_bytes_per_token_per_gpu)


def offload_active(vllm: Any) -> bool:
    """vllm-native: vLLM consulted its connector, and that connector is the OffloadingConnector."""
    return vllm is not None and vllm.offload_store_bytes is not None and (vllm.external_queries or 0) > 0


class VllmNative(Backend):
    name = "vllm-native"
    summary = "vLLM's own CPU offloading (--kv-offloading-backend native), no LMCache, CPU tier only."
    # vLLM 0.26.0 registers OffloadingConnector and has --kv-offloading-backend native|lmcache.
    min_vllm, min_lmcache = (0, 26, 0), None
    refuses = {
        "offload.disk": Refusal("vLLM's native offloading has a CPU tier only"),
        "offload.cpu.evictionPolicy": Refusal("the only policy vLLM's native offloading offers", allowed=("LRU",)),
        "offload.chunkSize": Refusal("it offloads whole 16-token vLLM KV blocks, not LMCache chunks"),
        "resources.stagingPerWorker": Refusal("vLLM copies between its GPU and pinned CPU blocks directly, without "
                                              "staging buffers"),
        "resources.serverBaseline": Refusal("there is no LMCache server"),
        "offload.server": Refusal("there is no LMCache server to share", allowed=(SIDECAR,)),
    }
    stages = False
    sources = (VLLM, VLLM_OFFLOAD)
    # The OffloadingConnector publishes its CPU tier's BlockStored / BlockRemoved (medium CPU) when asked for
    # self-describing events (vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py, 0.26.0 and 0.33.0).
    event_tiers = ("gpu", "cpu")
    proof = ("vLLM's native offload counters are on its page (vllm:kv_offload_store_bytes_total: "
             "the OffloadingConnector is the one configured)")
    reasons = Reasons(
        "vLLM native OffloadingConnector", "NativeOffloadActive", "NoOffloadActivity",
        "vLLM asks its native offloading for prompt tokens and its vllm:kv_offload_* counters are present",
        "vLLM has not asked its native offloading for prompt tokens yet (vllm:external_prefix_cache_queries_total "
        "is 0) or its vllm:kv_offload_* counters are absent")

    def unit(self, s: Sizing) -> int:
        return NATIVE_BLOCK_TOKENS

    def cpu_tier(self, s: Sizing) -> MemoryTerm:
        if _shared(s):
            return MemoryTerm("cpu_tier", shared_region_bytes(s),
                              f"vLLM native CPU tier (OffloadingConnector): one /dev/shm region of {human(s.cpu_size)} "
                              "in page-aligned 16-token blocks, charged to the vLLM container")
        p = _pinned(s)
        if not p.exact:
            note = (f"vLLM native CPU tier (OffloadingConnector): {human(p.total)}, the bound for a "
                    f"{human(s.cpu_size)} tier: "
                    "vLLM's hybrid KV cache manager shares pinned tensors between sliding-window and full layers, each "
                    "rounded up to a power of two by torch's pinned allocator, so at most 2 × the tier")
        else:
            note = (f"vLLM native CPU tier (OffloadingConnector): {s.tp} worker(s) × {p.tensors} per-layer pinned "
                    f"tensors of {human(p.tensor_bytes)}, each rounded up to {human(p.allocated_bytes)} by torch's "
                    f"pinned allocator: {human(p.total)} pinned for a {human(s.cpu_size)} tier")
        return MemoryTerm("cpu_tier", p.total, note)

    def warnings(self, s: Sizing) -> list[str]:
        """When vLLM pins noticeably more than the tier, with the nearest sizes that do not."""
        p = _pinned(s)
        if _shared(s) or not p.total > s.cpu_size * 1.05:
            return []
        if not p.exact:
            return [f"{{cpu_size}} {human(s.cpu_size)} with {{backend}} vllm-native: this model's hybrid layers make "
                    f"vLLM's pinned tensor sizes unmodelled, so the pod is charged the {human(p.total)} bound "
                    "(2 × the tier)"]
        low, high = p.tensors * s.tp * (p.allocated_bytes // 2), p.tensors * s.tp * p.allocated_bytes
        return [f"{{cpu_size}} {human(s.cpu_size)} with {{backend}} vllm-native pins {human(p.total)}: each worker's "
                f"{p.tensors} per-layer tensors of {human(p.tensor_bytes)} round up to a power of two "
                f"({human(p.allocated_bytes)}); a {human(low)} or {human(high)} tier pins no more than its size "
                "for this model"]

    def shm_extra(self, s: Sizing) -> int:
        return shared_region_bytes(s) if _shared(s) else 0

    def vllm_args(self, spec: Spec, budget: BudgetView) -> list[str]:
        # GiB over all TP ranks (vLLM's CacheConfig.kv_offloading_size): OffloadingConnector, CPU tier only.
        size = native_offloading_size_gib(budget.tier("cpu").bytes)
        return ["--kv-offloading-backend", "native", "--kv-offloading-size", repr(size)]

    def kv_events_args(self, spec: Spec, budget: BudgetView) -> list[str]:
        # Only the extra config: vLLM fills in the connector, its role and cpu_bytes_to_use from the flags above
        # (VllmConfig._post_init_kv_transfer_config updates kv_connector_extra_config, it does not replace it).
        return ["--kv-transfer-config", '{"kv_connector_extra_config":{"self_describing_kv_events":true}}']

    def exporter_args(self, spec: Spec, budget: BudgetView) -> list[str]:
        return ["--backend", self.name, "--cpu-capacity-bytes", str(budget.tier("cpu").bytes)]

    def offload_active(self, seen: Seen) -> bool:
        return offload_active(seen.vllm)


BACKEND = VllmNative()
