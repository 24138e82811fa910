"""The built-in catalog against config.json facts, and resolve_model's precedence and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.api.errors import ConfigError
from kvoffload.api.spec import PLAN_FIELDS
from kvoffload.planning.catalog import CATALOG, ModelArch, known_models, lookup, resolve_model

REQUIRED_IDS = [
    "meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-chat-hf", "meta-llama/Llama-2-13b-hf",
    "meta-llama/Llama-2-13b-chat-hf", "meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-chat-hf",
    "meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct", "meta-llama/Meta-Llama-3-70B",
    "meta-llama/Meta-Llama-3-70B-Instruct", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct",
    "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-405B",
    "meta-llama/Llama-3.1-405B-Instruct", "meta-llama/Llama-3.3-70B-Instruct",
    "mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-Instruct-v0.1",
    "mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-14B", "Qwen/Qwen2.5-14B-Instruct",
    "Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-32B-Instruct", "Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-72B-Instruct",
    "Qwen/Qwen3-8B", "Qwen/Qwen3-32B",
    "google/gemma-2-9b", "google/gemma-2-9b-it", "google/gemma-2-27b", "google/gemma-2-27b-it",
]


@pytest.mark.parametrize("hf_id", REQUIRED_IDS)
def test_required_models_present_case_insensitively(hf_id: str) -> None:
    assert lookup(hf_id) is not None
    assert lookup(hf_id.upper()) == lookup(hf_id)
    assert lookup(hf_id).hf_id == hf_id


# Dimensions copied from each config.json: (vocab, hidden, intermediate, layers, heads, kv_heads, head_dim,
# extras). Re-deriving the parameter count from them checks the catalog's shape fields and its count at once.
CONFIGS = {
    "meta-llama/Llama-2-7b-hf": (32000, 4096, 11008, 32, 32, 32, 128, {}),
    "meta-llama/Llama-2-13b-hf": (32000, 5120, 13824, 40, 40, 40, 128, {}),
    "meta-llama/Llama-2-70b-hf": (32000, 8192, 28672, 80, 64, 8, 128, {}),
    "meta-llama/Llama-3.1-8B-Instruct": (128256, 4096, 14336, 32, 32, 8, 128, {}),
    "meta-llama/Llama-3.3-70B-Instruct": (128256, 8192, 28672, 80, 64, 8, 128, {}),
    "meta-llama/Llama-3.1-405B": (128256, 16384, 53248, 126, 128, 8, 128, {}),
    "mistralai/Mistral-7B-Instruct-v0.1": (32000, 4096, 14336, 32, 32, 8, 128, {}),
    "mistralai/Mistral-7B-Instruct-v0.3": (32768, 4096, 14336, 32, 32, 8, 128, {}),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": (32000, 4096, 14336, 32, 32, 8, 128, {"experts": 8}),
    "Qwen/Qwen2.5-7B-Instruct": (152064, 3584, 18944, 28, 28, 4, 128, {"qkv_bias": True}),
    "Qwen/Qwen2.5-14B": (152064, 5120, 13824, 48, 40, 8, 128, {"qkv_bias": True}),
    "Qwen/Qwen2.5-32B-Instruct": (152064, 5120, 27648, 64, 40, 8, 128, {"qkv_bias": True}),
    "Qwen/Qwen2.5-72B": (152064, 8192, 29568, 80, 64, 8, 128, {"qkv_bias": True}),
    "Qwen/Qwen3-8B": (151936, 4096, 12288, 36, 32, 8, 128, {"qk_norm": True}),
    "Qwen/Qwen3-32B": (151936, 5120, 25600, 64, 64, 8, 128, {"qk_norm": True}),
    "google/gemma-2-9b-it": (256000, 3584, 14336, 42, 16, 8, 256, {"tied": True, "norms": 4}),
    "google/gemma-2-27b": (256000, 4608, 36864, 46, 32, 16, 128, {"tied": True, "norms": 4}),
}


def _param_count(vocab: int, h: int, inter: int, layers: int, heads: int, kv: int, hd: int, x: dict) -> int:
    experts = x.get("experts", 1)
    attn = 2 * h * heads * hd + 2 * h * kv * hd
    attn += (heads + 2 * kv) * hd if x.get("qkv_bias") else 0
    attn += 2 * hd if x.get("qk_norm") else 0
    mlp = 3 * h * inter * experts + (h * experts if experts > 1 else 0)  # + router
    return vocab * h * (1 if x.get("tied") else 2) + layers * (attn + mlp + x.get("norms", 2) * h) + h


@pytest.mark.parametrize("hf_id", sorted(CONFIGS))
def test_catalog_matches_config_json(hf_id: str) -> None:
    vocab, h, inter, layers, heads, kv, hd, extras = CONFIGS[hf_id]
    m = lookup(hf_id)
    assert (m.layers, m.attention_heads, m.kv_heads, m.head_dim) == (layers, heads, kv, hd)
    assert m.params == _param_count(vocab, h, inter, layers, heads, kv, hd, extras)


def test_well_known_figures() -> None:
    assert lookup("meta-llama/Llama-3.1-8B-Instruct").params == 8_030_261_248
    assert lookup("meta-llama/Llama-3.1-405B").params == 405_853_388_800
    assert lookup("google/gemma-2-9b").params == 9_241_705_984


def test_sliding_windows_are_exact() -> None:
    v01 = lookup("mistralai/Mistral-7B-Instruct-v0.1")
    assert (v01.sliding_window, v01.sliding_window_layers) == (4096, 32)  # every layer
    for no_window in ("mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen2.5-7B"):
        assert lookup(no_window).sliding_window is None and lookup(no_window).sliding_window_layers == 0
    assert (lookup("google/gemma-2-9b").sliding_window, lookup("google/gemma-2-9b").sliding_window_layers) == (4096, 21)
    assert lookup("google/gemma-2-27b-it").sliding_window_layers == 23  # 46 layers, local/global alternate


@pytest.mark.parametrize("m", list(CATALOG.values()), ids=lambda m: m.hf_id)
def test_every_entry_is_consistent(m: ModelArch) -> None:
    assert m.attention_heads % m.kv_heads == 0
    assert 0 <= m.sliding_window_layers <= m.layers
    assert (m.sliding_window is None) == (m.sliding_window_layers == 0)
    assert m.attention == "standard" and m.hf_id in m.source
    assert m.max_context and m.max_context >= 4096


def test_known_models_sorted_and_complete() -> None:
    assert known_models() == sorted(known_models())
    assert len(known_models()) == len(CATALOG)


def test_overrides_win_over_catalog() -> None:
    m = resolve_model("META-LLAMA/llama-3.1-8b-instruct", layers=40, params=9_000_000_000)
    assert (m.hf_id, m.layers, m.kv_heads, m.params) == ("meta-llama/Llama-3.1-8B-Instruct", 40, 8, 9_000_000_000)


def test_unknown_model_without_architecture_is_refused() -> None:
    with pytest.raises(ConfigError) as exc:
        resolve_model("acme/unknown-13b")
    assert exc.value.named(PLAN_FIELDS).field == "spec.model.name"
    assert "not in the built-in catalog" in exc.value.message
    assert ("spec.model.architecture" in exc.value.named(PLAN_FIELDS).message
            and "meta-llama/Llama-3.1-8B-Instruct" in exc.value.message)


def test_unknown_model_with_full_architecture() -> None:
    m = resolve_model("acme/x", layers=10, kv_heads=2, head_dim=64, params=10**9)
    assert (m.layers, m.kv_heads, m.attention_heads, m.head_dim, m.params) == (10, 2, 2, 64, 10**9)


def test_partial_architecture_names_the_missing_field() -> None:
    with pytest.raises(ConfigError) as exc:
        resolve_model("acme/x", layers=10, kv_heads=2)
    assert exc.value.named(PLAN_FIELDS).field == "spec.model.architecture.headDim"
    assert "parameters" in exc.value.message


@pytest.mark.parametrize("kw, field", [
    ({"layers": 0}, "spec.model.architecture.layers"),
    ({"head_dim": -1}, "spec.model.architecture.headDim"),
    ({"kv_heads": 3}, "spec.model.architecture.kvHeads"),  # 3 does not divide 32 heads
    ({"kv_heads": 64}, "spec.model.architecture.kvHeads"),
])
def test_bad_overrides(kw: dict, field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        resolve_model("meta-llama/Llama-3.1-8B", **kw)
    assert exc.value.named(PLAN_FIELDS).field == field


def _config(tmp_path: Path, **cfg: object) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_config_json_llama_style(tmp_path: Path) -> None:
    # no num_key_value_heads (= no GQA), no head_dim (= hidden / heads)
    path = _config(tmp_path, num_hidden_layers=24, num_attention_heads=16, hidden_size=2048,
                   max_position_embeddings=4096)
    m = resolve_model("local/model", config_json=path, params=1_300_000_000)
    assert (m.layers, m.attention_heads, m.kv_heads, m.head_dim, m.max_context) == (24, 16, 16, 128, 4096)
    assert m.sliding_window is None


def test_config_json_wins_over_catalog_and_overrides_win_over_it(tmp_path: Path) -> None:
    path = _config(tmp_path, num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=4, hidden_size=4096)
    m = resolve_model("meta-llama/Llama-3.1-8B", config_json=path, kv_heads=2)
    assert (m.layers, m.kv_heads, m.params) == (30, 2, 8_030_261_248)


def test_config_json_gemma2_alternates(tmp_path: Path) -> None:
    path = _config(tmp_path, model_type="gemma2", num_hidden_layers=42, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=256, hidden_size=3584, sliding_window=4096)
    m = resolve_model("x/gemma", config_json=path, params=9_241_705_984)
    assert (m.head_dim, m.sliding_window, m.sliding_window_layers) == (256, 4096, 21)


def test_config_json_layer_types_and_disabled_window(tmp_path: Path) -> None:
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 4
    m = resolve_model("x/a", params=1, config_json=_config(
        tmp_path, num_hidden_layers=12, num_attention_heads=8, hidden_size=1024, sliding_window=512, layer_types=types))
    assert (m.sliding_window, m.sliding_window_layers) == (512, 8)
    qwen = resolve_model("x/q", params=1, config_json=_config(
        tmp_path, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_size=3584,
        sliding_window=131072, use_sliding_window=False))
    assert qwen.sliding_window is None and qwen.sliding_window_layers == 0


def test_config_json_mla_is_marked(tmp_path: Path) -> None:
    path = _config(tmp_path, num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512)
    assert resolve_model("deepseek-ai/DeepSeek-V3", config_json=path).attention == "mla"


def test_config_json_unreadable(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    for path in (str(bad), str(tmp_path / "missing.json")):
        with pytest.raises(ConfigError) as exc:
            resolve_model("x/y", config_json=path)
        assert exc.value.key == "config_json"  # no CRD field: `kvoffload plan --config-json` only


def test_config_json_without_params_names_parameters(tmp_path: Path) -> None:
    path = _config(tmp_path, num_hidden_layers=2, num_attention_heads=2, hidden_size=128)
    with pytest.raises(ConfigError) as exc:
        resolve_model("x/y", config_json=path)
    assert exc.value.named(PLAN_FIELDS).field == "spec.model.architecture.parameters"
