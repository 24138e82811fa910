"""The container images, built here with podman and no network, and saved for a containerd to import.

Users build images/*/Dockerfile with docker or podman FROM the public bases (python:3.11-slim,
vllm/vllm-openai:v0.33.0; README "Images"). This machine can pull nothing, so the same Dockerfiles
are built here FROM bases made locally, passed as the BASE_IMAGE build argument:

- `localhost/kvoffload-local/python:3.11-bookworm`: a debootstrap rootfs of Debian's packages
  (python3, python3-venv), the stand-in for python:3.11-slim;
- `localhost/kvoffload-local/python:3.11-bookworm-dev`: the same plus g++ and python3-dev, for a serving
  build that compiles LMCache (--compile): vllm/vllm-openai holds a C++ compiler (its base is nvidia/cuda's
  -devel image) and Python's headers (python3.x-dev), and the compile needs both;
- `localhost/kvoffload-local/vllm-openai:v<vLLM>`: that plus the pair's engine venv's vLLM, torch and their
  dependencies (`make engine-venv`, the pinned wheels from PyPI) minus LMCache, the stand-in for
  vllm/vllm-openai (tests/images/vllm-base/Dockerfile: a copy of the 8-10 GB venv into a layer);
- `localhost/kvoffload-local/vllm-openai-thin:v<vLLM>`: the same as symlinks into the engine venv, mounted
  read-only at build and run time (tests/images/vllm-base-thin: no copy; thin_mounts());

and pip installs from a local wheelhouse mounted into the build (build args PIP_NO_INDEX /
PIP_FIND_LINKS), under `--network=none --pull=never`. The wheelhouses are fetched beforehand (`make
serving-wheels`, `wheels` below). Each image carries the hash of its inputs (Dockerfile, build args, context
files, wheelhouse, base image id) as a label and is rebuilt only when that changes; the rootfs is cached under
~/.cache/kvoffload by suite and package list.

The serving images (engine/images.serving_images(), each with its Dockerfile header's build arguments):
- a wheel pair (vLLM 0.26.0 + LMCache 0.5.3): LMCache's PyPI wheel, FROM the full local base, tagged as published;
- a source pair (the default, vLLM 0.33.0 + LMCache 0.5.6): as `make test` builds it, the LMCache wheel that the
  pair's engine venv compiled (tests/engine/build-venv.sh: sm_90 only) installed by the Dockerfile's own wheel
  step (LMCACHE_FROM=wheel), FROM the thin base, tagged localhost/kvoffload/vllm-lmcache-ci:<pair> (its
  io.kvoffload.lmcache-build label says how LMCache was built): one LMCache compile in a cold run, not two, and no
  copy of the ~10 GB venv into a layer. With --compile the build compiles LMCache itself for the Dockerfile's GPU
  list (or KVO_TORCH_CUDA_ARCH_LIST), as users build it: over an hour on 2 cores, FROM the full base (~30 GB
  free disk while podman commits it), or with --thin-base FROM the thin one (localhost/kvoffload/vllm-lmcache-thin).

The stand-in engines for the CPU-only real node serve recorded H200 pages of vLLM 0.26.0 + LMCache 0.5.3
(tests/fixtures; STANDIN_PAIR), and their tags say so: `standin-slim` (tests/images/vllm-standin-slim, ~0.2 GB,
what `make test` runs on the real node) is the Python base plus the stand-ins of vLLM and of the LMCache server;
`standin` (tests/images/vllm-standin, 8.8 GB) is that pair's serving image whose `vllm` is the stand-in (vLLM's
own parser checks the flags; the LMCache server is real).

`router` is images/router/Dockerfile (vLLM's router, vllm-router from its PyPI wheel, for spec.routing) FROM the
Python base, its wheel and dependencies from the wheelhouse `make router-wheels` fills.

    python -m kvtest.images build [operator|serving|standin|standin-slim|router ...] [--pair VLLM-LMCACHE]
                                  [--compile [--thin-base]]
    python -m kvtest.images wheels [--pair VLLM-LMCACHE [--compile]]   (`make serving-wheels`: downloads)
    python -m kvtest.images save NAME   (prints the docker-archive tar's path)
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.engine import images as engine_images

from .dockerfile import SERVING as SERVING_DOCKERFILE
from .dockerfile import Dockerfile
from .paths import ROOT

CACHE = Path(os.environ.get("KVO_CACHE", Path.home() / ".cache" / "kvoffload"))
# The default pair (engine/images.py DEFAULT_PAIR: the Makefile's and images/serving/Dockerfile's pins).
VLLM_VERSION, LMCACHE_VERSION = engine_images.DEFAULT_PAIR.vllm, engine_images.DEFAULT_PAIR.lmcache
DEFAULT_PAIR = f"{VLLM_VERSION}-{LMCACHE_VERSION}"
ENGINE_VENV = CACHE / f"engine-vllm-{VLLM_VERSION}-lmcache-{LMCACHE_VERSION}"
# The pair whose H200 pages the stand-ins serve (tests/fixtures, RECORDED) and whose serving image the full stand-in
# is: vLLM 0.26.0 + LMCache 0.5.3, offered, not the default. The real node's pods pin it (kvtest.node serve_spec).
STANDIN_PAIR = "0.26.0-0.5.3"
OPERATOR_WHEELHOUSE = CACHE / "wheelhouse"  # `make operator-wheels`
# the Makefile's ROUTER_VERSION, images/router/Dockerfile's, kvoffload/engine/router.py VERSION
ROUTER_VERSION = "0.1.17"
ROUTER_WHEELHOUSE = CACHE / f"wheelhouse-vllm-router-{ROUTER_VERSION}"  # `make router-wheels`: the router and its deps

OPERATOR = "ghcr.io/kvoffload/kvoffload:0.1.0"
SERVING = engine_images.DEFAULT_IMAGE  # what rendered pods name; kvtest builds it as serving_tag() says
STANDIN = f"localhost/kvoffload/vllm-standin:{STANDIN_PAIR}"
# No vLLM, LMCache or torch in it: the tag names the pair whose recorded pages it serves.
STANDIN_SLIM = f"localhost/kvoffload/vllm-standin-slim:recorded-{STANDIN_PAIR}"
ROUTER = f"ghcr.io/kvoffload/vllm-router:{ROUTER_VERSION}"  # the chart's default routerImage
PYTHON_BASE = "localhost/kvoffload-local/python:3.11-bookworm"
PYTHON_DEV_BASE = "localhost/kvoffload-local/python:3.11-bookworm-dev"

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_PACKAGES = ("python3", "python3-venv", "python-is-python3")
# What vllm/vllm-openai holds beside Python that compiling LMCache needs (PYTHON_DEV_BASE).
DEV_PACKAGES = ("g++", "python3-dev")
KEY_LABEL = "io.kvoffload.build-key"

# Debian's crun 1.8.1 refuses this VM's hybrid cgroups ("drop all controllers from cgroupv2"); runc
# runs the build steps. crun also refuses default rlimits above the hard limits: pass them.
PODMAN = ("podman", "--runtime", "runc")
RUN_LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
# A build `make test` runs in the background (KVO_BACKGROUND=1, kvtest.background): podman runs its steps in their
# own cgroup, which the scheduler weighs against the tests' regardless of nice, so it gets a small weight there too.
BACKGROUND = ("--cpu-shares", "16") if os.environ.get("KVO_BACKGROUND") == "1" else ()
IGNORED = ("__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".mypy_cache")


LOGS = CACHE / "image-builds"  # the last build's output per tag
ARCHIVES = CACHE / "image-archives"  # docker-archive tars for containerd (save)


REPLACED: list[str] = []  # ids of images a build untagged, removed once the chain is rebuilt


class BuildFailed(RuntimeError):
    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


def log(msg: str) -> None:
    print(f"[images] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Image:
    """One `podman build`: its Dockerfile, context, build args and mounted wheelhouse."""
    tag: str
    dockerfile: Path
    context: Path
    base: str | None  # a local image passed as BASE_IMAGE (built first), None for a public FROM
    args: Mapping[str, str] = field(default_factory=dict)
    wheelhouse: Path | None = None
    volumes: Mapping[Path, str] = field(default_factory=dict)  # other read-only mounts: host path -> in the build
    inputs: tuple[str, ...] = (".",)  # what the build copies from its context (hashed into the build key)
    labels: Mapping[str, str] = field(default_factory=dict)  # `--label`s over the Dockerfile's (hashed when given)


@dataclass(frozen=True)
class Pair:
    """A serving image the operator offers (engine/images.serving_images()) and the local inputs of its build."""
    vllm: str
    lmcache: str
    lmcache_from: str  # "wheel": LMCache's PyPI wheel; "source": compiled in the build (build-lmcache.sh)
    tag: str
    args: Mapping[str, str]  # the --build-args of its build command in the Dockerfile's header ({} for the default)

    @property
    def name(self) -> str:
        return f"{self.vllm}-{self.lmcache}"

    @property
    def engine_venv(self) -> Path:
        return CACHE / f"engine-vllm-{self.vllm}-lmcache-{self.lmcache}"

    @property
    def wheelhouse(self) -> Path:
        """The serving build's pip inputs: a wheel pair's LMCache wheel; for a source pair compiled in the build
        (--compile) the toolchain and LMCache's sdist, resolved against its vLLM's torch: the name carries both."""
        return CACHE / (f"wheelhouse-lmcache-{self.lmcache}" if self.lmcache_from == "wheel"
                        else f"wheelhouse-vllm-{self.vllm}-lmcache-{self.lmcache}")

    @property
    def prebuilt_wheelhouse(self) -> Path:
        """A source pair's build from the LMCache wheel its engine venv compiled: that wheel (linked in at build
        time) and async-timeout (`make serving-wheels`)."""
        return CACHE / f"wheelhouse-vllm-{self.vllm}-lmcache-{self.lmcache}-prebuilt"

    def lmcache_wheels(self) -> Path | None:
        """Where tests/engine/build-venv.sh keeps the LMCache wheel it compiled for this pair (named there by the
        architecture list too); None before it finished (no .done)."""
        done = sorted(CACHE.glob(f"lmcache-wheel-vllm-{self.vllm}-lmcache-{self.lmcache}-arch-*/.done"),
                      key=lambda f: f.stat().st_mtime)
        return done[-1].parent if done else None

    @property
    def prebuilt_tag(self) -> str:
        # Not the published tag: its LMCache is built for fewer GPUs, and it runs only with thin_mounts().
        return f"localhost/kvoffload/vllm-lmcache-ci:{self.name}"

    @property
    def vllm_base(self) -> str:
        return f"localhost/kvoffload-local/vllm-openai:v{self.vllm}"

    @property
    def thin_base(self) -> str:
        return f"localhost/kvoffload-local/vllm-openai-thin:v{self.vllm}"

    @property
    def thin_tag(self) -> str:
        return f"localhost/kvoffload/vllm-lmcache-thin:{self.name}"

    @property
    def nvidia(self) -> Path:
        # Before the venv is built (the engine chain builds other images meanwhile) the path it will have; a build
        # that mounts it waits for the venv (_needs).
        sites = sorted((self.engine_venv / "lib").glob("python3*/site-packages"))
        return (sites[0] if sites else self.engine_venv / THIN_SITE.removeprefix("/opt/vllm/")) / "nvidia"

    @property
    def python_base(self) -> str:
        return PYTHON_BASE if self.lmcache_from == "wheel" else PYTHON_DEV_BASE

    def lock(self, step: str) -> str:
        return f"image-{step}-{self.name}"


def pairs() -> dict[str, Pair]:
    """The offered pairs by "<vLLM>-<LMCache>", with their build commands' arguments from the Dockerfile's header."""
    header = Dockerfile(SERVING_DOCKERFILE).build_commands()
    return {f"{k.vllm}-{k.lmcache}": Pair(k.vllm, k.lmcache, k.lmcache_from, tag, header[tag])
            for tag, k in engine_images.serving_images().items() if k.vllm and k.lmcache}


def pair(name: str | None = None) -> Pair:
    table = pairs()
    if (name or DEFAULT_PAIR) not in table:
        raise SystemExit(f"no serving image for the pair {name!r}: engine/images.py offers {', '.join(table)}")
    return table[name or DEFAULT_PAIR]


# The recorded vLLM /metrics pages the stand-ins serve (tests/fixtures), all of STANDIN_PAIR.
RECORDED = ("fixtures/vllm-0.26.0-lmcache-0.5.3-h200", "fixtures/vllm-0.26.0-lmcache-0.5.3-h200-v1runner",
            "fixtures/h200-backends-vllm-0.26.0-lmcache-0.5.3")
NAMES = ("operator", "serving", "standin", "standin-slim", "router")
# The `make` target that fills each wheelhouse of no pair (a build without its wheels says which to run).
WHEEL_TARGETS = {OPERATOR_WHEELHOUSE: "operator-wheels", ROUTER_WHEELHOUSE: "router-wheels"}


THIN_SITE = "/opt/vllm/lib/python3.11/site-packages"  # tests/images/vllm-base-thin


def thin_mounts(pair_name: str | None = None) -> dict[Path, str]:
    """What a build FROM the thin base, and every run of an image built on it, mounts (read-only)."""
    p = pair(pair_name)
    return {p.engine_venv: "/engine", p.nvidia: f"{THIN_SITE}/nvidia"}


def prebuilt(p: Pair, compile: bool = False) -> bool:
    """Whether `build serving` of this pair installs the LMCache wheel its engine venv compiled (what `make test`
    does for a source pair: one compile, not two) instead of compiling LMCache in the build (`compile`)."""
    return p.lmcache_from == "source" and not compile


def serving_tag(pair_name: str | None = None) -> str:
    """The tag `build("serving", pair_name)` gives (rendered pods name the pair's published tag, images.SERVING)."""
    p = pair(pair_name)
    return p.prebuilt_tag if prebuilt(p) else p.tag


def run_mounts(pair_name: str | None = None) -> tuple[str, ...]:
    """The `podman run` arguments the image serving_tag() names needs: thin_mounts() for a prebuilt one."""
    p = pair(pair_name)
    return tuple(a for src, dst in (thin_mounts(p.name) if prebuilt(p) else {}).items()
                 for a in ("-v", f"{src}:{dst}:ro"))


def lmcache_build_label(p: Pair) -> str:
    """The io.kvoffload.lmcache-build label of a prebuilt serving image: how its LMCache was compiled."""
    wheels = p.lmcache_wheels()
    done = dict(line.split("=", 1) for line in (wheels / ".done").read_text().splitlines()) if wheels else {}
    return (f"LMCache {p.lmcache} compiled from its sdist against torch {done.get('torch', '?')} for "
            f"TORCH_CUDA_ARCH_LIST={done.get('torch_cuda_arch_list', '?')} only (CUDA {done.get('cuda', '?')}) by "
            "images/serving/build-lmcache.sh in the engine venv's build, installed here as that wheel "
            "(LMCACHE_FROM=wheel); the published image compiles the Dockerfile's architecture list")


def images(extension: str | None = None, tag: str | None = None, pair_name: str | None = None,
           thin: bool = False, compile: bool = False) -> dict[str, Image]:
    """The builds by name. `extension`/`tag` override the serving image's LMCACHE_EXTENSION and tag
    (the test that a failing extension check fails the build); `pair_name` ("0.26.0-0.5.3") picks the
    vllm-base and serving builds of another offered pair (default: the default pair); a source pair's serving
    image installs the LMCache wheel its engine venv compiled, FROM the thin base (prebuilt()), unless `compile`:
    then its build compiles LMCache for the Dockerfile's architectures, FROM the full base, or with `thin` FROM the
    thin one (tests/images/vllm-base-thin; "vllm-base" is then that one). The stand-ins are STANDIN_PAIR's."""
    p = pair(pair_name)
    wheel_args = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/wheels"}
    serving_args = {**wheel_args, **p.args, **({"LMCACHE_EXTENSION": extension} if extension else {})}
    if p.lmcache_from == "source" and compile and os.environ.get("KVO_TORCH_CUDA_ARCH_LIST"):  # a shorter compile
        serving_args["TORCH_CUDA_ARCH_LIST"] = os.environ["KVO_TORCH_CUDA_ARCH_LIST"]
    # The base Dockerfile's description names one pair's versions; another pair's base says its own.
    base_df = ROOT / "tests/images/vllm-base/Dockerfile"
    base_labels = {} if f"vLLM {p.vllm} " in Dockerfile(base_df).labels()["org.opencontainers.image.description"] \
        else {"org.opencontainers.image.description": f"A local base holding the engine venv's vLLM {p.vllm} and its "
                                                      f"torch, standing in for vllm/vllm-openai:v{p.vllm}"}
    thin_dir = ROOT / "tests/images/vllm-base-thin"
    thin_base = Image(p.thin_base, thin_dir / "Dockerfile", thin_dir,
                      PYTHON_BASE if prebuilt(p, compile) else PYTHON_DEV_BASE, volumes={p.engine_venv: "/engine"})
    if prebuilt(p, compile):
        vllm_base = thin_base
        serving = Image(tag or p.prebuilt_tag, ROOT / "images/serving/Dockerfile", ROOT / "images/serving",
                        p.thin_base, {**serving_args, "LMCACHE_FROM": "wheel"}, p.prebuilt_wheelhouse,
                        volumes=thin_mounts(p.name), labels={"io.kvoffload.lmcache-build": lmcache_build_label(p)})
    elif thin:
        vllm_base = thin_base
        serving = Image(tag or p.thin_tag, ROOT / "images/serving/Dockerfile", ROOT / "images/serving", p.thin_base,
                        serving_args, p.wheelhouse, volumes=thin_mounts(p.name))
    else:
        vllm_base = Image(p.vllm_base, base_df, ROOT / "tests/images/vllm-base", p.python_base,
                          volumes={p.engine_venv: "/engine"}, labels=base_labels)
        serving = Image(tag or p.tag, ROOT / "images/serving/Dockerfile", ROOT / "images/serving", p.vllm_base,
                        serving_args, p.wheelhouse)
    return {
        "python-base": Image(PYTHON_BASE, Path(), Path(), None),  # podman import of the rootfs (python_base)
        "vllm-base": vllm_base,
        "operator": Image(OPERATOR, ROOT / "images/operator/Dockerfile", ROOT, PYTHON_BASE, wheel_args,
                          OPERATOR_WHEELHOUSE, inputs=("operator",)),
        "serving": serving,
        "standin": Image(STANDIN, ROOT / "tests/images/vllm-standin/Dockerfile", ROOT / "tests", pair(STANDIN_PAIR).tag,
                         inputs=("fixtures/fake_vllm", *RECORDED, "engine/engine_check.py",
                                 "images/vllm-standin/vllm")),
        "standin-slim": Image(STANDIN_SLIM, ROOT / "tests/images/vllm-standin-slim/Dockerfile", ROOT / "tests",
                              PYTHON_BASE,
                              wheel_args, OPERATOR_WHEELHOUSE,
                              inputs=("fixtures/fake_vllm", "fixtures/lmcache-0.5.3-server-status", *RECORDED,
                                      "images/vllm-standin/vllm", "images/vllm-standin-slim/lmcache",
                                      "support/kvtest/standin_prefix_engine.py")),
        "router": Image(ROUTER, ROOT / "images/router/Dockerfile", ROOT / "images/router", PYTHON_BASE,
                        {**wheel_args, "VLLM_ROUTER_VERSION": ROUTER_VERSION}, ROUTER_WHEELHOUSE),
    }


def podman(*args: str, check: bool = True, capture: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*PODMAN, *args], check=check, text=True,
                          capture_output=capture, **kw)


