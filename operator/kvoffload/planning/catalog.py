"""Built-in model catalog: the architecture facts KV-cache sizing needs, keyed by Hugging Face id.

Every entry copies its model's HF `config.json` (num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim or hidden_size / heads, sliding_window). Parameter counts are
the exact totals of the safetensors weights; each one was re-derived from the same config
(vocab, hidden, intermediate, tied embeddings, biases) and matches the published figure.
Lookup is case-insensitive; anything else comes from explicit overrides or a local config.json.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from ..api.errors import InputError


@dataclass(frozen=True)
class ModelArch:
    hf_id: str
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    params: int
    sliding_window: int | None = None
    sliding_window_layers: int = 0  # how many of `layers` attend only to the last `sliding_window` tokens
    max_context: int | None = None  # max_position_embeddings: vLLM's default (and largest) max_model_len
    attention: Literal["standard", "mla"] = "standard"
    source: str = ""  # where the numbers come from

    @property
    def full_layers(self) -> int:
        return self.layers - self.sliding_window_layers


def _m(hf_id: str, layers: int, heads: int, kv: int, params: int, context: int, head_dim: int = 128,
       window: int | None = None, window_layers: int = 0) -> ModelArch:
    return ModelArch(hf_id, layers, heads, kv, head_dim, params, window, window_layers, context,
                     source=f"https://huggingface.co/{hf_id}/blob/main/config.json")


def _family(ids: tuple[str, ...], *args: Any, **kwargs: Any) -> list[ModelArch]:
    return [_m(i, *args, **kwargs) for i in ids]


def _qwen25(base: str, layers: int, heads: int, kv: int, params: int) -> list[ModelArch]:
    return [_m(base, layers, heads, kv, params, 131072), _m(f"{base}-Instruct", layers, heads, kv, params, 32768)]


_ENTRIES: list[ModelArch] = [
    # Llama-2: no GQA below 70B. 7b: hidden 4096, 32 layers, 32 heads, 32 KV heads.
    *_family(("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-chat-hf"), 32, 32, 32, 6_738_415_616, 4096),
    # 13b: hidden 5120, 40 layers, 40 heads, 40 KV heads.
    *_family(("meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-13b-chat-hf"), 40, 40, 40, 13_015_864_320, 4096),
    # 70b: hidden 8192, 80 layers, 64 heads, 8 KV heads.
    *_family(("meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-chat-hf"), 80, 64, 8, 68_976_648_192, 4096),
    # Llama-3 / 3.1 8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, vocab 128256.
    # max_position_embeddings: Llama-3 8192, Llama-3.1 / 3.3 131072.
    *_family(("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct"), 32, 32, 8, 8_030_261_248, 8192),
    *_family(("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct",
              "meta-llama/Meta-Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B-Instruct"),
             32, 32, 8, 8_030_261_248, 131072),
    # Llama-3 / 3.1 / 3.3 70B: hidden 8192, 80 layers, 64 heads, 8 KV heads.
    *_family(("meta-llama/Meta-Llama-3-70B", "meta-llama/Meta-Llama-3-70B-Instruct"), 80, 64, 8, 70_553_706_496, 8192),
    *_family(("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct",
              "meta-llama/Meta-Llama-3.1-70B", "meta-llama/Meta-Llama-3.1-70B-Instruct",
              "meta-llama/Llama-3.3-70B-Instruct"),
             80, 64, 8, 70_553_706_496, 131072),
    # Llama-3.1 405B: hidden 16384, 126 layers, 128 heads, 8 KV heads.
    *_family(("meta-llama/Llama-3.1-405B", "meta-llama/Llama-3.1-405B-Instruct",
              "meta-llama/Meta-Llama-3.1-405B", "meta-llama/Meta-Llama-3.1-405B-Instruct"),
             126, 128, 8, 405_853_388_800, 131072),
    # Mistral 7B v0.1: hidden 4096, 32 layers, 32 heads, 8 KV heads, "sliding_window": 4096 on every layer.
    *_family(("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.1"),
             32, 32, 8, 7_241_732_096, 32768, window=4096, window_layers=32),
    # v0.2 drops the window ("sliding_window": null); v0.3 also grows the vocab to 32768.
    _m("mistralai/Mistral-7B-Instruct-v0.2", 32, 32, 8, 7_241_732_096, 32768),
    *_family(("mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"), 32, 32, 8, 7_248_023_552, 32768),
    # Mixtral 8x7B: hidden 4096, 32 layers, 32 heads, 8 KV heads, 8 experts, "sliding_window": null.
    *_family(("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"), 32, 32, 8, 46_702_792_704, 32768),
    # Qwen2.5 ("use_sliding_window": false, so the 131072 sliding_window value is inert); base models have
    # max_position_embeddings 131072, -Instruct 32768 (longer needs a YaRN rope_scaling override).
    # 7B: hidden 3584, 28 layers, 28 heads, 4 KV heads.
    *_qwen25("Qwen/Qwen2.5-7B", 28, 28, 4, 7_615_616_512),
    # 14B: hidden 5120, 48 layers, 40 heads, 8 KV heads.
    *_qwen25("Qwen/Qwen2.5-14B", 48, 40, 8, 14_770_033_664),
    # 32B: hidden 5120, 64 layers, 40 heads, 8 KV heads.
    *_qwen25("Qwen/Qwen2.5-32B", 64, 40, 8, 32_763_876_352),
    # 72B: hidden 8192, 80 layers, 64 heads, 8 KV heads.
    *_qwen25("Qwen/Qwen2.5-72B", 80, 64, 8, 72_706_203_648),
    # Qwen3 ("head_dim": 128 explicit). 8B: 36 layers, 32 heads, 8 KV heads. 32B: 64 layers, 64 heads, 8 KV.
    _m("Qwen/Qwen3-8B", 36, 32, 8, 8_190_735_360, 40960),
    _m("Qwen/Qwen3-32B", 64, 64, 8, 32_762_123_264, 40960),
    # Gemma-2: "sliding_window": 4096 on every other layer (even layer indices are local).
    # 9b: 42 layers, 16 heads, 8 KV heads, "head_dim": 256.
    *_family(("google/gemma-2-9b", "google/gemma-2-9b-it"), 42, 16, 8, 9_241_705_984, 8192,
             head_dim=256, window=4096, window_layers=21),
    # 27b: 46 layers, 32 heads, 16 KV heads, "head_dim": 128.
    *_family(("google/gemma-2-27b", "google/gemma-2-27b-it"), 46, 32, 16, 27_227_128_320, 8192,
             window=4096, window_layers=23),
]

CATALOG: dict[str, ModelArch] = {m.hf_id.lower(): m for m in _ENTRIES}


def lookup(model_id: str) -> ModelArch | None:
    return CATALOG.get(model_id.strip().lower())


def known_models() -> list[str]:
    return sorted(m.hf_id for m in _ENTRIES)


def _read_config(path: str, hf_id: str) -> dict[str, Any]:
    """Architecture fields of a local HF config.json (never fetched over the network)."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError("config_json", f"cannot read {path!r} as an HF config.json: {exc}") from None
    if not isinstance(cfg, dict):
        raise InputError("config_json", f"{path!r} is not a JSON object")
    cfg = cfg.get("text_config") or cfg  # multimodal configs nest the language model
    out: dict[str, Any] = {"hf_id": hf_id, "source": path}
    if cfg.get("kv_lora_rank"):  # DeepSeek-style multi-head latent attention
        out["attention"] = "mla"
    layers, heads = cfg.get("num_hidden_layers"), cfg.get("num_attention_heads")
    if layers is not None:
        out["layers"] = layers
    if heads is not None:
        out["attention_heads"] = heads
        out["kv_heads"] = cfg.get("num_key_value_heads") or heads  # absent = no GQA
    if cfg.get("head_dim"):
        out["head_dim"] = cfg["head_dim"]
    elif heads and cfg.get("hidden_size"):
        out["head_dim"] = cfg["hidden_size"] // heads
    if cfg.get("max_position_embeddings"):
        out["max_context"] = cfg["max_position_embeddings"]
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True) and layers:
        out["sliding_window"] = window
        if isinstance(cfg.get("layer_types"), list):
            out["sliding_window_layers"] = sum(t == "sliding_attention" for t in cfg["layer_types"])
        elif cfg.get("model_type") == "gemma2":  # layers 0, 2, 4, ... are local
            out["sliding_window_layers"] = (layers + 1) // 2
        elif cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:
            out["sliding_window_layers"] = max(0, layers - cfg["max_window_layers"])  # Qwen2: the rest use SWA
        else:
            out["sliding_window_layers"] = layers
        if not out["sliding_window_layers"]:
            out["sliding_window"] = None
    return out


