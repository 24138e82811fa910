"""Fail unless LMCache's CUDA extension loads against the installed torch with every symbol resolved.

Run with the Python that has vLLM, torch and LMCache (stdlib only: the serving image's build step
and tests/engine/build-venv.sh both run it):  python3 extension_check.py
A CUDA extension is a shared object of the lmcache distribution that links CUDA's runtime or torch's
CUDA library (its ELF DT_NEEDED). Each is loaded by file after `import torch` (which loads the libc10 /
libtorch it links), first with dlopen(RTLD_NOW) -- every undefined symbol is bound now, so a symbol
this torch lacks (`c10_cuda_check_implementation` for LMCache 0.5.6's wheel on torch 2.14) fails here,
not at the first request -- then as the Python module it is (its init runs). `import lmcache.c_ops`
would prove nothing: LMCache 0.5.x falls back to a shim when the extension does not load. No GPU is
needed: loading binds symbols; it runs no kernel.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import json
import os
import struct
import sys
from pathlib import Path

CUDA_LIBS = ("libcudart.so", "libc10_cuda.so", "libtorch_cuda.so")


def elf_needed(path: Path) -> list[str]:
    """DT_NEEDED entries of an ELF64 little-endian shared object (what it links against)."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path} is not ELF64 LE"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    dynamic = next(s for s in sections if s[1] == 6)  # SHT_DYNAMIC
    strtab = sections[dynamic[6]]  # sh_link: its string table
    needed = []
    for off in range(dynamic[4], dynamic[4] + dynamic[5], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        if tag == 1:  # DT_NEEDED
            start = strtab[4] + val
            needed.append(data[start:data.index(b"\0", start)].decode())
    return needed


def is_cuda_extension(path: Path) -> bool:
    return any(lib.startswith(CUDA_LIBS) for lib in elf_needed(path))


def cuda_extensions(dist: str = "lmcache") -> list[tuple[str, Path]]:
    """(module name, file) of each CUDA extension the installed distribution shipped (its RECORD)."""
    out = []
    for f in importlib.metadata.files(dist) or []:
        if f.suffix == ".so" and is_cuda_extension(path := Path(f.locate())):
            out.append((str(f).split(".")[0].replace("/", "."), path))
    return sorted(out)


def load(name: str, path: Path) -> None:
    """Raises OSError/ImportError naming the unresolved symbol."""
    ctypes.CDLL(str(path), mode=os.RTLD_NOW)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def main() -> None:
    import torch

    exts = cuda_extensions()
    if not exts:
        sys.exit("LMCache has no CUDA extension here (built without nvcc?): nothing would run on the GPU")
    for name, path in exts:
        try:
            load(name, path)
        except (OSError, ImportError) as e:
            sys.exit(f"{name} ({path}) does not load against torch {torch.__version__}: {e}")
    print("extensions load:", json.dumps({"torch": torch.__version__, "lmcache": importlib.metadata.version("lmcache"),
                                          "modules": [name for name, _ in exts]}))


if __name__ == "__main__":
    main()
