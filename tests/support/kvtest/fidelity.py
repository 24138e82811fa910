"""What the engine fidelity tests hand to vLLM's parser and LMCache's loader for one rendered resource
(tests/engine/test_fidelity.py, and tests/engine/compatibility.py for every example)."""

from __future__ import annotations

import copy

from kvoffload.controller import pipeline
from kvoffload.engine import images
from kvoffload.planning import catalog
from kvoffload.rendering import render

LMCACHE_KEYS = ("chunk_size", "local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size", "cache_policy")


def model_config(spec) -> dict:
    """A Llama-shaped HF config.json with the operator's own architecture figures for the model."""
    arch = catalog.resolve_model(spec.model.name, **{k: v for k, v in {
        "layers": spec.model.architecture.get("layers"), "kv_heads": spec.model.architecture.get("kvHeads"),
        "attention_heads": spec.model.architecture.get("attentionHeads"),
        "head_dim": spec.model.architecture.get("headDim"),
        "params": spec.model.architecture.get("parameters")}.items() if v is not None})
    hidden = arch.attention_heads * arch.head_dim
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": 4 * hidden, "num_hidden_layers": arch.layers,
            "num_attention_heads": arch.attention_heads,
            "num_key_value_heads": arch.kv_heads, "head_dim": arch.head_dim,
            # A custom model's context is the user's to know: take the spec's word for it.
            "max_position_embeddings": arch.max_context or spec.engine.max_model_len,
            "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
            "tie_word_embeddings": False}


def for_image(spec: dict, image: str) -> dict:
    """The spec, run on one of the project's serving images (its pair spelt out): what the operator renders
    for that pair is what that pair's engine venv checks."""
    known = images.KNOWN_IMAGES[image]
    out = copy.deepcopy(spec)
    out.setdefault("engine", {}).update(image=image, vllmVersion=known.vllm, lmcacheVersion=known.lmcache)
    return out


def case(case_id: str, d: pipeline.Desired) -> tuple[dict, dict | None]:
    """The vLLM command line, and the LMCache config (backend lmcache only: the other backends have none;
    tests/engine/test_backends.py checks the LMCache server's command line)."""
    sts = next(c for c in d.children if c["kind"] == "StatefulSet")
    vllm = sts["spec"]["template"]["spec"]["containers"][0]
    cm = next((c for c in d.children if c["kind"] == "ConfigMap"), None)
    env = {e["name"]: e["value"] for e in vllm["env"] if "value" in e}
    return ({"id": case_id, "argv": render.vllm_argv(vllm), "env": env, "model_config": model_config(d.spec)},
            {"id": case_id, "text": cm["data"]["lmcache.yaml"], "keys": list(LMCACHE_KEYS)} if cm else None)