def image_id(tag: str) -> str | None:
    cp = podman("image", "inspect", "--format", "{{.Id}}", tag, check=False)
    return cp.stdout.strip() if cp.returncode == 0 else None


def label(tag: str, name: str) -> str | None:
    cp = podman("image", "inspect", "--format", f'{{{{index .Labels "{name}"}}}}', tag, check=False)
    return cp.stdout.strip() if cp.returncode == 0 else None


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """One builder at a time per cache entry (a second caller waits)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _files(root: Path, ignore: Iterable[str] = IGNORED) -> Iterator[Path]:
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not any(part == pat or rel.match(pat) or Path(part).match(pat)
                                   for part in rel.parts for pat in ignore):
            yield p


def _context_files(img: Image) -> Iterator[Path]:
    for rel in img.inputs:
        p = img.context / rel
        yield from [p] if p.is_file() else _files(p)


def build_key(img: Image) -> str:
    """Hash of everything the build reads: a changed input rebuilds, an unchanged one reuses."""
    h = hashlib.sha256()
    h.update(img.dockerfile.read_bytes())
    h.update(json.dumps(sorted(img.args.items())).encode())
    h.update((image_id(img.base) or "").encode() if img.base else b"")
    for p in _context_files(img):
        h.update(str(p.relative_to(img.context)).encode() + b"\0" + p.read_bytes())
    for wh in [img.wheelhouse] if img.wheelhouse else []:
        for p in sorted([*wh.glob("*.whl"), *wh.glob("*.tar.gz")]):  # wheels, and a source pair's LMCache sdist
            h.update(f"{p.name}:{p.stat().st_size}".encode())
    for src in img.volumes:  # the engine venv: its .done names the build (time, size); a part of it: its path
        h.update((src / ".done").read_bytes() if (src / ".done").exists() else str(src).encode())
    if img.labels:
        h.update(json.dumps(sorted(img.labels.items())).encode())
    return h.hexdigest()[:16]


def rootfs(packages: tuple[str, ...] = DEBIAN_PACKAGES) -> Path:
    """A Debian rootfs (debootstrap --variant=minbase plus `packages`) as a tar, cached by
    suite, mirror and package list; its dpkg versions are written beside it."""
    key = hashlib.sha256(json.dumps([DEBIAN_SUITE, DEBIAN_MIRROR, packages]).encode()).hexdigest()[:12]
    d = CACHE / f"rootfs-debian-{DEBIAN_SUITE}-{key}"
    tar = d / "rootfs.tar"
    if tar.exists():
        return tar
    with locked(d.name):
        if tar.exists():
            return tar
        shutil.rmtree(d, ignore_errors=True)
        work = d / "work"
        work.mkdir(parents=True)
        t0 = time.monotonic()
        log(f"debootstrap {DEBIAN_SUITE} ({', '.join(packages)}) from {DEBIAN_MIRROR}")
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
                        DEBIAN_SUITE, str(work), DEBIAN_MIRROR], check=True, stdout=subprocess.DEVNULL)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (work / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        versions = subprocess.run(["chroot", str(work), "dpkg-query", "-W", "-f", "${Package}=${Version}\\n"],
                                  check=True, capture_output=True, text=True).stdout
        (d / "packages.txt").write_text(versions)
        subprocess.run(["tar", "-C", str(work), "--numeric-owner", "-cf", str(tar) + ".tmp", "."], check=True)
        os.replace(str(tar) + ".tmp", tar)
        shutil.rmtree(work)
        log(f"rootfs {tar} in {time.monotonic() - t0:.0f}s")
    return tar


PYTHON_BASES = {PYTHON_BASE: DEBIAN_PACKAGES, PYTHON_DEV_BASE: DEBIAN_PACKAGES + DEV_PACKAGES}


def python_base(tag: str = PYTHON_BASE) -> str:
    tar = rootfs(PYTHON_BASES[tag])
    key = hashlib.sha256(f"{tar}:{tar.stat().st_size}:{tar.stat().st_mtime_ns}".encode()).hexdigest()[:16]
    # The engine chain's steps build concurrently (kvtest.background): one imports, the others wait and reuse it.
    with locked(f"image-{tag.rsplit('/', 1)[1].replace(':', '-')}"):
        if label(tag, KEY_LABEL) != key:
            REPLACED.extend([i for i in [image_id(tag)] if i])
            podman("import", "--change", f"LABEL {KEY_LABEL}={key}", "--change", 'CMD ["python3"]',
                   str(tar), tag)
            log(f"imported {tag}")
    return tag


def _needs(img: Image) -> None:
    if img.wheelhouse is not None and not any(img.wheelhouse.glob("*.whl")):
        target = WHEEL_TARGETS.get(img.wheelhouse) or "serving-wheels" + "".join(
            f" PAIR={name}" + (" COMPILE=1" if p.wheelhouse == img.wheelhouse and p.lmcache_from == "source" else "")
            for name, p in pairs().items() if img.wheelhouse in (p.wheelhouse, p.prebuilt_wheelhouse))
        raise SystemExit(f"no wheels in {img.wheelhouse}: run `make {target}`")
    for src in img.volumes:
        if src.name.startswith("engine-vllm-") and not (src / ".done").exists():
            raise SystemExit(f"{src} is not built: run `make engine-venv`")


def build_image(img: Image, force: bool = False) -> subprocess.CompletedProcess | None:
    """`podman build` of one image unless its build key is unchanged; None when reused. The build's
    output goes to LOGS/<tag>.log; a failed build raises BuildFailed."""
    _needs(img)
    key = build_key(img)
    if not force and label(img.tag, KEY_LABEL) == key:
        return None
    # docker format: the OCI format drops SHELL, and the serving Dockerfile's pipefail with it. No
    # intermediate images (--layers=false): the build key is the cache, and intermediates would keep a
    # replaced 8 GiB base alive.
    cmd = ["build", "--format=docker", "--layers=false", "--force-rm", "--network=none", "--pull=never", *RUN_LIMITS,
           *BACKGROUND,
           "-f", str(img.dockerfile), "-t", img.tag,
           "--label", f"{KEY_LABEL}={key}", *[a for k, v in img.labels.items() for a in ("--label", f"{k}={v}")]]
    if img.base:
        cmd += ["--build-arg", f"BASE_IMAGE={img.base}"]
    cmd += [a for k, v in img.args.items() for a in ("--build-arg", f"{k}={v}")]
    if img.wheelhouse:
        cmd += ["-v", f"{img.wheelhouse}:/wheels:ro"]
    cmd += [a for src, dst in img.volumes.items() for a in ("-v", f"{src}:{dst}:ro")]
    LOGS.mkdir(parents=True, exist_ok=True)
    replaced = image_id(img.tag)
    t0 = time.monotonic()
    log(f"building {img.tag} ({img.dockerfile.relative_to(ROOT)})")
    cp = podman(*cmd, str(img.context), check=False, stdin=subprocess.DEVNULL)
    (LOGS / f"{img.tag.replace('/', '_')}.log").write_text(cp.stdout + cp.stderr)
    if cp.returncode != 0:
        raise BuildFailed(f"podman build of {img.tag} failed ({cp.returncode}):\n{(cp.stdout + cp.stderr)[-4000:]}",
                          cp.stdout + cp.stderr)
    log(f"built {img.tag} in {time.monotonic() - t0:.0f}s, {size(img.tag) / 2**30:.2f} GiB")
    if replaced and replaced != image_id(img.tag):
        REPLACED.append(replaced)
    return cp


def build(name: str, pair_name: str | None = None, thin: bool = False, compile: bool = False) -> str:
    """Build (or reuse) one of NAMES and what it stands on; its tag. `pair_name`: the serving image of
    another offered pair ("0.26.0-0.5.3"; the stand-ins are STANDIN_PAIR's, its recorded pages); `thin` and
    `compile`: see images()."""
    if name.startswith("standin"):
        if pair_name not in (None, STANDIN_PAIR):
            raise SystemExit(f"{name} is built for the pair {STANDIN_PAIR} only (its recorded pages)")
        pair_name = STANDIN_PAIR
    p = pair(pair_name)
    if (thin or compile) and name != "serving":
        raise SystemExit("--thin-base and --compile are for the serving image only")
    if compile and p.lmcache_from != "source":
        raise SystemExit(f"--compile: the pair {p.name} installs LMCache's PyPI wheel; nothing is compiled")
    table = images(pair_name=p.name, thin=thin, compile=compile)
    chain = {"operator": ["operator"], "serving": ["vllm-base", "serving"],
             "standin": ["vllm-base", "serving", "standin"], "standin-slim": ["standin-slim"],
             "router": ["router"]}[name]
    python_base()
    if "vllm-base" in chain and table["vllm-base"].base != PYTHON_BASE:
        python_base(table["vllm-base"].base)
    if "serving" in chain and prebuilt(p, compile):
        link_lmcache_wheel(p)
    for step in chain:
        img = table[step]
        with locked(p.lock(step) + ("-thin" if img.tag in (p.thin_base, p.thin_tag, p.prebuilt_tag) else "")
                    if step in ("vllm-base", "serving") else f"image-{step}"):
            build_image(img)
    while REPLACED:  # the previous builds of these tags, images built on them first
        podman("rmi", REPLACED.pop(), check=False)
    return table[name].tag


def link_lmcache_wheel(p: Pair) -> None:
    """The LMCache wheel the pair's engine venv compiled, hard-linked into its prebuilt wheelhouse (no copy)."""
    wheels = p.lmcache_wheels()
    if wheels is None:
        raise SystemExit(f"no LMCache wheel compiled for {p.name} under {CACHE}: run `make engine-venv` "
                         "(tests/engine/build-venv.sh keeps it when it builds the venv; a venv built before it did "
                         f"has none: remove {p.engine_venv} first)")
    wh = p.prebuilt_wheelhouse
    wh.mkdir(parents=True, exist_ok=True)
    (wheel,) = wheels.glob(f"lmcache-{p.lmcache}-*.whl")
    for old in wh.glob("lmcache-*.whl"):
        if old.name != wheel.name or old.stat().st_ino != wheel.stat().st_ino:
            old.unlink()
    if not (wh / wheel.name).exists():
        os.link(wheel, wh / wheel.name)


def wheels(pair_name: str | None = None, compile: bool = False) -> Path:
    """The serving build's pip inputs for a pair, from PyPI into its wheelhouse (`make serving-wheels [PAIR=...]`;
    the builds themselves run with --network=none). Every pair: async-timeout, which LMCache's redis needs on Python
    < 3.11.3 (the local base's Debian 3.11.2; the engine venv's Python is newer, so no resolver there asks for it).
    A wheel pair: LMCache's wheel. A source pair: nothing else (its build installs the wheel its engine venv
    compiled), or with `compile` what images/serving/build-lmcache.sh installs to compile LMCache in the build
    (`--download`: the toolchain as pip resolves it in the pair's engine venv, whose packages the vllm-base copies,
    and LMCache's sdist), cached (.done); and its base's Debian packages (the compiler and Python's headers:
    PYTHON_DEV_BASE's rootfs)."""
    p = pair(pair_name)
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
    if p.lmcache_from == "wheel":
        subprocess.run([*download, "-d", str(p.wheelhouse), f"lmcache=={p.lmcache}", "async-timeout>=4.0.3"],
                       check=True)
        return p.wheelhouse
    if not compile:
        subprocess.run([*download, "-d", str(p.prebuilt_wheelhouse), "async-timeout>=4.0.3"], check=True)
        return p.prebuilt_wheelhouse
    wh = p.wheelhouse
    if (wh / ".done").exists():
        return wh
    if not (p.engine_venv / ".done").exists():
        raise SystemExit(f"{p.engine_venv} is not built: run `make engine-venv` "
                         "first (the toolchain is resolved in it)")
    rootfs(PYTHON_BASES[p.python_base])
    with locked(wh.name):
        if not (wh / ".done").exists():
            shutil.rmtree(wh, ignore_errors=True)
            t0 = time.monotonic()
            subprocess.run(["bash", str(ROOT / "images/serving/build-lmcache.sh"), "--download", str(wh),
                            str(p.engine_venv / "bin" / "python"), p.lmcache], check=True)
            subprocess.run([*download, "-d", str(wh), "async-timeout>=4.0.3"], check=True)
            files = sorted(f.name for f in wh.iterdir())
            (wh / ".done").write_text("".join(f"{f}\n" for f in files))
            log(f"{wh}: {len(files)} files in {time.monotonic() - t0:.0f}s")
    return wh


def size(tag: str) -> int:
    return int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


def save(name: str) -> Path:
    """A `podman save --format docker-archive` tar of one of NAMES (built or
    reused first), for `ctr images import` (kvtest.node). Cached by image id under ARCHIVES: a second
    call is free; an older archive of the same image is removed (they are GBs)."""
    tag = build(name)
    iid = image_id(tag)
    assert iid, tag
    ARCHIVES.mkdir(parents=True, exist_ok=True)
    tar = ARCHIVES / f"{name}-{iid[:16]}.tar"
    with locked(f"archive-{name}"):
        if not tar.exists():
            t0 = time.monotonic()
            podman("save", "--format", "docker-archive", "-o", f"{tar}.tmp", tag)
            os.replace(f"{tar}.tmp", tar)
            log(f"saved {tag} to {tar} in {time.monotonic() - t0:.0f}s, {tar.stat().st_size / 2**30:.2f} GiB")
        for old in ARCHIVES.glob(f"{name}-*.tar"):
            if old != tar:
                old.unlink()
    return tar


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtest.images", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build (or reuse) images")
    b.add_argument("names", nargs="*", choices=NAMES, default=["operator", "serving"])
    b.add_argument("--pair", help=f"the serving image of this offered pair, e.g. {STANDIN_PAIR} "
                                  f"(default {DEFAULT_PAIR})")
    b.add_argument("--thin-base", action="store_true",
                   help="the serving image FROM tests/images/vllm-base-thin (symlinks into the mounted engine venv)")
    b.add_argument("--compile", action="store_true",
                   help="a source pair's serving image compiles LMCache in the build, for the Dockerfile's GPU list "
                        "(default: it installs the wheel the pair's engine venv compiled)")
    w = sub.add_parser("wheels", help="fetch the serving builds' wheelhouses (make serving-wheels)")
    w.add_argument("--pair", help="only this pair's (default: every offered pair's)")
    w.add_argument("--compile", action="store_true", help="what `build serving --compile` needs (a source pair)")
    sv = sub.add_parser("save", help="print the path of a docker-archive tar of "
                                     "the image (built first; cached by image id)")
    sv.add_argument("name", choices=NAMES)
    a = ap.parse_args(argv)
    if a.command == "build":
        for name in a.names:
            print(build(name, a.pair, a.thin_base, a.compile))
    elif a.command == "wheels":
        for name in [a.pair] if a.pair else pairs():
            print(wheels(name, a.compile))
    else:
        print(save(a.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
