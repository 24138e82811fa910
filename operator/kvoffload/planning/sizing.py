"""KV-cache sizing: bytes per token, tokens per tier, pod memory and reload-vs-recompute. Pure.

Conventions
- Every size in this API is a PER-REPLICA total in bytes (a replica is one vLLM engine: one pod
  with `tp` GPUs). A worker is one TP rank; its share is total // tp, which is what LMCache's
  `max_local_cpu_size` / `max_local_disk_size` want (as GiB floats: quantity.gib).
- KV bytes per token = 2 (K and V) × layers × kv_heads × head_dim × bytes per element. Each GPU
  holds max(1, kv_heads / tp) heads: when tp > kv_heads vLLM replicates heads, so a replica
  holds per-GPU bytes × tp per token, more than the model's own figure, in every tier.
- GPU tier: per GPU, gpu_memory × utilization − weights / tp − activation_reserve holds KV.
  Every GPU holds its head slice of every token, so the replica holds as many tokens as one
  GPU does (never × tp).
- Sliding-window layers (Gemma-2 every other layer, Mistral v0.1 every layer) need at most
  `window` tokens per sequence, but only while vLLM's hybrid KV cache manager is on. vLLM turns
  it off whenever `--kv-transfer-config` is set, i.e. whenever an offload tier is on, and then
  sizes windowed layers like full ones. So: no offload tier → windowed layers hold
  min(window, max_model_len) tokens per sequence; any offload tier → full length. LMCache tiers
  are assumed to store every layer of every token it saves (the engine hands it full-length
  KV), so they use the full per-token figure. For windowed models GPU "tokens" are the tokens
  in flight when every sequence is max_model_len long.
- LMCache stores whole chunks of chunk_size tokens per worker: offload-tier tokens are rounded
  down to whole chunks, and sequences = tokens // max_model_len in every tier.
- Pod memory: request = limit (pinned memory can never be reclaimed) = engine baseline
  + per-worker overhead × tp + CPU tier (pinned in full at start-up, all ranks; vllm-native: what
  vLLM really pins, below) + staging
  buffers × tp (only with an offload tier) + /dev/shm (memory-backed, charged to the pod)
  + headroom, rounded up to whole MiB.
- Backends (spec.offload.backend; docs/backends.md): each backend module (backends/) gives its own
  terms: the CPU tier's (what it really pins), whether it stages, what it adds to /dev/shm and its
  sidecar's request and limit; this module sums them. lmcache: the terms above. vllm-native: what
  vLLM's pinned allocator really takes, in 16-token blocks, no staging (backends/vllm_native.py).
  lmcache-server: the L1 is a /dev/shm segment in both containers' limits, requested once
  (backends/lmcache_server.py).
- Reload vs recompute for one max_model_len prefix: the CPU tier reloads each rank's slice over
  that rank's own host link in parallel (bytes / tp / cpu_read); the disk tier is one node-local
  device shared by all ranks (bytes / disk_read); recompute = tokens / prefill rate. Measured
  figures: /work/shared/reference/h200-tier-physics.json.
- Local storage (ephemeral-storage request, counted by the scheduler and kubelet's eviction):
  weights (params × dtype bytes × 1.1 + 2 GiB for tokenizer, config and download bookkeeping,
  rounded up to GiB) on a pod volume unless a PVC holds them, the engine's compile caches
  (torch.compile, Triton, FlashInfer: 10 GiB) and /tmp (2 GiB).
- Start-up budget: downloading the weights at an assumed 50 MB/s (400 Mbit/s, a conservative
  Hugging Face Hub rate) + reading them at the measured 0.94 GB/s disk rate + twice the slowest
  engine start measured for that vLLM (torch.compile, CUDA graph capture, tiers pinned: 347 s for
  0.26.0, 311 s for 0.33.0), rounded up to the probe period. A PVC that holds the
  weights still gets the download term: it may be cold.
- Vocabulary: errors are InputErrors keyed by PlanInput's own names (`tp`, `cpu_size`), and
  messages and warnings name other inputs as `{key}`. The operator maps keys to CRD paths
  (spec.PLAN_FIELDS), `kvoffload plan` to its options (OPTION_FOR_INPUT).
- After planning, Budget is the one source of every size: render, status and conditions read it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import backends
from ..api.crd import schema_at
from ..api.errors import InputError, name_inputs
from ..api.quantity import GiB, MiB, human, to_bytes
from ..api.settings import Settings
from ..backends.base import MemoryTerm, Sizing
from ..engine import images
from .catalog import ModelArch

# The defaults are the operator's settings (api/settings.py, the one table the chart's values mirror).
_DEFAULTS = Settings()
# h200-tier-physics.json: pinned host→GPU copy and disk read.
H2D_PINNED_BPS = _DEFAULTS.cpu_read_gbps * 1e9
DISK_READ_BPS = _DEFAULTS.disk_read_gbps * 1e9
# vLLM's own cold prefill of a 32,768-token prompt, Llama-3.1-8B on one H200, no KV connector (docs/benchmarks.md
# "GPU"), per vLLM version: 0.26.0 the median of its five runs (1.100, 1.114, 1.121, 1.220, 1.229 s), 0.33.0 its one
# (1.169 s). A version between or past them takes the newest measured one at or below it, an older one the oldest.
# (h200-tier-physics.json's 1.3815 s was transformers' sdpa prefill, not vLLM's: 18 % slower than vLLM 0.26.0.)
MEASURED_PREFILL_TOKENS = 32768
MEASURED_PREFILL_S: dict[tuple[int, ...], float] = {(0, 26, 0): 1.121, (0, 33, 0): 1.169}
MEASURED_PARAMS = 8_030_261_248  # the Llama-3.1-8B shape that was measured

# Assumed weight download rate (bytes/s): 400 Mbit/s, a conservative Hugging Face Hub rate.
WEIGHT_DOWNLOAD_BPS = 50e6
# vLLM's start before /health answers, beyond fetching and reading the weights (torch.compile, CUDA graph capture,
# the KV connector and a 40 GiB CPU tier pinned), per vLLM version: the slowest of the runs on one H200 with dummy
# weights (docs/benchmarks.md "Engine start-up"; 0.26.0 over 20 runs, 0.33.0 over 10, the slowest with an empty
# compile cache and the LMCache server's 40 s before vLLM), times ENGINE_START_MARGIN for slower GPUs and CPUs, larger
# tiers to pin and a busy node. The start-up probe kills a pod that outlasts it, so it errs long. Looked up like
# MEASURED_PREFILL_S. (It was a flat 600 s before anything was measured.)
MEASURED_ENGINE_START_S: dict[tuple[int, ...], float] = {(0, 26, 0): 173.4, (0, 33, 0): 155.2}
ENGINE_START_MARGIN = 2

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
KV_DTYPES = ("auto", *DTYPE_BYTES)

@dataclass(frozen=True)
class MemoryDefaults:
    """Every pod-memory term, overridable; the defaults are the operator's settings."""
    # vLLM API server + engine core process
    engine_baseline: int = to_bytes(_DEFAULTS.engine_baseline, "engineBaseline")
    # each TP worker: torch/CUDA runtime
    per_worker_overhead: int = to_bytes(_DEFAULTS.per_worker_overhead, "perWorkerOverhead")
    # pinned GPU<->CPU<->disk staging
    staging_per_worker: int = to_bytes(_DEFAULTS.staging_per_worker, "stagingPerWorker")
    # LMCache server (lmcache-server), before its L1
    server_baseline: int = to_bytes(_DEFAULTS.server_baseline, "serverBaseline")
    shm: int | None = None  # /dev/shm; None = 1Gi + 1Gi per TP rank
    headroom_percent: int = _DEFAULTS.headroom_percent  # of the sum above, at least headroom_min
    headroom_min: int = 1 * GiB