def _positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(key, f"must be a positive integer, got {value!r}")
    return value


def resolve_model(model_id: str, *, layers: int | None = None, kv_heads: int | None = None,
                  attention_heads: int | None = None, head_dim: int | None = None,
                  params: int | None = None, config_json: str | None = None) -> ModelArch:
    """Catalog entry, then a local config.json, then explicit overrides (each wins over the last)."""
    if not model_id or not model_id.strip():
        raise InputError("model", "must name a model (a Hugging Face id such as meta-llama/Llama-3.1-8B-Instruct)")
    base = lookup(model_id)
    fields: dict[str, Any] = {} if base is None else asdict(base)
    if config_json:
        fields.update(_read_config(config_json, model_id))
    overrides = {"layers": layers, "kv_heads": kv_heads, "attention_heads": attention_heads,
                 "head_dim": head_dim, "params": params}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    fields.setdefault("hf_id", model_id)
    if "attention_heads" not in fields and "kv_heads" in fields:
        fields["attention_heads"] = fields["kv_heads"]  # no head count given: assume no GQA
    if fields.get("attention") == "mla":  # kept so that sizing can refuse it by name; 0 = not known
        return ModelArch(**{"layers": 0, "attention_heads": 0, "kv_heads": 0, "head_dim": 0, "params": 0, **fields})
    required = {"layers": "layers", "kv_heads": "kvHeads", "head_dim": "headDim", "params": "parameters"}
    missing = [key for key in required if fields.get(key) is None]
    if missing:
        if base is None and not config_json and len(missing) == len(required):
            raise InputError("model", f"{model_id!r} is not in the built-in catalog; set {{architecture}} "
                              "(layers, kvHeads, headDim, parameters) or a config.json; known: "
                              f"{', '.join(known_models())}")
        raise InputError(missing[0], f"{model_id!r} needs {', '.join(required[k] for k in missing)} "
                          "(the catalog and config.json do not give them)")
    for key in (*required, "attention_heads"):
        _positive(fields[key], key)
    arch = ModelArch(**fields)
    if arch.kv_heads > arch.attention_heads or arch.attention_heads % arch.kv_heads:
        raise InputError("kv_heads", f"{arch.kv_heads} KV heads must divide the {arch.attention_heads} attention heads")
    if arch.sliding_window_layers > arch.layers:
        raise InputError("layers", f"{arch.layers} layers, but {arch.sliding_window_layers} are windowed")
    return arch
