"""Fidelity of the vllm-native memory charge (backends/vllm_native.native_pinned) against the pinned engine:
- each rendered vLLM command line through vLLM's own config, then vLLM's own KV cache config,
  build_offloading_config and CPUOffloadingSpec: the per-worker pinned tensor vLLM would allocate
  (num_blocks × page) and how many (one per KV cache tensor) equal the planner's;
- the planner's power-of-two rounding is still what the engine's torch does: its
  CachingHostAllocator header rounds every pinned allocation with PowerOf2Ceil (a torch upgrade
  that changes it fails here).
CPU only: vLLM's config classes run on its CPU platform with the CUDA block size (16) set.
Skipped without the engine venv, unless KVO_REQUIRE_ENGINE=1 makes that a failure."""

from __future__ import annotations

import re

import engine_venv
import pytest

from kvoffload.api.quantity import GiB
from kvoffload.api.settings import Settings
from kvoffload.backends import vllm_native
from kvoffload.controller import pipeline
from kvoffload.rendering import render
from kvtest.specs import LLAMA_CONFIG as LLAMA
from kvtest.specs import spec

# Qwen2.5-7B's config.json fields vLLM reads: 28 layers (not a power of two), 4 KV heads.
QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28}
NATIVE = {"offload__backend": "vllm-native", "offload__disk": None}
CASES = {  # id: (model config, spec patch)
    "llama-40g": (LLAMA, {"offload__cpu__size": "40Gi"}),  # the H200 measurement: 64 GiB pinned
    "llama-40g-tp2": (LLAMA, {"offload__cpu__size": "40Gi", "engine__tensorParallelSize": 2}),
    "llama-32g-fp8": (LLAMA, {"offload__cpu__size": "32Gi", "model__kvDtype": "fp8"}),
    "llama-33.5g-tp4": (LLAMA, {"offload__cpu__size": "33.5Gi", "engine__tensorParallelSize": 4}),
    "qwen-40g": (QWEN, {"offload__cpu__size": "40Gi", "model__name": "Qwen/Qwen2.5-7B-Instruct"}),
}


def desired(patch: dict):
    s = spec(engine__image=engine_venv.IMAGE_026, engine__vllmVersion=engine_venv.PAIR_026.vllm,
             engine__lmcacheVersion=engine_venv.PAIR_026.lmcache, **NATIVE, **patch)
    s["offload"].pop("disk", None)
    return pipeline.desired("svc", "team-a", "", s, Settings())


@pytest.fixture(scope="module")
def venv():
    return engine_venv.require(engine_venv.PAIR_026.vllm, engine_venv.PAIR_026.lmcache)


@pytest.fixture(scope="module")
def engine(venv):
    request = {"vllm": []}
    for case_id, (model_config, patch) in CASES.items():
        vllm = next(c for c in next(c for c in desired(patch).children if c["kind"] == "StatefulSet")
                    ["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
        request["vllm"].append({"id": case_id, "argv": render.vllm_argv(vllm), "model_config": model_config,
                                "native_pinned": {"gpu_kv_bytes": 8 * GiB}})
    out = engine_venv.run(venv, "check", request)
    assert out["versions"]["vllm"] == engine_venv.PAIR_026.vllm
    return {r["id"]: r for r in out["vllm"]}


@pytest.mark.parametrize("case_id", list(CASES))
def test_planner_charges_what_vllm_pins(engine, case_id):
    r = engine[case_id]
    assert r["ok"], r
    v = r["native_pinned"]
    d = desired(CASES[case_id][1])
    b, m, tp = d.budget, d.spec, d.spec.engine.tensor_parallel_size
    p = vllm_native.native_pinned(sizing_model(d), tp, b.tier("cpu").bytes, b.kv_bytes_per_token_per_gpu)
    assert v["world_size"] == tp and v["blocks_per_chunk"] == 1  # the operator sets no block_size
    assert v["gpu_kv_cache_tensors"] == v["layers"] == p.tensors  # one pinned CPU tensor per KV cache tensor
    assert v["page_size_bytes"] == b.kv_bytes_per_token_per_gpu // v["layers"] * vllm_native.NATIVE_BLOCK_TOKENS
    assert (v["num_blocks"], v["tensor_bytes"]) == (p.num_blocks, p.tensor_bytes)
    assert p.allocated_bytes == vllm_native.power_of_two_ceil(v["tensor_bytes"])
    charged = next(t.bytes for t in b.memory_terms if t.name == "cpu_tier")
    assert charged == vllm_native.power_of_two_ceil(v["tensor_bytes"]) * v["gpu_kv_cache_tensors"] * tp
    assert m.offload.cpu_size == b.tier("cpu").bytes


def sizing_model(d):
    from kvoffload.planning.catalog import lookup
    return lookup(d.spec.model.name)


def test_fp8_case_reaches_vllm_as_fp8(engine):
    v = engine["llama-32g-fp8"]["native_pinned"]
    # vLLM stores fp8 KV as one byte per element (torch.uint8): half the bf16 page.
    assert v["kv_dtype"] == "torch.uint8" and v["page_size_bytes"] == 16 * 2 * 8 * 128


def test_the_measured_case(engine):
    # H200, Llama-3.1-8B, TP 1, --kv-offloading-size 40.0: 64.0 GiB pinned at start-up.
    v = engine["llama-40g"]["native_pinned"]
    assert v["tensor_bytes"] == 1.25 * GiB and v["gpu_kv_cache_tensors"] == 32
    assert vllm_native.power_of_two_ceil(v["tensor_bytes"]) * 32 == 64 * GiB


def test_engine_torch_rounds_pinned_allocations_to_a_power_of_two(venv):
    header = engine_venv.site_packages(venv) / "torch" / "include" / "ATen" / "core" / "CachingHostAllocator.h"
    text = header.read_text()
    # The allocation path: round, look in the free list by that size, else allocate that size.
    assert re.search(r"size_t roundSize = c10::llvm::PowerOf2Ceil\(size\);", text), header
    assert "allocate_host_memory(roundSize, &ptr);" in text
