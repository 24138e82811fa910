"""The pinned engines' venvs, for tests: where they are, how to ask one (engine_check.py), what its wheels hold.

One venv per pair the operator offers (engine/images.serving_images(): the serving images), built by
tests/engine/build-venv.sh (`make engine-venv` = `python tests/engine/engine_venv.py build`, part of
`make test`). Without it the tests that need it skip, unless KVO_REQUIRE_ENGINE is set (`make test`),
when they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvoffload.engine import images
from kvtest import background

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "images" / "serving"))
from extension_check import elf_needed, is_cuda_extension  # noqa: E402  (the serving image's build check)

PAIR = images.KNOWN_IMAGES[images.DEFAULT_IMAGE]  # the default pair: the default serving image's pins
PAIRS = list(images.serving_images().values())  # every pair the operator offers, the default first
# vLLM 0.26.0 + LMCache 0.5.3, offered: the pair whose own code some tests read (LMCache 0.5.3's L1 allocator and c_ops
# shim, vLLM 0.26.0's pinned CPU tensors and the KV events the stand-in engines mirror), the default before 0.33.0.
IMAGE_026 = f"{images.SERVING_REPOSITORY}:0.26.0-0.5.3"
PAIR_026 = images.KNOWN_IMAGES[IMAGE_026]
CACHE = Path(os.environ.get("KVO_CACHE", Path.home() / ".cache" / "kvoffload"))
BUILD = HERE / "build-venv.sh"

__all__ = ["elf_needed", "is_cuda_extension"]


def venv_path(vllm: str | None = PAIR.vllm, lmcache: str | None = PAIR.lmcache) -> Path:
    return CACHE / f"engine-vllm-{vllm}-lmcache-{lmcache}"


def require(vllm: str | None = PAIR.vllm, lmcache: str | None = PAIR.lmcache) -> Path:
    background.wait("engine")
    path = venv_path(vllm, lmcache)
    if not (path / ".done").is_file():
        message = (f"no engine venv at {path}: run `make engine-venv` (tests/engine/build-venv.sh {vllm} {lmcache} ...;"
                   f" `make test` builds it in the background: {background.log('engine')})")
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


def cuda_extensions(venv: Path, dist: str = "lmcache") -> list[str]:
    """Modules of the installed wheel that are CUDA extensions: shared objects linking CUDA's runtime."""
    out = []
    for rel in record(venv, dist):
        if rel.endswith(".so"):
            if is_cuda_extension(site_packages(venv) / rel):
                out.append(rel.split(".")[0].replace("/", "."))
    return sorted(out)


def build() -> None:
    """Every offered pair's venv (cached by version: a built one is reused), as `make engine-venv` does."""
    for pair in PAIRS:
        subprocess.run([str(BUILD), pair.vllm, pair.lmcache, pair.lmcache_from], check=True, stdout=subprocess.DEVNULL)


def tables() -> None:
    """Each offered vLLM's flag table from its own parser (`make engine-tables`)."""
    from kvoffload.engine import flags

    for pair in PAIRS:
        out = flags.DATA / f"vllm-{pair.vllm}-flags.json"
        subprocess.run([python(venv_path(pair.vllm, pair.lmcache)), str(HERE / "engine_check.py"), "table", str(out)],
                       check=True)


if __name__ == "__main__":
    commands = {"build": build, "tables": tables}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python tests/engine/engine_venv.py {'|'.join(commands)}")
    commands[sys.argv[1]]()