@dataclass(frozen=True)
class StorageDefaults:
    """Pod-local disk terms (the ephemeral-storage request), overridable."""
    weights_percent: int = 10  # headroom on the weight bytes
    weights_extra: int = 2 * GiB  # tokenizer, config, download bookkeeping
    compile_cache: int = 10 * GiB  # HOME: vLLM/torch.compile, Triton and FlashInfer caches
    tmp: int = 2 * GiB


@dataclass(frozen=True)
class Bandwidths:
    """Bytes/s. Defaults: the operator's settings (one H200 host, h200-tier-physics.json). Each `*_from` says where
    the figure came from (an option, a spec field, an operator setting), for status and `kvoffload plan`."""
    cpu_read: float = H2D_PINNED_BPS
    disk_read: float = DISK_READ_BPS
    # None = derive: vLLM's measured 32K prefill of an 8B on one H200 (MEASURED_PREFILL_S) scaled by 8B/params × TP
    prefill_tokens_per_s: float | None = _DEFAULTS.prefill_tokens_per_second or None
    weight_download: float = WEIGHT_DOWNLOAD_BPS
    weight_load: float = DISK_READ_BPS
    cpu_read_from: str = "operator setting cpuReadGbps"
    disk_read_from: str = "operator setting diskReadGbps"
    prefill_from: str = "operator setting prefillTokensPerSecond"


