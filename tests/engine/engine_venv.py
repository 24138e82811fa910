"""The pinned engine's venv, for tests: where it is, how to ask it (engine_check.py), what its wheels hold.

The venv is built by tests/engine/build-venv.sh (`make engine-venv`, part of `make test`). Without it
the tests that need it skip, unless KVO_REQUIRE_ENGINE is set (`make test`), when they fail.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvoffload.engine import images

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PAIR = images.KNOWN_IMAGES[images.DEFAULT_IMAGE]  # the default pair: the serving image's pins
CACHE = Path(os.environ.get("KVO_CACHE", Path.home() / ".cache" / "kvoffload"))


def venv_path(vllm: str | None = PAIR.vllm, lmcache: str | None = PAIR.lmcache) -> Path:
    return CACHE / f"engine-vllm-{vllm}-lmcache-{lmcache}"


def require(vllm: str | None = PAIR.vllm, lmcache: str | None = PAIR.lmcache) -> Path:
    path = venv_path(vllm, lmcache)
    if not (path / ".done").is_file():
        message = f"no engine venv at {path}: run tests/engine/build-venv.sh {vllm} {lmcache} (make engine-venv)"
        if os.environ.get("KVO_REQUIRE_ENGINE"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def python(venv: Path) -> str:
    return str(venv / "bin" / "python")


def site_packages(venv: Path) -> Path:
    (sp,) = (venv / "lib").glob("python3*/site-packages")
    return sp


def run(venv: Path, mode: str, request: dict | None = None, timeout: float = 1800) -> dict:
    """engine_check.py in the venv, as one subprocess; no network (HF_HUB_OFFLINE and friends)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        args = [python(venv), str(HERE / "engine_check.py"), mode]
        if request is not None:
            (Path(tmp) / "in.json").write_text(json.dumps(request))
            args.append(str(Path(tmp) / "in.json"))
        args.append(str(out))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        cp = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=env)
        assert cp.returncode == 0 and out.is_file(), f"{' '.join(args)}\n{cp.stdout[-3000:]}\n{cp.stderr[-3000:]}"
        return json.loads(out.read_text())


def record(venv: Path, dist: str) -> list[str]:
    """The files an installed wheel shipped (its RECORD)."""
    (info,) = site_packages(venv).glob(f"{dist}-*.dist-info")
    return [line.split(",")[0] for line in (info / "RECORD").read_text().splitlines() if line]


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


def cuda_extensions(venv: Path, dist: str = "lmcache") -> list[str]:
    """Modules of the installed wheel that are CUDA extensions: shared objects linking CUDA's runtime."""
    out = []
    for rel in record(venv, dist):
        if rel.endswith(".so"):
            needed = elf_needed(site_packages(venv) / rel)
            if any(lib.startswith(("libcudart.so", "libc10_cuda.so", "libtorch_cuda.so")) for lib in needed):
                out.append(rel.split(".")[0].replace("/", "."))
    return sorted(out)
