"""Who faults in the lmcache-server L1 (docs/backends.md, "Memory: where the L1 is really charged"),
read from the pinned LMCache 0.5.3 itself, so an upgrade that changes it fails here:
- its memory manager allocates a named (shared-memory) L1 through c_ops.alloc_shm_pinned_ptr;
- the native extension's alloc_shm_pinned_ptr (used when the server process sees a CUDA device)
  maps the segment, writes one byte per page (a sysconf page-size loop of byte stores) and only then
  calls cudaHostRegister: the server process faults in the whole L1, so the server container's memory
  limit must hold it (sizing: server_memory_limit);
- the torch fallback (no device) creates the segment without touching it.
Needs objdump (binutils) for the disassembly. Skipped without the engine venv, unless
KVO_REQUIRE_ENGINE=1 makes that a failure."""

from __future__ import annotations

import re
import shutil
import subprocess

import engine_venv
import pytest


@pytest.fixture(scope="module")
def lmcache():
    return engine_venv.site_packages(engine_venv.require(engine_venv.PAIR_026.vllm, engine_venv.PAIR_026.lmcache)) \
        / "lmcache"


def test_named_l1_goes_through_alloc_shm_pinned_ptr(lmcache):
    src = (lmcache / "v1" / "memory_management.py").read_text()
    body = src[src.index("def _resolve_pinned_alloc_free"):]
    body = body[:body.index("\ndef ")]
    assert re.search(r"if shm_name:.*?alloc_fn=lmc_ops\.alloc_shm_pinned_ptr", body, re.S), body[:600]
    fallback = (lmcache / "v1" / "platform" / "torch_ops.py").read_text()
    fb = fallback[fallback.index("def alloc_shm_pinned_ptr"):]
    fb = fb[:fb.index("\ndef ")]
    assert "SharedMemory(name=name, create=True, size=size)" in fb and "memset" not in fb and ".fill_" not in fb


def test_native_alloc_shm_pinned_ptr_touches_every_page_before_pinning(lmcache):
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.fail("objdump (binutils) is needed to read LMCache's native extension")
    (so,) = lmcache.glob("c_ops.cpython-*.so")
    syms = subprocess.run(["nm", "-D", str(so)], capture_output=True, text=True, check=True).stdout
    (addr,) = [line.split()[0] for line in syms.splitlines() if re.search(r" T _Z20alloc_shm_pinned_ptr", line)]
    start = int(addr, 16)
    asm = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(so), f"--start-address={start:#x}",
                          f"--stop-address={start + 0x200:#x}"], capture_output=True, text=True, check=True).stdout
    calls = re.findall(r"call\s+\S+ <(\w+)@plt>", asm)
    order = [c for c in calls if c in ("shm_open", "ftruncate", "mmap", "sysconf", "cudaHostRegister")]
    assert order[:5] == ["shm_open", "ftruncate", "mmap", "sysconf", "cudaHostRegister"], calls
    # Between the page-size query and the pin: a loop of single-byte zero stores (first_touch).
    between = asm[asm.index("<sysconf@plt>"):asm.index("<cudaHostRegister@plt>")]
    assert re.search(r"movb\s+\$0x0,\(%r\w+\)", between) and re.search(r"\bj(b|ne|a)\b", between), between

