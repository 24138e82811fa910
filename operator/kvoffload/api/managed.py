"""What the operator decides in the serving pod, so no spec may override it: environment variables
(each with why) and the ports the pod's own containers listen on (each with who listens).

The CRD's CEL rules and the parser both read these tables (api/rules.py), so a variable or port added
here is refused by the API server and by the operator with the same reason.
"""

from __future__ import annotations

from ..engine import images

# The serving pod's ports (rendering/render.py listens on these).
HTTP_PORT = 8000  # vLLM's OpenAI API and /metrics
SERVER_ZMQ_PORT = 5555  # backend lmcache-server: the LMCache server's ZMQ socket on 127.0.0.1
SERVER_HTTP_PORT = 8081  # backend lmcache-server: its /healthcheck and /status; not /metrics in 0.5.3
PORTS: dict[int, str] = {
    HTTP_PORT: "the vllm container's port (vLLM's OpenAI API and /metrics)",
    SERVER_ZMQ_PORT: "the lmcache-server container's ZMQ port (vLLM's LMCacheMPConnector talks to it)",
    SERVER_HTTP_PORT: "the lmcache-server container's HTTP port (/healthcheck, /status)",
}

_GPUS = ("the operator decides which GPUs the container sees: the device plugin hands it the "
         "spec.resources.gpuResourceName GPUs it requested (spec.engine.tensorParallelSize), and this variable would "
         "show it others or hide its own")
_PATHS = ("the operator decides where the engine's weights, caches and temporary files go: on the pod's volumes, sized "
          "and counted in its ephemeral-storage request (status.budget.weights), as the root file system is read-only")
_OWN = "the operator sets it for every pod"

# Why each variable is the operator's. Groups: the operator's own wiring; which GPUs the container sees (read by
# the NVIDIA container toolkit, CUDA, ROCm); where files go (read by vLLM, huggingface_hub, transformers, torch,
# Triton, FlashInfer and Python's tempfile; rendering/pod_security.engine_env sets the ones that need a value).
ENV: dict[str, str] = {
    "LMCACHE_CONFIG_FILE": _OWN + " (LMCache's configuration, rendered from spec.offload)",
    "PYTHONHASHSEED": _OWN + ": the same value in every rank and replica, or "
                             "LMCache's chunk hashes differ and hits drop to zero",
    "PROMETHEUS_MULTIPROC_DIR": _OWN + ": vLLM and LMCache share it with the exporter for LMCache's metrics",
    "LMCACHE_USE_EXPERIMENTAL": _OWN + " (LMCache's engine, rendered from spec.offload)",
    "POD_NAME": "it expands the disk tier's subPathExpr: another value would mount another pod's directory",
    "POD_NAMESPACE": "it expands the disk tier's subPathExpr: another value would mount another pod's directory",
    "VLLM_API_KEY": "it comes from spec.engine.apiKeySecretRef only, never a literal in the pod spec",
    **{name: "Hugging Face tokens come from spec.model.hfTokenSecret "
             "only, never a literal in the pod spec or a path to a file"
       for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH")},
    "VLLM_SERVER_DEV_MODE": "it serves vLLM's development endpoints (/collective_rpc, /sleep, /reset_prefix_cache, "
                            "...), which the API key does not guard (only /v1, /v2 and /inference are)",
    **images.ENGINE_ENV_WHY,
    **{name: _GPUS for name in (
        "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
        "NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES", "NVIDIA_REQUIRE_CUDA", "NVIDIA_DISABLE_REQUIRE",
        "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")},
    **{name: _PATHS for name in (
        "HOME", "USER", "TMPDIR", "TMP", "TEMP", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
        "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ASSETS_CACHE", "HUGGINGFACE_ASSETS_CACHE",
        "HF_XET_CACHE",
        "HF_MODULES_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE",
        "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "VLLM_ASSETS_CACHE", "VLLM_RPC_BASE_PATH", "VLLM_MEDIA_CACHE",
        "VLLM_LORA_RESOLVER_CACHE_DIR", "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", "VLLM_XLA_CACHE_PATH",
        "VLLM_DEBUG_DUMP_PATH",
        "TORCHINDUCTOR_CACHE_DIR", "TORCH_HOME", "TORCH_EXTENSIONS_DIR", "CUDA_CACHE_PATH",
        "TRITON_HOME", "TRITON_CACHE_DIR", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR",
        "FLASHINFER_WORKSPACE_BASE", "FLASHINFER_CACHE_DIR", "FLASHINFER_CUBIN_DIR", "FLASHINFER_AUTOTUNE_DIR",
        "FLASHINFER_DUMP_DIR", "FLASHINFER_TRACE_DUMP_DIR")},
}
ENV_PREFIX = "LMCACHE_"
ENV_PREFIX_WHY = "LMCACHE_* configure LMCache, which the operator renders from spec.offload (put engine settings there)"


# Families the operator owns unless the cluster admin allows a name (operator config allowedNvidiaEnv): the operator
# refuses them, the API server cannot (it does not know the setting).
ADMIN_PREFIXES: dict[str, str] = {
    "NVIDIA_": "the NVIDIA container runtime reads NVIDIA_* to add host devices and libraries to the container "
               "(NVIDIA_MOFED, NVIDIA_GDS, NVIDIA_GDRCOPY, NVIDIA_NVSWITCH, NVIDIA_IMEX_CHANNELS, ...): the cluster "
               "admin decides (operator config allowedNvidiaEnv)",
}


def admin_env_why(name: str, allowed: tuple[str, ...]) -> str | None:
    """Why a name of an admin-decided family is refused, or None when it is not one or the admin allowed it."""
    if name in allowed:
        return None
    return next((why for prefix, why in ADMIN_PREFIXES.items() if name.startswith(prefix)), None)


def env_why(name: str) -> str | None:
    """Why the operator owns the variable `name`, or None when a spec may set it."""
    return ENV.get(name) or (ENV_PREFIX_WHY if name.startswith(ENV_PREFIX) else None)