@dataclass(frozen=True)
class PlanInput:
    model: ModelArch
    max_model_len: int
    # max concurrent sequences (vLLM --max-num-seqs); the default is the CRD's, declared once in crd.py
    concurrency: int = schema_at("engine.maxNumSeqs")["default"]
    gpu_memory: int = 80 * GiB  # per GPU, bytes
    gpus: int | None = None  # GPUs per replica; None = tp
    tp: int = 1
    gpu_memory_utilization: float = 0.9
    weight_dtype: str = "bf16"  # bf16|fp16|fp8
    kv_dtype: str = "auto"  # auto (= weight dtype)|bf16|fp16|fp8
    cpu_size: int = 0  # bytes per replica
    disk_size: int = 0  # bytes per replica
    chunk_size: int = 256  # LMCache chunk_size, tokens
    backend: str = backends.DEFAULT  # spec.offload.backend: a name in backends.REGISTRY
    vllm_version: str = images.DEFAULT_PAIR.vllm  # the image's vLLM (spec.engine.vllmVersion)
    # spec.offload.server PerNode: the LMCache server is its own pod per node, shared by the replicas there
    shared: bool = False
    activation_reserve: int = 2 * GiB  # per GPU: activations, CUDA context, graphs
    memory: MemoryDefaults = field(default_factory=MemoryDefaults)
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    weights_on_pvc: bool = False  # a PersistentVolumeClaim holds the weights (spec.model.cache): no pod volume for them
    storage: StorageDefaults = field(default_factory=StorageDefaults)


@dataclass(frozen=True)
class TierBudget:
    name: str  # gpu | cpu | disk
    bytes: int  # per replica
    bytes_per_worker: int
    tokens: int
    sequences: int  # full max_model_len sequences


@dataclass(frozen=True)
class Term:
    """A named figure with its reason (storage bytes, start-up seconds)."""
    name: str
    value: int
    note: str


@dataclass(frozen=True)
class WeightBudget:
    bytes: int  # params × dtype bytes
    volume: int  # size of the pod volume that holds them; 0 when a PVC does
    storage_terms: tuple[Term, ...]  # bytes: weights, compile_cache, tmp
    ephemeral_storage: int  # the vLLM container's ephemeral-storage request: sum of storage_terms
    startup_terms: tuple[Term, ...]  # seconds: download, load, engine
    startup_seconds: int  # the start-up probe's budget

    def storage(self, name: str) -> int:
        return next(t.value for t in self.storage_terms if t.name == name)


@dataclass(frozen=True)
class ReloadEstimate:
    tier: str
    tokens: int
    bytes: int
    reload_s: float
    recompute_s: float
    slower_than_recompute: bool
    read_bytes_per_s: float = 0.0  # the bandwidth that decided it ...
    read_from: str = ""  # ... and where that figure came from
    prefill_tokens_per_s: float = 0.0
    prefill_from: str = ""


