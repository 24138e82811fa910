"""The serving image's Dockerfile against the pinned wheels themselves (installed in the engine venvs), for
every serving image the operator offers (its header's build command: engine/images.serving_images()).

- the extension module the Dockerfile loads is the one the pinned LMCache wheel ships as a CUDA
  extension (read from the wheel's RECORD and the shared objects' ELF DT_NEEDED, not from a name);
- the Dockerfile's own load check, run here, loads it against the pinned vLLM's torch (on CPU);
- `import lmcache.<ext>` would prove nothing (LMCache replaces the module with a shim);
- the pins agree: Dockerfile ARGs, the operator's image table, the Makefile, the venv's versions,
  and vLLM's and LMCache's torch requirements.
"""

from __future__ import annotations

import re
import subprocess
from importlib.metadata import Distribution

import engine_venv
import pytest

from kvoffload.engine import images
from kvtest.dockerfile import SERVING, Dockerfile, serving

SERVING_IMAGES = pytest.mark.parametrize("image", list(images.serving_images()))


@pytest.fixture(scope="module")
def venv():
    return engine_venv.require(engine_venv.PAIR_026.vllm, engine_venv.PAIR_026.lmcache)  # LMCache 0.5.3's c_ops shim


def venv_of(image: str):
    pair = images.KNOWN_IMAGES[image]
    return engine_venv.require(pair.vllm, pair.lmcache)


def dist(venv, name: str) -> Distribution:
    (info,) = engine_venv.site_packages(venv).glob(f"{name}-*.dist-info")
    return Distribution.at(info)


def torch_pin(d: Distribution) -> str | None:
    pins = [r for r in d.requires or [] if re.match(r"torch\s*(==|$|[<>;])", r.split(";")[0].strip() or "x")]
    exact = [re.search(r"==\s*([\w.+]+)", p) for p in pins]
    return next((m.group(1) for m in exact if m), None)


@SERVING_IMAGES
def test_the_extension_the_dockerfile_loads_is_the_wheels(image):
    found = engine_venv.cuda_extensions(venv_of(image))
    assert found, "the pinned LMCache build ships no CUDA extension?"
    df = serving(image)
    assert found == [f"lmcache.{df.args['LMCACHE_EXTENSION']}"], found


def _load_check(df: Dockerfile) -> str:
    (check,) = [r for r in df.all("RUN") if "module_from_spec" in r]
    return check


@SERVING_IMAGES
def test_the_dockerfiles_load_check_passes_against_the_pinned_torch(image):
    venv = venv_of(image)
    torch = dist(venv, "torch").version.split("+")[0]
    check = (_load_check(serving(image)).replace("python3 ", f"{engine_venv.python(venv)} ")
             .replace("/opt/kvoffload/", f"{engine_venv.ROOT}/images/serving/"))  # where the image COPYs them
    cp = subprocess.run(["bash", "-o", "pipefail", "-c", check], capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert re.search(rf"loaded \S+/lmcache/\w+\.cpython-\d+-x86_64-linux-gnu\.so against torch {re.escape(torch)}",
                     cp.stdout), cp.stdout
    assert "extensions load:" in cp.stdout, cp.stdout  # extension_check.py: every CUDA extension, RTLD_NOW


def test_the_load_check_fails_without_the_extension_and_import_would_not(venv):
    # LMCache 0.5.3's (vLLM 0.26.0's pair): its package answers `import lmcache.c_ops` with a shim.
    df = serving(engine_venv.IMAGE_026)
    ext = df.args["LMCACHE_EXTENSION"]
    other = "cuda_ops" if ext == "c_ops" else "c_ops"  # the other LMCache releases' name: not in this wheel
    check = _load_check(df).split(" && ")[0].replace("python3 ", f"{engine_venv.python(venv)} ").replace(ext, other)
    cp = subprocess.run(["bash", "-c", check], capture_output=True, text=True, timeout=300)
    assert cp.returncode != 0 and ("No such file" in cp.stderr or "cannot open" in cp.stderr), cp.stderr[-2000:]
    # Importing the module by name gives LMCache's shim, not the shared object: no file behind it.
    cp = subprocess.run([engine_venv.python(venv), "-c",
                         f"import sys, lmcache.{ext}; m = sys.modules['lmcache.{ext}']; "
                         "print('FILE', getattr(m, '__spec__', None) and m.__spec__.origin)"],
                        capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0 and "FILE None" in cp.stdout, cp.stdout + cp.stderr[-2000:]


def test_the_default_pins_agree_everywhere():
    df = Dockerfile(SERVING)
    pair = images.KNOWN_IMAGES[images.DEFAULT_IMAGE]
    assert (df.args["VLLM_VERSION"], df.args["LMCACHE_VERSION"]) == (pair.vllm, pair.lmcache)
    makefile = (engine_venv.ROOT / "Makefile").read_text()
    assert re.search(rf"^VLLM_VERSION := {re.escape(pair.vllm)}$", makefile, re.M)
    assert re.search(rf"^LMCACHE_VERSION := {re.escape(pair.lmcache)}$", makefile, re.M)


@SERVING_IMAGES
def test_pins_agree_everywhere(image):
    df, pair, venv = serving(image), images.KNOWN_IMAGES[image], venv_of(image)
    assert (df.args["VLLM_VERSION"], df.args["LMCACHE_VERSION"]) == (pair.vllm, pair.lmcache)
    assert dist(venv, "vllm").version == pair.vllm and dist(venv, "lmcache").version == pair.lmcache
    torch = dist(venv, "torch").version
    assert torch_pin(dist(venv, "vllm")) == torch, "vLLM pins the torch it was built for"
    lmcache_pin = torch_pin(dist(venv, "lmcache"))
    assert lmcache_pin in (None, torch), f"LMCache pins torch {lmcache_pin}, vLLM {torch}"
