"""A carried engine pair loads on this GPU host, before any engine starts (dev.sh check PAIR): seconds, not an
engine start-up, for what would otherwise fail minutes into a bench.

  PYTHONPATH=/opt/kvimage/serving-PAIR/site python3 check_pair.py PAIR EXTENSION_CHECK_PY

Exits non-zero when a hard check fails: vLLM, LMCache or torch is not the version the pair pins (torch: vLLM's
own pin), torch does not see the GPU or a CUDA library it binds does not load, a Triton kernel does not compile
and run, vLLM does not pick FlashAttention 3, a module `vllm serve` imports on this path does not import
(SERVING_PATH), LMCache's extension does not load (images/serving/extension_check.py, the serving image's own
check). Reports, without failing: the CUDA libraries as loaded (carried or the host's), cuDNN's runtime against
torch's build, and the requirements of the carried distributions that host + carried site leave unmet (a
`pip check` over both). NO_GPU=1 (offline_check.sh, on a machine without one) skips what needs the GPU.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import os
import re
import runpy
import sys
import time

# What `vllm serve` of the rendered example imports (API server, engine core, the V1 runner the operator picks,
# Llama with random weights, FlashAttention, LMCache's connector and CLI).
SERVING_PATH = (
    "vllm.entrypoints.cli.main", "vllm.entrypoints.openai.api_server", "vllm.v1.engine.core",
    "vllm.v1.engine.async_llm",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner", "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader.dummy_loader", "vllm.v1.attention.backends.flash_attn",
    "vllm.vllm_flash_attn.flash_attn_interface", "vllm.compilation.backends", "vllm.v1.sample.sampler",
    "vllm.v1.core.sched.scheduler", "vllm.v1.metrics.prometheus",
    "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector", "lmcache.integration.vllm.vllm_v1_adapter",
    "lmcache.v1.cache_engine", "lmcache.cli.main",
)
PAIR = sys.argv[1]
VLLM, LMCACHE = PAIR.split("-")
NO_GPU = os.environ.get("NO_GPU") == "1"
key = lambda s: re.sub(r"[-_.]+", "-", s).lower()  # noqa: E731
failures: list[str] = []


def check(name: str, fn) -> None:
    try:
        print(f"ok   {name}: {fn()}", flush=True)
    except BaseException as exc:  # noqa: BLE001  (each failure is reported; the exit code sums them up)
        failures.append(name)
        print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:600]}", flush=True)


def versions() -> str:
    import torch
    from packaging.requirements import Requirement

    assert md.version("vllm") == VLLM and md.version("lmcache") == LMCACHE, (md.version("vllm"), md.version("lmcache"))
    pin = next(Requirement(r).specifier for r in md.requires("vllm") if key(Requirement(r).name) == "torch")
    assert torch.__version__.split("+")[0] in pin, f"torch {torch.__version__} imported, vLLM {VLLM} pins {pin}"
    return (f"vllm {VLLM}, lmcache {LMCACHE}, torch {torch.__version__} (vLLM pins {pin}) "
            f"from {os.path.dirname(torch.__file__)}")


def gpu() -> str:
    import torch

    assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
    x = torch.ones(256, 256, device="cuda", dtype=torch.bfloat16)
    assert float((x @ x)[0, 0]) == 256.0  # cuBLAS
    return (f"{torch.cuda.get_device_name(0)} {torch.cuda.get_device_capability(0)}, bf16 matmul ok, "
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")


def triton_kernel() -> str:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add(x, y, out, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + i, tl.load(x + i, mask=i < n) + tl.load(y + i, mask=i < n), mask=i < n)

    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    add[(4,)](x, x, out, 1000, BLOCK=256)
    assert torch.equal(out, 2 * x)
    return f"triton {triton.__version__}: a kernel compiled (its ptxas) and ran"


def flash_attention() -> str:
    from vllm.vllm_flash_attn import flash_attn_interface as fai

    assert fai.FA3_UNAVAILABLE_REASON is None, f"FA3 does not load: {fai.FA3_UNAVAILABLE_REASON}"
    if NO_GPU:
        return "FA3's extension loads (FA2: " + str(fai.FA2_UNAVAILABLE_REASON)[:80] + ")"
    from vllm.v1.attention.backends.fa_utils import flash_attn_supports_kv_cache_dtype, get_flash_attn_version

    fa = get_flash_attn_version(head_size=128)
    assert fa == 3, f"vLLM picks FlashAttention {fa} here (the carried site has FA3 only)"
    return f"vLLM picks FlashAttention {fa}, fp8 KV cache {flash_attn_supports_kv_cache_dtype('fp8')}"


def serving_path() -> str:
    for m in SERVING_PATH:
        importlib.import_module(m)
    return f"{len(SERVING_PATH)} modules import"


def cuda_libraries() -> str:
    import torch

    c = torch._C._cudnn
    run, built = c.getRuntimeVersion(), c.getCompileVersion()
    older = " (older: torch refuses it only when a cuDNN op runs; a Llama forward runs none)"
    note = "" if run[:2] >= built[:2] else older
    libs = sorted({ln.split()[-1] for ln in open("/proc/self/maps")
                   if re.search(r"/lib(cu|nccl|nvrtc|nvJit|nvshmem)[^/]*\.so", ln)})
    return f"cuDNN runtime {run}, built with {built}{note}; loaded: {' '.join(libs)}"


def unmet() -> str:
    """Requirements of the carried site's distributions (first PYTHONPATH entry) that nothing installed satisfies."""
    from packaging.requirements import Requirement

    site = os.environ["PYTHONPATH"].split(":")[0]
    have: dict[str, str] = {}
    for d in md.distributions():  # the first on sys.path wins, as imports do
        have.setdefault(key(d.metadata["Name"]), d.version)
    out = set()
    for d in md.distributions(path=[site]):
        for r in d.requires or []:
            req = Requirement(r)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            v = have.get(key(req.name))
            if v is None or (req.specifier and not req.specifier.contains(v, prereleases=True)):
                out.add(f"{d.metadata['Name']} {d.version} needs {req.name}{req.specifier}: {v or 'absent'}")
    return f"{len(out)}" + "".join(f"\n       {line}" for line in sorted(out))


t0 = time.monotonic()
check("versions", versions)
if not NO_GPU:
    check("gpu", gpu)
    check("triton", triton_kernel)
check("flash attention", flash_attention)
check("serving path", serving_path)
check("lmcache extension (extension_check.py)", lambda: runpy.run_path(sys.argv[2], run_name="__main__") and "loads")
for name, fn in (("info cuda libraries", cuda_libraries), ("info unmet requirements", unmet)):
    try:
        print(f"{name}: {fn()}", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: not computed ({type(exc).__name__}: {exc})", flush=True)
print(json.dumps({"pair": PAIR, "failures": failures, "no_gpu": NO_GPU, "seconds": round(time.monotonic() - t0, 1)}))
sys.exit(1 if failures else 0)