@dataclass(frozen=True)
class Budget:
    backend: str
    kv_bytes_per_token: int  # per replica, all layers, all KV heads held (replicas included)
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_sequence: int  # one max_model_len request on the GPU (window rule applied)
    tiers: tuple[TierBudget, ...]  # gpu, cpu, disk (zeros when off)
    memory_terms: tuple[MemoryTerm, ...]
    memory_request: int  # of the vLLM container
    memory_limit: int  # = the request, + a term some backends keep in the limit only (Backend.vllm_limit_only)
    server_memory_terms: tuple[MemoryTerm, ...]  # the LMCache server container; () without one
    server_memory: int  # its request; 0 without one
    server_memory_limit: int  # its limit: the request + the L1 (see lmcache-server above); 0 without one
    shm: int  # the memory-backed /dev/shm volume, shared by the pod's containers
    reload: tuple[ReloadEstimate, ...]  # per offload tier that is on
    warnings: tuple[str, ...]
    weights: WeightBudget
    # spec.offload.server PerNode: the server_memory figures are the node's shared server pod's (request = limit),
    # the cpu and disk tiers its L1 and L2, held once per node that runs replicas, not per replica.
    shared: bool = False

    def named(self, names: Mapping[str, str]) -> Budget:
        """This budget with its warnings in the caller's vocabulary (see InputError.named)."""
        return dataclasses.replace(self, warnings=tuple(name_inputs(w, names) for w in self.warnings))

    def tier(self, name: str) -> TierBudget:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able status form: camelCase, integer bytes, floats to 4 decimals."""
        out = {
            "backend": self.backend,
            "kvBytesPerToken": self.kv_bytes_per_token,
            "kvBytesPerTokenPerGpu": self.kv_bytes_per_token_per_gpu,
            "kvBytesPerSequence": self.kv_bytes_per_sequence,
            "tiers": [{"name": t.name, "bytes": t.bytes, "bytesPerWorker": t.bytes_per_worker,
                       "tokens": t.tokens, "sequences": t.sequences} for t in self.tiers],
            "memory": {"request": self.memory_request, "limit": self.memory_limit,
                       "terms": [{"name": m.name, "bytes": m.bytes, "note": m.note} for m in self.memory_terms]},
            "shm": self.shm,
            "reload": [{"tier": r.tier, "tokens": r.tokens, "bytes": r.bytes,
                        "reloadSeconds": round(r.reload_s, 4), "recomputeSeconds": round(r.recompute_s, 4),
                        "slowerThanRecompute": r.slower_than_recompute} for r in self.reload],
            # The figures that decided each verdict, and where each came from (an option, a spec field, a setting).
            "reloadFigures": [{"tier": r.tier, "readBytesPerSecond": round(r.read_bytes_per_s, 4),
                               "readFrom": r.read_from,
                               "prefillTokensPerSecond": round(r.prefill_tokens_per_s, 4),
                               "prefillFrom": r.prefill_from}
                              for r in self.reload],
            "weights": {"bytes": self.weights.bytes, "volume": self.weights.volume,
                        "ephemeralStorage": self.weights.ephemeral_storage,
                        "storageTerms": [{"name": t.name, "bytes": t.value, "note": t.note}
                                         for t in self.weights.storage_terms],
                        "startupSeconds": self.weights.startup_seconds,
                        "startupTerms": [{"name": t.name, "seconds": t.value, "note": t.note}
                                         for t in self.weights.startup_terms]},
            "warnings": list(self.warnings),
        }
        if self.server_memory:
            out["serverMemory"] = {"request": self.server_memory, "limit": self.server_memory_limit,
                                   "terms": [{"name": m.name, "bytes": m.bytes, "note": m.note}
                                             for m in self.server_memory_terms]}
        if self.shared:
            out["shared"] = {"scope": "node", "tiers": [t.name for t in self.tiers[1:] if t.bytes],
                             "serverMemory": self.server_memory,
                             "note": "one LMCache server pod per node that runs replicas of this resource, shared by "
                                     "them: its L1 (cpu) and L2 (disk) tiers are held once per node, and serverMemory "
                                     "is that pod's request = limit; the vLLM containers hold no L1"}
        return out


def validate_tp(model: ModelArch, tp: int) -> None:
    """Refuse what vLLM refuses: heads must split evenly, KV heads split or replicate evenly (tp >= 1)."""
    if model.attention_heads % tp:
        raise InputError("tp", f"{tp} does not divide {model.hf_id}'s {model.attention_heads} attention heads")
    if model.kv_heads % tp and tp % model.kv_heads:
        raise InputError("tp", f"{tp} neither divides nor is a multiple of {model.hf_id}'s {model.kv_heads} KV heads")


def _int(value: Any, minimum: int, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(key, f"must be an integer >= {minimum}, got {value!r}")


def _number(value: Any, key: str, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise InputError(key, f"must be a number {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def check(inp: PlanInput) -> None:
    """The bounds of every input, for callers that no schema checked (`kvoffload plan`, tests).
    The operator skips it: spec.parse already holds the CRD's bounds, which are tighter."""
    _int(inp.tp, 1, "tp")
    _int(inp.max_model_len, 1, "max_model_len")
    _int(inp.concurrency, 1, "concurrency")
    _int(inp.chunk_size, 1, "chunk_size")
    if inp.backend not in backends.REGISTRY:
        raise InputError("backend", f"{inp.backend!r} is not one of {', '.join(backends.NAMES)}")
    if not (isinstance(inp.gpu_memory_utilization, (int, float)) and 0 < inp.gpu_memory_utilization <= 1):
        raise InputError("gpu_memory_utilization", f"must be in (0, 1], got {inp.gpu_memory_utilization!r}")
    if inp.weight_dtype not in DTYPE_BYTES:
        raise InputError("weight_dtype", f"{inp.weight_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if inp.kv_dtype not in KV_DTYPES:
        raise InputError("kv_dtype", f"{inp.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    _int(inp.gpu_memory, 1, "gpu_memory")
    _int(inp.cpu_size, 0, "cpu_size")
    _int(inp.disk_size, 0, "disk_size")
    _int(inp.activation_reserve, 0, "activation_reserve")
    mem = inp.memory
    for key in ("engine_baseline", "per_worker_overhead", "staging_per_worker", "server_baseline", "headroom_min"):
        _int(getattr(mem, key), 0, key)
    if mem.shm is not None:
        _int(mem.shm, 0, "shm")
    headroom = mem.headroom_percent
    if isinstance(headroom, bool) or not isinstance(headroom, int) or not 0 <= headroom <= 100:
        raise InputError("headroom_percent", f"must be an integer in [0, 100], got {mem.headroom_percent!r}")
    _number(inp.bandwidths.cpu_read, "cpu_read")
    _number(inp.bandwidths.disk_read, "disk_read")
    _number(inp.bandwidths.weight_download, "weight_download")
    _number(inp.bandwidths.weight_load, "weight_load")
    if inp.bandwidths.prefill_tokens_per_s is not None:
        _number(inp.bandwidths.prefill_tokens_per_s, "prefill_tokens_per_s")


def _refuse(inp: PlanInput) -> None:
    """What no schema can see: rules of the model, of vLLM and of LMCache."""
    m = inp.model
    validate_tp(m, inp.tp)
    if m.attention == "mla":
        raise InputError("model", f"{m.hf_id} uses multi-head latent attention (MLA); this sizing "
                         "model covers standard and grouped-query attention only and will not guess")
    if inp.gpus is not None and inp.gpus != inp.tp:
        raise InputError("gpus", f"{inp.gpus} GPUs with {{tp}} {inp.tp}: pipeline "
                         "parallelism is not modelled; use as many GPUs as the tensor-parallel size")
    backend = backends.REGISTRY[inp.backend]
    if inp.disk_size and not backend.disk_tier:
        with_disk = " or ".join(b.name for b in backends.REGISTRY.values() if b.disk_tier)
        raise InputError("disk_size", f"{{backend}} {backend.name} has no disk tier "
                         f"({backend.refuses['offload.disk'].why}); set {{disk_size}} to 0 or use "
                         f"{{backend}} {with_disk}")
    if inp.shared and "offload.server" in backend.refuses:
        sharing = " or ".join(b.name for b in backends.REGISTRY.values() if "offload.server" not in b.refuses)
        raise InputError("shared", f"{{backend}} {backend.name} runs no LMCache server to share "
                         f"({backend.refuses['offload.server'].why}); use {{backend}} {sharing}")
    if inp.disk_size and not inp.cpu_size:
        raise InputError("cpu_size", "the disk tier needs a CPU tier (LMCache reads disk hits back through it); "
                         "set {cpu_size} > 0 or {disk_size} to 0")


def _measured(table: Mapping[tuple[int, ...], float], vllm_version: str) -> tuple[str, float]:
    """(the measured vLLM version it comes from, its figure) for the image's vLLM: the newest measured version at or
    below it, else the oldest measured."""
    want = images.version_tuple(vllm_version, "engine.vllmVersion")
    at_or_below = [v for v in table if v <= want]
    version = max(at_or_below) if at_or_below else min(table)
    return ".".join(map(str, version)), table[version]


def measured_prefill(vllm_version: str) -> tuple[str, float]:
    """(the measured vLLM version it comes from, its 32K prefill in seconds) for the image's vLLM."""
    return _measured(MEASURED_PREFILL_S, vllm_version)


def engine_start_s(vllm_version: str) -> tuple[str, int]:
    """(the measured vLLM version it comes from, the start-up budget's engine term in whole seconds)."""
    version, seconds = _measured(MEASURED_ENGINE_START_S, vllm_version)
    return version, math.ceil(seconds * ENGINE_START_MARGIN)


def prefill_from(inp: PlanInput) -> str:
    """Where the recompute rate comes from."""
    if inp.bandwidths.prefill_tokens_per_s is not None:
        return inp.bandwidths.prefill_from
    version, seconds = measured_prefill(inp.vllm_version)
    return (f"derived: {MEASURED_PREFILL_TOKENS / seconds:,.0f} tokens/s measured with vLLM {version} for an 8B Llama "
            f"on one H200, × 8B / parameters × TP ({inp.bandwidths.prefill_from} unset)")


def prefill_tokens_per_s(inp: PlanInput) -> float:
    if inp.bandwidths.prefill_tokens_per_s is not None:
        return inp.bandwidths.prefill_tokens_per_s
    measured = MEASURED_PREFILL_TOKENS / measured_prefill(inp.vllm_version)[1]
    return measured * MEASURED_PARAMS / inp.model.params * inp.tp


def _gpu_tier(inp: PlanInput, per_gpu_bpt: int, windowed: bool) -> tuple[TierBudget, int]:
    """The GPU tier and one max_model_len sequence's bytes per GPU."""
    m, L = inp.model, inp.max_model_len
    weights = m.params * DTYPE_BYTES[inp.weight_dtype]
    usable = int(inp.gpu_memory * inp.gpu_memory_utilization)
    weights_per_gpu = -(-weights // inp.tp)
    budget = usable - weights_per_gpu - inp.activation_reserve
    if budget <= 0:
        raise InputError("gpu_memory", (
            f"{m.hf_id} weights ({human(weights)} {inp.weight_dtype}) need {human(weights_per_gpu)} per GPU "
            f"at {{tp}}={inp.tp}; {human(inp.gpu_memory)} × {{gpu_memory_utilization}} {inp.gpu_memory_utilization} = "
            f"{human(usable)}, minus the {human(inp.activation_reserve)} activation reserve, leaves no room for KV: "
            f"raise {{gpu_memory}}, {{gpu_memory_utilization}} or {{tp}}"))
    per_layer = per_gpu_bpt // m.layers
    seq_layers_tokens = m.layers * L
    if windowed:
        seq_layers_tokens = m.full_layers * L + m.sliding_window_layers * min(L, m.sliding_window or L)
    seq = per_layer * seq_layers_tokens
    if budget < seq:
        raise InputError("max_model_len", (
            f"one {L}-token request needs {human(seq)} of KV per GPU, but only {human(budget)} per GPU is left "
            f"after weights and the activation reserve (vLLM refuses to start): lower {{max_model_len}}"
            f"{'' if windowed else f' to at most {budget // per_gpu_bpt}'}, or raise {{gpu_memory}}, "
            f"{{gpu_memory_utilization}} or {{tp}}"))
    tier = TierBudget("gpu", budget * inp.tp, budget, budget * L // seq, budget // seq)
    return tier, seq


def _offload_tier(name: str, size: int, inp: PlanInput, per_gpu_bpt: int, unit: int) -> TierBudget:
    """`unit`: tokens stored as one piece (Backend.unit: LMCache's chunk, vLLM's KV block)."""
    per_worker = size // inp.tp
    chunks = per_worker // (unit * per_gpu_bpt)  # each rank stores its slice of every chunk
    tokens = chunks * unit
    return TierBudget(name, size, per_worker, tokens, tokens // inp.max_model_len)


def _with_headroom(terms: list[MemoryTerm], mem: MemoryDefaults) -> tuple[tuple[MemoryTerm, ...], int]:
    subtotal = sum(t.bytes for t in terms)
    headroom = max(mem.headroom_min, math.ceil(subtotal * (mem.headroom_percent / 100)))
    terms.append(MemoryTerm("headroom", headroom, f"{mem.headroom_percent / 100:g} of the terms above, at least "
                                                  f"{human(mem.headroom_min)}"))
    return tuple(terms), -(-(subtotal + headroom) // MiB) * MiB


def _memory(inp: PlanInput, offload: bool, s: Sizing) -> tuple[tuple[MemoryTerm, ...], int, int]:
    """The vLLM container's terms and total, and the /dev/shm volume."""
    mem, tp, backend = inp.memory, inp.tp, backends.REGISTRY[inp.backend]
    shm = mem.shm if mem.shm is not None else GiB + GiB * tp
    staging = offload and backend.stages
    terms = [
        MemoryTerm("engine_baseline", mem.engine_baseline, "vLLM API server + engine core process"),
        MemoryTerm("worker_overhead", mem.per_worker_overhead * tp,
                   f"{tp} TP worker(s) × {human(mem.per_worker_overhead)}: torch/CUDA runtime"),
        backend.cpu_tier(s),
        MemoryTerm("staging", mem.staging_per_worker * tp if staging else 0,
                   f"pinned staging buffers, {tp} rank(s) × {human(mem.staging_per_worker)}" if staging else
                   "none: vLLM copies between GPU blocks and its pinned CPU blocks directly" if offload
                   else "no offload tier: none"),
        MemoryTerm("shm", shm, "memory-backed /dev/shm for NCCL and worker IPC, charged to the pod"),
    ]
    terms_, total = _with_headroom(terms, mem)
    return terms_, total, shm + backend.shm_extra(s)


def _limit_only(inp: PlanInput, s: Sizing) -> tuple[tuple[MemoryTerm, ...], int]:
    """The vLLM container's limit-only term, if its backend keeps one, and its whole MiB."""
    term = backends.REGISTRY[inp.backend].vllm_limit_only(s)
    return ((term,), -(-term.bytes // MiB) * MiB) if term else ((), 0)


def _sidecar_memory(inp: PlanInput, s: Sizing) -> tuple[tuple[MemoryTerm, ...], int, int]:
    """The backend's sidecar container: its terms, request (with headroom) and limit (+ a limit-only term)."""
    request_terms, limit_only = backends.REGISTRY[inp.backend].sidecar_memory(s)
    if not request_terms:
        return (), 0, 0
    terms, request = _with_headroom(request_terms, inp.memory)
    if limit_only is None:
        return terms, request, request
    return (*terms, limit_only), request, request + -(-limit_only.bytes // MiB) * MiB


STARTUP_PROBE_PERIOD_S = 10


def _weights(inp: PlanInput) -> WeightBudget:
    st, bw = inp.storage, inp.bandwidths
    weights = inp.model.params * DTYPE_BYTES[inp.weight_dtype]
    volume = 0 if inp.weights_on_pvc else -(-(math.ceil(weights * (100 + st.weights_percent) / 100)
                                              + st.weights_extra) // GiB) * GiB
    storage = (
        Term("weights", volume, "on the model cache PVC (spec.model.cache): none here" if inp.weights_on_pvc else
             f"{human(weights)} {inp.weight_dtype} weights + {st.weights_percent}% + {human(st.weights_extra)}, whole "
             "GiB: emptyDir HF_HOME, kept across container restarts"),
        Term("compile_cache", st.compile_cache, "HOME: vLLM/torch.compile, Triton and FlashInfer caches"),
        Term("tmp", st.tmp, "/tmp"),
    )
    version, engine = engine_start_s(inp.vllm_version)
    startup = (
        Term("download", math.ceil(weights / bw.weight_download),
             f"{human(weights)} at {bw.weight_download / 1e6:.3g} MB/s (assumed)"),
        Term("load", math.ceil(weights / bw.weight_load), f"read back at {bw.weight_load / 1e9:.3g} GB/s"),
        Term("engine", engine, f"torch.compile, CUDA graph capture, tiers pinned: {ENGINE_START_MARGIN} × the slowest "
             f"start measured with vLLM {version} on an H200"),
    )
    seconds = sum(t.value for t in startup)
    seconds = -(-seconds // STARTUP_PROBE_PERIOD_S) * STARTUP_PROBE_PERIOD_S
    return WeightBudget(weights, volume, storage, sum(t.value for t in storage), startup, seconds)


def plan(inp: PlanInput) -> Budget:
    """Size every tier and the pod for `inp`, whose bounds hold (`check`, or the CRD's in spec.parse).

    Refusals are InputErrors keyed by PlanInput's names; warnings name inputs as `{key}` (Budget.named)."""
    _refuse(inp)
    m, tp, L = inp.model, inp.tp, inp.max_model_len
    kv_bytes = DTYPE_BYTES[inp.weight_dtype if inp.kv_dtype == "auto" else inp.kv_dtype]
    heads_per_gpu = max(1, m.kv_heads // tp)
    per_gpu_bpt = 2 * m.layers * heads_per_gpu * m.head_dim * kv_bytes
    offload = bool(inp.cpu_size or inp.disk_size)
    windowed = bool(m.sliding_window and m.sliding_window_layers) and not offload
    gpu, seq_per_gpu = _gpu_tier(inp, per_gpu_bpt, windowed)
    backend = backends.REGISTRY[inp.backend]
    s = Sizing(model=m, tp=tp, cpu_size=inp.cpu_size, disk_size=inp.disk_size, chunk_size=inp.chunk_size,
               kv_bytes_per_token_per_gpu=per_gpu_bpt, staging_per_worker=inp.memory.staging_per_worker,
               server_baseline=inp.memory.server_baseline,
               vllm=images.version_tuple(inp.vllm_version, "engine.vllmVersion"), shared=inp.shared)
    unit = backend.unit(s)
    tiers = (gpu, _offload_tier("cpu", inp.cpu_size, inp, per_gpu_bpt, unit),
             _offload_tier("disk", inp.disk_size, inp, per_gpu_bpt, unit))
    terms, total, shm = _memory(inp, offload, s)
    limit_only, extra = _limit_only(inp, s)
    server_terms, server_total, server_limit = _sidecar_memory(inp, s)

    warnings: list[str] = []
    if m.max_context and L > m.max_context:
        warnings.append(f"{{max_model_len}} {L} exceeds {m.hf_id}'s max_position_embeddings {m.max_context}: vLLM "
                        "refuses it unless the model's rope scaling is overridden or "
                        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set")
    if tp > m.kv_heads:
        warnings.append(f"{{tp}} {tp} > {m.kv_heads} KV heads: each KV head is replicated on {tp // m.kv_heads} "
                        f"GPUs, so every tier stores {per_gpu_bpt * tp} B/token instead of {per_gpu_bpt * m.kv_heads}")
    if m.sliding_window and m.sliding_window_layers:
        warnings.append(
            f"{m.sliding_window_layers} of {m.layers} layers use a {m.sliding_window}-token sliding window: " + (
                "the GPU tier assumes vLLM's hybrid KV cache manager keeps only the window in those layers"
                if windowed else
                "vLLM turns its hybrid KV cache manager off when a KV connector is set, so those layers take "
                "full-length GPU memory; LMCache tiers are sized as storing every layer of every token"))
    if gpu.sequences < inp.concurrency:
        warnings.append(f"the GPU tier holds {gpu.sequences} full-length ({L}-token) sequences but {{concurrency}} is "
                        f"{inp.concurrency}: vLLM preempts or queues requests when that many long ones run at once")
    for t in tiers[1:]:
        if t.bytes and not t.tokens:
            warnings.append(f"{t.name} tier: {human(t.bytes_per_worker)} per worker is less than one {unit}-token "
                            f"chunk ({human(unit * per_gpu_bpt)} per worker): it can hold nothing")

    warnings += backend.warnings(s)

    prefill = prefill_tokens_per_s(inp)
    prefix = L * per_gpu_bpt * tp
    reload: list[ReloadEstimate] = []
    bws = inp.bandwidths
    for name, size, read_bytes, bw, source in (("cpu", inp.cpu_size, prefix / tp, bws.cpu_read, bws.cpu_read_from),
                                                ("disk", inp.disk_size, prefix, bws.disk_read, bws.disk_read_from)):
        if not size:
            continue
        est = ReloadEstimate(name, L, prefix, read_bytes / bw, L / prefill, read_bytes / bw > L / prefill,
                             bw, source, prefill, prefill_from(inp))
        reload.append(est)
        if est.slower_than_recompute:
            warnings.append(f"{name} tier: reloading a {L}-token prefix ({human(prefix)}) takes {est.reload_s:.3g} s "
                            f"at {bw / 1e9:.3g} GB/s ({source}), recomputing it {est.recompute_s:.3g} s: hits from "
                            "this tier are SLOWER than recompute (it pays off above "
                            f"{read_bytes / est.recompute_s / 1e9:.3g} GB/s)")

    return Budget(
        backend=inp.backend,
        kv_bytes_per_token=per_gpu_bpt * tp,
        kv_bytes_per_token_per_gpu=per_gpu_bpt,
        kv_bytes_per_sequence=seq_per_gpu * tp,
        tiers=tiers,
        memory_terms=(*terms, *limit_only),
        memory_request=total,
        memory_limit=total + extra,
        server_memory_terms=server_terms,
        server_memory=server_total,
        server_memory_limit=server_limit,
        shm=shm,
        reload=tuple(reload),
        warnings=tuple(warnings),
        weights=_weights(inp),
        shared=inp.shared,
    )
