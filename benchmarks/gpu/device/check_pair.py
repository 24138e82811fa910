"""A carried engine pair loads on this GPU host, before any engine starts (dev.sh check PAIR): seconds, not an
engine start-up, for what would otherwise fail minutes into a bench.

  PYTHONPATH=/opt/kvimage/serving-PAIR/site python3 check_pair.py PAIR EXTENSION_CHECK_PY

Exits non-zero when a hard check fails: the versions are not the pair's, torch does not see the GPU, a CUDA
library the carried torch binds is not found, vLLM's CUDA platform or FlashAttention 3 does not load, a Triton
kernel does not compile and run, LMCache's extension does not load (images/serving/extension_check.py, the
serving image's own check). Reports, without failing: the CUDA libraries as loaded (carried or the host's),
the requirements of the carried distributions that the host + carried site leave unmet (a `pip check` over
both), and cuDNN's runtime against torch's build.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import runpy
import sys
import time

PAIR = sys.argv[1]
VLLM, LMCACHE = PAIR.split("-")
failures: list[str] = []
t0 = time.monotonic()


def check(name: str, fn):
    try:
        value = fn()
        print(f"ok   {name}: {value}")
        return value
    except BaseException as exc:  # noqa: BLE001  (every failure is reported, then the exit code says)
        failures.append(name)
        print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:600]}")
        return None


import torch  # noqa: E402

check("torch", lambda: f"{torch.__version__} from {torch.__file__}, CUDA {torch.version.cuda}")
check("cuda", lambda: f"{torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}"
      if torch.cuda.is_available() else (_ for _ in ()).throw(RuntimeError("torch.cuda.is_available() is False")))
check("nccl", lambda: ".".join(map(str, torch.cuda.nccl.version())))
check("cublas matmul", lambda: float((torch.ones(256, 256, device="cuda", dtype=torch.bfloat16) @
                                      torch.ones(256, 256, device="cuda", dtype=torch.bfloat16))[0, 0]))


def cudnn() -> str:
    c = torch._C._cudnn
    run, built = c.getRuntimeVersion(), c.getCompileVersion()
    note = "" if run[:2] >= built[:2] else " (older than built with: torch refuses it when a cuDNN op runs; a Llama forward runs none)"
    return f"runtime {run}, built with {built}{note}"


print(f"info cudnn: {cudnn()}")


def loaded_cuda_libs() -> str:
    libs = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if re.search(r"/lib(cu|nccl|nvrtc|nvJit|nvshmem)[^/]*\.so", ln)})
    return " ".join(libs)


print(f"info loaded CUDA libraries: {loaded_cuda_libs()}")


def triton_kernel() -> str:
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
    return f"triton {triton.__version__}: a kernel compiled (ptxas) and ran"


check("triton", triton_kernel)


def vllm_platform() -> str:
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.fa_utils import flash_attn_supports_kv_cache_dtype, get_flash_attn_version

    assert vllm.__version__ == VLLM, f"vllm {vllm.__version__}, not {VLLM}"
    fa = get_flash_attn_version(head_size=128)
    assert fa == 3, f"vLLM picks FlashAttention {fa} on this GPU (the carried site has FA3 only)"
    return (f"vllm {vllm.__version__}, platform {type(current_platform).__name__}, FlashAttention {fa}, "
            f"fp8 KV cache {flash_attn_supports_kv_cache_dtype('fp8')}")


check("vllm", vllm_platform)


def lmcache() -> str:
    from lmcache.integration.vllm import vllm_v1_adapter  # noqa: F401  (the connector vLLM loads)

    assert md.version("lmcache") == LMCACHE, f"lmcache {md.version('lmcache')}, not {LMCACHE}"
    return f"lmcache {md.version('lmcache')}: vllm_v1_adapter imports"


check("lmcache", lmcache)
check("lmcache extension (extension_check.py)", lambda: runpy.run_path(sys.argv[2], run_name="__main__") and "loaded")


def unmet() -> list[str]:
    """Requirements of the distributions in the carried site (PYTHONPATH) that nothing installed satisfies."""
    from packaging.requirements import Requirement

    site = os.environ["PYTHONPATH"].split(":")[0]
    env = {"extra": ""}
    key = lambda s: re.sub(r"[-_.]+", "-", s).lower()  # noqa: E731
    have: dict[str, str] = {}
    for d in md.distributions():  # the first on sys.path wins, as imports do
        have.setdefault(key(d.metadata["Name"]), d.version)
    out = []
    for d in md.distributions(path=[site]):
        for r in d.requires or []:
            req = Requirement(r)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            v = have.get(key(req.name))
            if v is None or (req.specifier and not req.specifier.contains(v, prereleases=True)):
                out.append(f"{d.metadata['Name']} {d.version} needs {req.name}{req.specifier}: {v or 'absent'}")
    return sorted(set(out))


try:
    missing = unmet()
    print(f"info unmet requirements ({len(missing)}):\n  " + "\n  ".join(missing))
except Exception as exc:  # noqa: BLE001
    print(f"info unmet requirements: not computed ({exc})")
print(json.dumps({"pair": PAIR, "failures": failures, "seconds": round(time.monotonic() - t0, 1)}))
sys.exit(1 if failures else 0)
