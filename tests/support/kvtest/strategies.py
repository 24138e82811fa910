"""Hypothesis strategies for KVOffloadServe specs: well-formed ones the API server would store (`valid_specs`),
and plausible junk (`anything`, `quantities`). The fuzz tests and the engine fidelity tests draw from them."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvoffload.api.settings import Settings

SETTINGS = Settings()

SUFFIXES = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "T", "P", "E", "m", "e3", "e9", "E12", "e400"]
quantities = st.one_of(
    st.builds(lambda n, s: f"{n}{s}", st.integers(0, 4096), st.sampled_from(SUFFIXES)),
    st.builds(lambda n, s: f"{n}{s}", st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False),
              st.sampled_from(SUFFIXES)),
    st.sampled_from(["10 Gi", "-1", "-1Gi", "1e400", "", "Infinity", "NaN", "inf", "0x10", "1.5.5Gi", "1Ki5", " 1Gi",
                     "1Gi\n",
                     "+4Gi", ".5Gi", "5.Gi", "1e-3", "0", "0Gi", "1Pi", "1025Ti", "1Ei"]),
    st.integers(-10, 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**65, 2**65), st.floats(), st.text(max_size=40),
                    quantities)
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                        max_leaves=12)

SMALL_MODELS = ["Qwen/Qwen2.5-7B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-2-7b-hf",
                "mistralai/Mistral-7B-v0.1", "google/gemma-2-9b-it", "Qwen/Qwen3-8B",
                "meta-llama/Llama-3.3-70B-Instruct"]
good_sizes = st.builds(lambda n, s: f"{n}{s}", st.integers(1, 1024), st.sampled_from(["Gi", "Gi", "Mi", "G", "Ti"]))
label_keys = st.sampled_from(["kvoffload.io/nvme", "pool", "nvidia.com/gpu.product", "zone"])
label_values = st.sampled_from(["true", "gpu", "", "NVIDIA-H200", "a.b_c-d"])


@st.composite
def custom_architectures(draw) -> dict[str, int]:
    kv = draw(st.sampled_from([1, 2, 4, 8, 16]))
    return {"layers": draw(st.integers(1, 96)), "attentionHeads": kv * draw(st.sampled_from([1, 2, 4, 8])),
            "kvHeads": kv,
            "headDim": draw(st.sampled_from([64, 128, 256])), "parameters": draw(st.integers(10**6, 3 * 10**10))}


def maybe(draw, key: str, strategy, into: dict[str, Any], p: int = 2) -> None:
    """Set `key` with probability 1/p."""
    if draw(st.integers(0, p - 1)) == 0:
        into[key] = draw(strategy)


@st.composite
def valid_specs(draw) -> dict[str, Any]:
    """Well-formed specs that the API server would store: most render; the rest fail on what only the operator
    knows (GPU sizing, TP for the model), naming the field."""
    custom = draw(st.integers(0, 4)) == 0
    spec: dict[str, Any] = {"model": {"name": "acme/custom-model" if custom else draw(st.sampled_from(SMALL_MODELS))},
                            "engine": {"maxModelLen": draw(st.integers(16, 65536))},
                            "offload": {"cpu": {"size": draw(good_sizes)}}}
    model, engine, offload = spec["model"], spec["engine"], spec["offload"]
    if custom:
        model["architecture"] = draw(custom_architectures())
    maybe(draw, "kvDtype", st.sampled_from(["auto", "bf16", "fp8"]), model, 3)
    maybe(draw, "servedName", st.sampled_from(["llama", "my-model", "1e3"]), model, 3)
    maybe(draw, "hfTokenSecret", st.sampled_from([{"name": "hf"}, {"name": "hf.token", "key": "tok_en"}]), model, 3)
    maybe(draw, "cache", st.sampled_from([{"claimName": "models"}, {"claimName": "models", "readOnly": True}]), model,
          3)
    maybe(draw, "replicas", st.integers(0, 1000), spec, 3)
    maybe(draw, "tensorParallelSize", st.sampled_from([1, 2, 4, 8]), engine)
    maybe(draw, "gpuMemoryUtilization", st.floats(min_value=0.5, max_value=1.0), engine, 3)
    maybe(draw, "maxNumSeqs", st.integers(1, 1024), engine, 3)
    maybe(draw, "dtype", st.sampled_from(["auto", "bfloat16", "float16"]), engine, 3)
    maybe(draw, "extraArgs", st.lists(st.sampled_from(["--enforce-eager", "--enable-prefix-caching",
                                                       "--trust-remote-code",
                                                       "--max-num-batched-tokens=8192", "--seed=7"]), max_size=3),
          engine, 3)
    maybe(draw, "env", st.lists(st.sampled_from([{"name": "VLLM_LOGGING_LEVEL", "value": "INFO"},
                                                 {"name": "HF_HUB_OFFLINE", "value": "1"},
                                                 {"name": "FROM_SECRET",
                                                  "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]),
                                max_size=3), engine, 3)
    if draw(st.integers(0, 3)) == 0:
        engine.update(image="registry.example/custom:1", vllmVersion="0.26.0", lmcacheVersion="0.5.3")
    maybe(draw, "chunkSize", st.integers(16, 8192), offload, 3)
    maybe(draw, "evictionPolicy", st.sampled_from(["LRU", "LFU", "FIFO", "MRU"]), offload["cpu"], 3)
    if draw(st.booleans()):
        disk: dict[str, Any] = {"size": draw(good_sizes)}
        if draw(st.integers(0, 3)):
            disk["path"] = draw(st.builds(lambda root, sub: f"{root}/{sub}",
                                          st.sampled_from(SETTINGS.allowed_disk_roots),
                                          st.from_regex(r"[a-z0-9_-][a-z0-9._-]{0,11}"
                                                        r"(/[a-z0-9_-][a-z0-9._-]{0,11}){0,2}",
                                                        fullmatch=True)))
        else:
            disk["storageClassName"] = draw(st.sampled_from(["local-nvme", "nvme.example.com"]))
        maybe(draw, "reclaimPolicy", st.sampled_from(["Delete", "Retain"]), disk, 3)
        maybe(draw, "nodeSelector", st.dictionaries(label_keys, label_values, max_size=2), disk, 3)
        offload["disk"] = disk
    resources: dict[str, Any] = {}
    maybe(draw, "gpuMemory", st.sampled_from(["24Gi", "48Gi", "80Gi", "141Gi", "192Gi"]), resources, 1)
    maybe(draw, "gpuResourceName", st.sampled_from(["nvidia.com/gpu", "amd.com/gpu", "gpu.intel.com/i915"]), resources,
          4)
    maybe(draw, "cpu", st.sampled_from(["4", "500m", "16", "1.5"]), resources, 4)
    maybe(draw, "memory", st.just("1Pi"), resources, 6)
    for term in ("engineBaseline", "perWorkerOverhead", "stagingPerWorker"):
        maybe(draw, term, st.one_of(st.just("0"), good_sizes), resources, 5)
    maybe(draw, "shm", good_sizes, resources, 5)
    maybe(draw, "headroomPercent", st.integers(0, 100), resources, 5)
    spec["resources"] = resources
    if draw(st.integers(0, 2)) == 0:
        scheduling: dict[str, Any] = {}
        maybe(draw, "nodeSelector", st.dictionaries(st.sampled_from(["pool", "zone"]), label_values, max_size=2),
              scheduling)
        maybe(draw, "tolerations", st.just([{"key": "gpu", "operator": "Exists"}]), scheduling)
        maybe(draw, "affinity", st.just({"nodeAffinity": {}}), scheduling)
        maybe(draw, "priorityClassName", st.sampled_from(["serving", "high.priority"]), scheduling)
        maybe(draw, "topologySpreadConstraints", st.sampled_from([[], [{"maxSkew": 1, "topologyKey": "zone",
                                                                        "whenUnsatisfiable": "DoNotSchedule"}]]),
              scheduling)
        spec["scheduling"] = scheduling
    maybe(draw, "metrics",
          st.fixed_dictionaries({}, optional={"enabled": st.booleans(), "port": st.integers(1024, 65535)}), spec, 3)
    namespaces = st.lists(st.sampled_from(["gateway", "apps", "monitoring", "team-a"]), max_size=3, unique=True)
    maybe(draw, "networkPolicy", st.fixed_dictionaries({}, optional={"servingFrom": namespaces,
                                                                     "metricsFrom": namespaces}), spec, 3)
    return spec
