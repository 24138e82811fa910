"""sizing.plan against hand-computed figures, its refusals, and properties that hold for any input."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.api.errors import ConfigError
from kvoffload.api.quantity import GiB, MiB
from kvoffload.api.spec import PLAN_FIELDS
from kvoffload.backends.vllm_native import native_cpu_bytes, native_pinned, power_of_two_ceil
from kvoffload.planning.catalog import ModelArch, lookup
from kvoffload.planning.sizing import (
    Bandwidths,
    MemoryDefaults,
    PlanInput,
    check,
    plan,
    validate_tp,
)

KiB = 1024
L31_8B = lookup("meta-llama/Llama-3.1-8B-Instruct")
L31_70B = lookup("meta-llama/Llama-3.1-70B-Instruct")


def usable(gpu_gib: int, util: float) -> int:
    return int(gpu_gib * GiB * util)


# ---- bytes per token: 2 × layers × kv_heads × head_dim × bytes -------------------------------------

@pytest.mark.parametrize("hf_id, tp, kv_dtype, per_gpu, per_replica", [
    ("meta-llama/Meta-Llama-3-8B", 1, "auto", 2 * 32 * 8 * 128 * 2, 131072),
    ("meta-llama/Llama-2-7b-hf", 1, "auto", 2 * 32 * 32 * 128 * 2, 524288),  # no GQA
    ("meta-llama/Llama-2-7b-hf", 4, "auto", 2 * 32 * 8 * 128 * 2, 524288),
    ("meta-llama/Llama-3.1-8B-Instruct", 1, "fp8", 2 * 32 * 8 * 128 * 1, 65536),
    ("meta-llama/Llama-3.1-70B-Instruct", 8, "auto", 2 * 80 * 1 * 128 * 2, 327680),  # 1 KV head per GPU
    ("google/gemma-2-9b-it", 1, "auto", 2 * 42 * 8 * 256 * 2, 344064),
    ("Qwen/Qwen2.5-7B-Instruct", 2, "auto", 2 * 28 * 2 * 128 * 2, 57344),
])
def test_kv_bytes_per_token(hf_id: str, tp: int, kv_dtype: str, per_gpu: int, per_replica: int) -> None:
    b = plan(PlanInput(lookup(hf_id), 4096, tp=tp, kv_dtype=kv_dtype))
    assert (b.kv_bytes_per_token_per_gpu, b.kv_bytes_per_token) == (per_gpu, per_replica)


def test_llama3_8b_32k_request_is_4gib() -> None:
    assert plan(PlanInput(L31_8B, 32768)).kv_bytes_per_sequence == 4 * GiB
    assert plan(PlanInput(lookup("meta-llama/Llama-2-7b-hf"), 32768)).kv_bytes_per_sequence == 16 * GiB


def test_tp_beyond_kv_heads_replicates_heads() -> None:
    # 32 heads % 16 == 0 and 16 % 8 KV heads == 0: vLLM accepts it and puts one (replicated) head per GPU.
    validate_tp(L31_8B, 16)
    b = plan(PlanInput(L31_8B, 32768, tp=16, cpu_size=16 * GiB))
    assert b.kv_bytes_per_token_per_gpu == 2 * 32 * 1 * 128 * 2 == 16384
    assert b.kv_bytes_per_token == 16384 * 16 == 2 * 131072
    assert b.kv_bytes_per_sequence == 32768 * 262144
    cpu = b.tier("cpu")  # each rank: 1 GiB / (256 tokens × 16 KiB) = 256 chunks
    assert (cpu.bytes_per_worker, cpu.tokens) == (GiB, 256 * 256)
    assert any("replicated" in w for w in b.warnings)


# ---- the GPU tier -----------------------------------------------------------------------------------

def test_gpu_tier_llama_8b_80gib() -> None:
    b = plan(PlanInput(L31_8B, 32768))
    budget = usable(80, 0.9) - 8_030_261_248 * 2 - 2 * GiB
    gpu = b.tier("gpu")
    assert (gpu.bytes, gpu.bytes_per_worker) == (budget, budget)
    assert gpu.tokens == budget // 131072 == 450907
    assert gpu.sequences == budget // (4 * GiB) == 13


def test_gpu_tier_70b_tp8_tokens_are_per_gpu_not_times_tp() -> None:
    b = plan(PlanInput(L31_70B, 131072, tp=8))
    per_gpu = usable(80, 0.9) - 70_553_706_496 * 2 // 8 - 2 * GiB  # 57,523,501,056
    gpu = b.tier("gpu")
    assert (gpu.bytes_per_worker, gpu.bytes) == (per_gpu, per_gpu * 8)
    assert gpu.tokens == per_gpu // 40960 == 1_404_382  # every GPU holds a slice of every token
    assert gpu.sequences == per_gpu // (40960 * 131072) == 10


def test_24gib_gpu_llama_8b_bf16_weights_do_not_fit() -> None:
    with pytest.raises(ConfigError) as exc:
        plan(PlanInput(L31_8B, 65536, gpu_memory=24 * GiB, gpu_memory_utilization=0.5))
    assert exc.value.key == "gpu_memory" and exc.value.named(PLAN_FIELDS).field == "spec.resources.gpuMemory"
    # 8.03e9 × 2 B = 14.96 GiB of weights against 24 GiB × 0.5 = 12 GiB
    assert "14.96 GiB" in exc.value.message and "12 GiB" in exc.value.message
    assert "spec.engine.tensorParallelSize" in exc.value.named(PLAN_FIELDS).message


def test_24gib_gpu_llama_8b_max_model_len_too_long() -> None:
    with pytest.raises(ConfigError) as exc:  # 21.6 − 14.96 − 2 = 4.64 GiB left, 65536 tokens need 8 GiB
        plan(PlanInput(L31_8B, 65536, gpu_memory=24 * GiB))
    assert exc.value.key == "max_model_len" and exc.value.named(PLAN_FIELDS).field == "spec.engine.maxModelLen"
    assert "at most 38031" in exc.value.message


def test_24gib_gpu_llama_8b_fp8_fits() -> None:
    b = plan(PlanInput(L31_8B, 65536, gpu_memory=24 * GiB, weight_dtype="fp8"))  # kv auto = fp8
    budget = usable(24, 0.9) - 8_030_261_248 - 2 * GiB  # 13,015,078,502
    assert b.kv_bytes_per_token == 65536
    assert (b.tier("gpu").tokens, b.tier("gpu").sequences) == (budget // 65536, 3) == (198594, 3)


def test_concurrency_beyond_gpu_sequences_warns() -> None:
    b = plan(PlanInput(L31_8B, 131072, concurrency=8))  # 55 GiB / 16 GiB = 3 sequences
    assert b.tier("gpu").sequences == 3
    assert any("spec.engine.maxNumSeqs is 8" in w for w in b.named(PLAN_FIELDS).warnings)
    assert not any("maxNumSeqs" in w
                   for w in plan(PlanInput(L31_8B, 131072, concurrency=3)).named(PLAN_FIELDS).warnings)


# ---- sliding windows ----------------------------------------------------------------------------------

def test_gemma2_window_rule_without_offload() -> None:
    g = lookup("google/gemma-2-9b-it")
    b = plan(PlanInput(g, 8192))
    per_layer_token = 2 * 8 * 256 * 2  # 8192 B
    seq = per_layer_token * (21 * 8192 + 21 * 4096)  # 21 global layers full length, 21 windowed to 4096
    assert b.kv_bytes_per_sequence == seq == 2_113_929_216
    budget = usable(80, 0.9) - 9_241_705_984 * 2 - 2 * GiB
    assert b.tier("gpu").sequences == budget // seq
    assert b.tier("gpu").tokens == budget * 8192 // seq
    assert any("hybrid KV cache manager keeps only the window" in w for w in b.warnings)


def test_gemma2_with_offload_sizes_windowed_layers_full_length() -> None:
    # vLLM turns the hybrid KV cache manager off when a KV connector is set.
    g = lookup("google/gemma-2-9b-it")
    b = plan(PlanInput(g, 8192, cpu_size=32 * GiB))
    assert b.kv_bytes_per_sequence == 344064 * 8192
    assert b.tier("gpu").tokens == (usable(80, 0.9) - 9_241_705_984 * 2 - 2 * GiB) // 344064
    assert b.tier("cpu").tokens == 32 * GiB // (256 * 344064) * 256
    assert any("full-length" in w for w in b.warnings)


def test_mistral_v01_every_layer_windowed() -> None:
    m = lookup("mistralai/Mistral-7B-Instruct-v0.1")
    b = plan(PlanInput(m, 32768))
    assert b.kv_bytes_per_sequence == 131072 * 4096  # every layer keeps at most 4096 tokens
    short = plan(PlanInput(m, 2048))
    assert short.kv_bytes_per_sequence == 131072 * 2048  # shorter than the window: no saving


def test_max_context_warning() -> None:
    b = plan(PlanInput(lookup("meta-llama/Meta-Llama-3-8B-Instruct"), 16384))
    assert any("max_position_embeddings 8192" in w for w in b.warnings)


# ---- offload tiers, memory, reload ----------------------------------------------------------------------

def test_offload_tiers_whole_chunks() -> None:
    b = plan(PlanInput(L31_8B, 32768, cpu_size=40 * GiB, disk_size=500 * GiB))
    assert (b.tier("cpu").tokens, b.tier("cpu").sequences) == (327680, 10)
    assert (b.tier("disk").tokens, b.tier("disk").sequences) == (4_096_000, 125)
    odd = plan(PlanInput(L31_8B, 32768, cpu_size=40 * GiB + 100 * MiB))  # 100 MiB = 3.1 chunks of 32 MiB
    assert odd.tier("cpu").tokens == 327680 + 3 * 256


def test_tiny_tier_warns() -> None:
    b = plan(PlanInput(L31_8B, 4096, cpu_size=16 * MiB))
    assert b.tier("cpu").tokens == 0
    assert any("can hold nothing" in w for w in b.warnings)


def test_memory_terms_tp1() -> None:
    b = plan(PlanInput(L31_8B, 32768, cpu_size=40 * GiB, disk_size=500 * GiB))
    terms = {t.name: t.bytes for t in b.memory_terms}
    assert terms == {"engine_baseline": 4 * GiB, "worker_overhead": 2 * GiB, "cpu_tier": 40 * GiB,
                     "staging": GiB, "shm": 2 * GiB, "headroom": -(-49 * GiB // 10)}
    assert b.memory_request == b.memory_limit == 55194 * MiB  # 53.9 GiB rounded up to whole MiB
    assert b.shm == 2 * GiB


def test_memory_terms_tp8_scale_per_rank() -> None:
    b = plan(PlanInput(L31_70B, 32768, tp=8, cpu_size=160 * GiB))
    terms = {t.name: t.bytes for t in b.memory_terms}
    assert (terms["worker_overhead"], terms["staging"], terms["shm"]) == (16 * GiB, 8 * GiB, 9 * GiB)
    assert b.tier("cpu").bytes_per_worker == 20 * GiB
    subtotal = (4 + 16 + 160 + 8 + 9) * GiB
    assert b.memory_limit == -(-(subtotal + -(-subtotal // 10)) // MiB) * MiB


def test_memory_without_offload_has_no_staging_and_min_headroom() -> None:
    b = plan(PlanInput(L31_8B, 4096))
    terms = {t.name: t.bytes for t in b.memory_terms}
    assert terms["staging"] == 0 and terms["cpu_tier"] == 0
    assert terms["headroom"] == GiB  # 10 % of 8 GiB is below the 1 GiB floor
    assert b.memory_limit == 9 * GiB and b.reload == ()


def test_memory_overrides() -> None:
    mem = MemoryDefaults(engine_baseline=GiB, per_worker_overhead=0, staging_per_worker=0, shm=0,
                         headroom_percent=0, headroom_min=0)
    b = plan(PlanInput(L31_8B, 4096, cpu_size=3 * GiB, memory=mem))
    assert b.memory_limit == 4 * GiB and b.shm == 0


def test_measured_disk_is_slower_than_recompute_for_llama_8b_32k() -> None:
    b = plan(PlanInput(L31_8B, 32768, cpu_size=40 * GiB, disk_size=500 * GiB))
    cpu, disk = b.reload
    assert (cpu.tier, disk.tier) == ("cpu", "disk")
    assert cpu.bytes == disk.bytes == 4 * GiB
    assert cpu.recompute_s == pytest.approx(1.169, abs=1e-4)  # the default vLLM 0.33.0's measured 32K prefill
    assert cpu.reload_s == pytest.approx(0.0783, abs=1e-4) and not cpu.slower_than_recompute
    assert disk.reload_s == pytest.approx(4.5764, abs=1e-4) and disk.slower_than_recompute
    assert any(w.startswith("disk tier") and "SLOWER" in w for w in b.warnings)


def test_fast_disk_is_not_flagged() -> None:
    b = plan(PlanInput(L31_8B, 32768, cpu_size=GiB, disk_size=10 * GiB, bandwidths=Bandwidths(disk_read=7e9)))
    assert not b.reload[1].slower_than_recompute


def test_prefill_rate_scales_with_params_and_tp() -> None:
    b = plan(PlanInput(L31_70B, 32768, tp=8, cpu_size=8 * GiB))
    assert b.reload[0].recompute_s == pytest.approx(1.169 * 70_553_706_496 / 8_030_261_248 / 8, rel=1e-4)
    # vLLM 0.33.0 measured its own prefill (1.169 s); a version not measured takes the newest measured below it.
    for version, seconds in (("0.33.0", 1.169), ("0.34.1", 1.169), ("0.30.0", 1.121), ("0.25.0", 1.121)):
        b = plan(PlanInput(L31_8B, 32768, cpu_size=8 * GiB, vllm_version=version))
        assert b.reload[0].recompute_s == pytest.approx(seconds, abs=1e-4), version
    own = plan(PlanInput(L31_8B, 1000, cpu_size=GiB, bandwidths=Bandwidths(prefill_tokens_per_s=1000)))
    assert own.reload[0].recompute_s == 1.0


def test_to_dict_is_json_with_camel_case() -> None:
    d = plan(PlanInput(L31_8B, 32768, concurrency=1, cpu_size=40 * GiB, disk_size=500 * GiB)).to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["kvBytesPerToken"] == 131072
    assert d["tiers"][1] == {"name": "cpu", "bytes": 40 * GiB, "bytesPerWorker": 40 * GiB, "tokens": 327680,
                             "sequences": 10}
    assert d["memory"]["request"] == d["memory"]["limit"] == 55194 * MiB
    assert d["memory"]["terms"][0] == {"name": "engine_baseline", "bytes": 4 * GiB,
                                       "note": "vLLM API server + engine core process"}
    assert d["reload"][1] == {"tier": "disk", "tokens": 32768, "bytes": 4 * GiB, "reloadSeconds": 4.5764,
                              "recomputeSeconds": 1.169, "slowerThanRecompute": True}
    assert d["shm"] == 2 * GiB and len(d["warnings"]) == 1


# ---- refusals -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hf_id, tp", [
    ("meta-llama/Llama-3.1-8B", 3), ("meta-llama/Llama-3.1-8B", 64),
    ("Qwen/Qwen2.5-7B", 8),  # 28 heads % 8 != 0
    ("Qwen/Qwen2.5-7B", 7),  # 28 % 7 == 0, but 7 neither divides nor is a multiple of 4 KV heads
])
def test_validate_tp_refuses_what_vllm_refuses(hf_id: str, tp: int) -> None:
    with pytest.raises(ConfigError) as exc:
        validate_tp(lookup(hf_id), tp)
    assert exc.value.key == "tp"


@pytest.mark.parametrize("hf_id, tp", [("Qwen/Qwen2.5-7B", 4), ("meta-llama/Llama-2-70b-hf", 16),
                                       ("google/gemma-2-27b", 32), ("meta-llama/Llama-3.1-405B", 8)])
def test_validate_tp_accepts(hf_id: str, tp: int) -> None:
    validate_tp(lookup(hf_id), tp)


@pytest.mark.parametrize("change, key", [
    ({"max_model_len": 0}, "max_model_len"),
    ({"concurrency": 0}, "concurrency"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"kv_dtype": "int4"}, "kv_dtype"),
    ({"weight_dtype": "fp32"}, "weight_dtype"),
    ({"cpu_size": -1}, "cpu_size"),
    ({"disk_size": -1}, "disk_size"),
    ({"disk_size": GiB}, "cpu_size"),  # a disk tier needs a CPU tier
    ({"gpu_memory": 0}, "gpu_memory"),
    ({"gpus": 2}, "gpus"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"tp": 0}, "tp"),
    ({"tp": 5}, "tp"),
    ({"memory": MemoryDefaults(engine_baseline=-1)}, "engine_baseline"),
    ({"memory": MemoryDefaults(headroom_percent=-1)}, "headroom_percent"),
    ({"memory": MemoryDefaults(headroom_percent=101)}, "headroom_percent"),
    ({"bandwidths": Bandwidths(disk_read=0)}, "disk_read"),
])
def test_bad_input_names_the_input(change: dict, key: str) -> None:
    inp = dataclasses.replace(PlanInput(L31_8B, 4096), **change)
    with pytest.raises(ConfigError) as exc:
        check(inp)
        plan(inp)
    assert exc.value.key == key


def test_mla_is_refused() -> None:
    mla = ModelArch("deepseek-ai/DeepSeek-V3", 61, 128, 128, 192, 671_000_000_000, attention="mla")
    with pytest.raises(ConfigError) as exc:
        plan(PlanInput(mla, 4096, tp=8))
    assert exc.value.key == "model" and "MLA" in exc.value.message
    assert exc.value.named(PLAN_FIELDS).field == "spec.model.name"


# ---- properties --------------------------------------------------------------------------------------

MODELS = [lookup(i) for i in ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
                              "mistralai/Mistral-7B-Instruct-v0.1", "google/gemma-2-9b-it", "meta-llama/Llama-2-7b-hf")]
H200 = 141 * GiB


@st.composite
def inputs(draw: st.DrawFn) -> PlanInput:
    model = draw(st.sampled_from(MODELS))
    tp = draw(st.sampled_from([1, 2, 4]))
    cpu = draw(st.integers(0, 256 * GiB))
    return PlanInput(model, draw(st.integers(1, 32768)), concurrency=draw(st.integers(1, 256)), gpu_memory=H200, tp=tp,
                     cpu_size=cpu, disk_size=draw(st.integers(0, 4096 * GiB)) if cpu else 0,
                     chunk_size=draw(st.sampled_from([16, 256, 512])))


@settings(max_examples=60, deadline=None)
@given(inputs())
def test_never_negative_and_consistent(inp: PlanInput) -> None:
    b = plan(inp)
    assert b.kv_bytes_per_token == b.kv_bytes_per_token_per_gpu * inp.tp > 0
    for t in b.tiers:
        assert min(t.bytes, t.bytes_per_worker, t.tokens, t.sequences) >= 0
        assert t.bytes_per_worker == t.bytes // inp.tp
        if t.bytes % inp.tp == 0:
            assert t.bytes_per_worker * inp.tp == t.bytes
        if t.name != "gpu":
            assert t.tokens % inp.chunk_size == 0 and t.sequences == t.tokens // inp.max_model_len
            assert t.tokens * b.kv_bytes_per_token <= t.bytes
    assert b.tier("gpu").sequences >= 1  # else plan refuses, as vLLM does
    assert b.memory_request == b.memory_limit >= inp.cpu_size + b.shm
    assert b.memory_limit % MiB == 0 and b.memory_limit >= sum(t.bytes for t in b.memory_terms)
    assert all(t.bytes >= 0 for t in b.memory_terms)


@settings(max_examples=40, deadline=None)
@given(inputs(), st.integers(1, 32768))
def test_monotone_in_context(inp: PlanInput, longer_by: int) -> None:
    short, long = plan(inp), plan(dataclasses.replace(inp, max_model_len=inp.max_model_len + longer_by))
    assert short.kv_bytes_per_sequence <= long.kv_bytes_per_sequence
    for a, b in zip(short.tiers, long.tiers):
        assert a.bytes == b.bytes and a.sequences >= b.sequences
    assert short.memory_limit == long.memory_limit
    for a, b in zip(short.reload, long.reload):
        assert a.reload_s <= b.reload_s and a.recompute_s <= b.recompute_s


@settings(max_examples=30, deadline=None)
@given(inputs(), st.integers(1, 256))
def test_concurrency_changes_only_warnings(inp: PlanInput, more: int) -> None:
    few, many = plan(inp), plan(dataclasses.replace(inp, concurrency=inp.concurrency + more))
    assert dataclasses.replace(few, warnings=()) == dataclasses.replace(many, warnings=())
    assert len(few.warnings) <= len(many.warnings)


@settings(max_examples=30, deadline=None)
@given(inputs(), st.integers(1, 64 * GiB))
def test_memory_monotone_in_cpu_tier(inp: PlanInput, extra: int) -> None:
    base = dataclasses.replace(inp, cpu_size=max(inp.cpu_size, 1))
    assert plan(base).memory_limit <= plan(dataclasses.replace(base, cpu_size=base.cpu_size + extra)).memory_limit


# ---- vllm-native: what vLLM 0.26.0 pins for --kv-offloading-size -----------------------------------
# One torch.zeros((num_blocks, page), pin_memory=True) per attention layer and worker, rounded up to a
# power of two by torch's CachingHostAllocator (tests/engine/test_native_pinned.py checks both against
# the pinned vLLM and torch).

def native(model: ModelArch, cpu_gib: float, tp: int = 1, kv_dtype: str = "auto", vllm: str = "0.26.0"):
    """vLLM 0.26.0's native tier by default: the per-layer pinned tensors these tests are about (0.33.0's one /dev/shm
    region: SHARED_REGION_FROM)."""
    return plan(PlanInput(model, 8192, gpu_memory=141 * GiB, tp=tp, kv_dtype=kv_dtype,
                          cpu_size=int(cpu_gib * GiB), backend="vllm-native", vllm_version=vllm))


def cpu_term(budget) -> int:
    return next(t.bytes for t in budget.memory_terms if t.name == "cpu_tier")


def test_native_measured_case_pins_64_gib_for_40():
    # H200, Llama-3.1-8B, TP 1, --kv-offloading-size 40.0: 64.0 GiB pinned at start-up.
    p = native_pinned(L31_8B, 1, 40 * GiB, 2 * 32 * 8 * 128 * 2)
    assert p.num_blocks == 40 * GiB // (32 * 64 * KiB) == 20480  # 16 tokens × 4 KiB of K+V per layer = 64 KiB pages
    assert p.tensor_bytes == 20480 * 64 * KiB == 1.25 * GiB and p.allocated_bytes == 2 * GiB
    assert p.tensors == 32 and p.per_worker == p.total == 64 * GiB and p.exact
    b = native(L31_8B, 40)
    assert cpu_term(b) == 64 * GiB
    assert b.memory_limit > 66.3 * GiB  # the vLLM container's measured peak now fits
    assert any("pins 64 GiB" in w and "a 32 GiB or 64 GiB tier pins no more than its size" in w for w in b.warnings)


@pytest.mark.parametrize("cpu_gib", [32, 64, 8])
def test_native_power_of_two_tiers_pin_their_size(cpu_gib):
    b = native(L31_8B, cpu_gib)
    assert cpu_term(b) == cpu_gib * GiB and not any("vllm-native pins" in w for w in b.warnings)


@pytest.mark.parametrize("cpu_gib, tp, per_tensor, pinned", [
    (40, 2, 0.625 * GiB, 2 * 32 * GiB),  # each worker holds half the heads and pins its own 32 tensors
    (33, 1, 33 * GiB / 32, 32 * 2 * GiB),  # just over a power of two: nearly double
    (100, 4, 100 * GiB / 4 / 32, 4 * 32 * GiB),  # 0.78 GiB tensors → 1 GiB
])
def test_native_per_worker_tensors(cpu_gib, tp, per_tensor, pinned):
    p = native_pinned(L31_8B, tp, cpu_gib * GiB, 2 * 32 * max(1, 8 // tp) * 128 * 2)
    assert p.tensor_bytes == per_tensor and p.total == pinned == cpu_term(native(L31_8B, cpu_gib, tp))


def test_native_fp8_kv_halves_pages_not_the_pinned_bytes():
    p = native_pinned(L31_8B, 1, 40 * GiB, 2 * 32 * 8 * 128 * 1)
    assert p.num_blocks == 2 * 20480 and p.tensor_bytes == 1.25 * GiB and p.total == 64 * GiB
    assert cpu_term(native(L31_8B, 40, kv_dtype="fp8")) == 64 * GiB


def test_native_hybrid_models_are_charged_the_bound():
    hybrid = dataclasses.replace(L31_8B, sliding_window=4096, sliding_window_layers=16)
    p = native_pinned(hybrid, 1, 40 * GiB, 2 * 32 * 8 * 128 * 2)
    assert not p.exact and p.total == 80 * GiB  # 2 × the tier: a power-of-two ceiling is < 2 × its argument
    everywhere = dataclasses.replace(L31_8B, sliding_window=4096, sliding_window_layers=32)  # Mistral v0.1: one group
    assert native_pinned(everywhere, 1, 40 * GiB, 2 * 32 * 8 * 128 * 2).total == 64 * GiB


def test_native_suggested_sizes_pin_no_more_than_their_size():
    # The warning's lower and upper sizes for a 28-layer model (not a power of two of layers).
    m = dataclasses.replace(L31_8B, layers=28)
    bpt = 2 * 28 * 8 * 128 * 2
    p = native_pinned(m, 1, 40 * GiB, bpt)
    low, high = 28 * p.allocated_bytes // 2, 28 * p.allocated_bytes
    assert (low, high) == (28 * GiB, 56 * GiB)
    for size in (low, high):
        assert native_pinned(m, 1, size, bpt).total == size


def test_native_cpu_bytes_matches_the_rendered_flag():
    # vLLM reads --kv-offloading-size as GiB (a float, 6 decimals as rendered) × 2**30.
    assert native_cpu_bytes(40 * GiB) == 40 * GiB
    assert native_cpu_bytes(int(1.5 * GiB) + 1) == int(round((1.5 * GiB + 1) / GiB, 6) * 2**30)
    assert [power_of_two_ceil(n) for n in (0, 1, 2, 3, 1023, 1024, 1025)] == [0, 1, 2, 4, 1024, 1024, 2048]


def test_server_limit_holds_the_l1_its_request_does_not():
    b = plan(PlanInput(L31_8B, 8192, gpu_memory=141 * GiB, cpu_size=40 * GiB, backend="lmcache-server"))
    assert b.server_memory == 3 * GiB and b.server_memory_limit == 43 * GiB
    cpu = next(t.bytes for t in b.memory_terms if t.name == "cpu_tier")
    assert cpu == 40 * GiB  # requested once, in the vLLM container
    assert b.to_dict()["serverMemory"]["limit"] == 43 * GiB and b.to_dict()["serverMemory"]["request"] == 3 * GiB
