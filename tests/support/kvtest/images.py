"""The container images, built here with podman and no network, and saved for a containerd to import.

Users build images/*/Dockerfile with docker or podman FROM the public bases (python:3.11-slim,
vllm/vllm-openai:v0.26.0; README "Images"). This machine can pull nothing, so the same Dockerfiles
are built here FROM bases made locally, passed as the BASE_IMAGE build argument:

- `localhost/kvoffload-local/python:3.11-bookworm`: a debootstrap rootfs of Debian's packages
  (python3, python3-venv), the stand-in for python:3.11-slim;
- `localhost/kvoffload-local/vllm-openai:v<vLLM>`: that plus the engine venv's vLLM, torch and their
  dependencies (`make engine-venv`, the pinned wheels from PyPI) minus LMCache, the stand-in for
  vllm/vllm-openai (tests/images/vllm-base/Dockerfile);

and pip installs from a local wheelhouse mounted into the build (build args PIP_NO_INDEX /
PIP_FIND_LINKS), under `--network=none --pull=never`. Each image carries the hash of its inputs
(Dockerfile, build args, context files, wheelhouse, base image id) as a label and is rebuilt only
when that changes; the rootfs is cached under ~/.cache/kvoffload by suite and package list.

The stand-in engines for the CPU-only real node serve recorded H200 pages (tests/fixtures/fake_vllm);
their names say so: `standin-slim` (tests/images/vllm-standin-slim, ~0.2 GB, what `make test` runs on
the real node) is the Python base plus the stand-ins of vLLM and of the LMCache server; `standin`
(tests/images/vllm-standin, 8.8 GB) is the serving image whose `vllm` is the stand-in (vLLM's own
parser checks the flags; the LMCache server is real).

`router` is images/router/Dockerfile (vLLM's router, vllm-router from its PyPI wheel, for spec.routing) FROM the
Python base, its wheel and dependencies from the wheelhouse `make router-wheels` fills.

    python -m kvtest.images build [operator|serving|standin|standin-slim|router ...]
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

from .paths import ROOT

CACHE = Path(os.environ.get("KVO_CACHE", Path.home() / ".cache" / "kvoffload"))
VLLM_VERSION, LMCACHE_VERSION = "0.26.0", "0.5.3"  # the Makefile's and images/serving/Dockerfile's pins
ENGINE_VENV = CACHE / f"engine-vllm-{VLLM_VERSION}-lmcache-{LMCACHE_VERSION}"
OPERATOR_WHEELHOUSE = CACHE / "wheelhouse"  # `make operator-wheels`
SERVING_WHEELHOUSE = CACHE / f"wheelhouse-lmcache-{LMCACHE_VERSION}"  # `make serving-wheels`: the LMCache wheel
ROUTER_VERSION = "0.1.17"  # the Makefile's ROUTER_VERSION, images/router/Dockerfile's, kvoffload/engine/router.py VERSION
ROUTER_WHEELHOUSE = CACHE / f"wheelhouse-vllm-router-{ROUTER_VERSION}"  # `make router-wheels`: the router and its deps

OPERATOR = "ghcr.io/kvoffload/kvoffload:0.1.0"
SERVING = f"ghcr.io/kvoffload/vllm-lmcache:{VLLM_VERSION}-{LMCACHE_VERSION}"
STANDIN = f"localhost/kvoffload/vllm-standin:{VLLM_VERSION}-{LMCACHE_VERSION}"
# No vLLM, LMCache or torch in it: the tag names the pair whose recorded pages it serves.
STANDIN_SLIM = f"localhost/kvoffload/vllm-standin-slim:recorded-{VLLM_VERSION}-{LMCACHE_VERSION}"
ROUTER = f"ghcr.io/kvoffload/vllm-router:{ROUTER_VERSION}"  # the chart's default routerImage
PYTHON_BASE = "localhost/kvoffload-local/python:3.11-bookworm"
VLLM_BASE = f"localhost/kvoffload-local/vllm-openai:v{VLLM_VERSION}"

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_PACKAGES = ("python3", "python3-venv", "python-is-python3")
KEY_LABEL = "io.kvoffload.build-key"

# Debian's crun 1.8.1 refuses this VM's hybrid cgroups ("drop all controllers from cgroupv2"); runc
# runs the build steps. crun also refuses default rlimits above the hard limits: pass them.
PODMAN = ("podman", "--runtime", "runc")
RUN_LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
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


# The recorded vLLM /metrics pages the stand-ins serve (tests/fixtures).
RECORDED = ("fixtures/vllm-0.26.0-lmcache-0.5.3-h200", "fixtures/vllm-0.26.0-lmcache-0.5.3-h200-v1runner",
            "fixtures/h200-backends-vllm-0.26.0-lmcache-0.5.3")
NAMES = ("operator", "serving", "standin", "standin-slim", "router")
# The `make` target that fills each wheelhouse (a build without its wheels says which to run).
WHEEL_TARGETS = {OPERATOR_WHEELHOUSE: "operator-wheels", SERVING_WHEELHOUSE: "serving-wheels",
                 ROUTER_WHEELHOUSE: "router-wheels"}


def images(extension: str | None = None, tag: str | None = None) -> dict[str, Image]:
    """The builds by name. `extension`/`tag` override the serving image's LMCACHE_EXTENSION and tag
    (the test that a failing extension check fails the build)."""
    wheel_args = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/wheels"}
    serving_args = {**wheel_args, **({"LMCACHE_EXTENSION": extension} if extension else {})}
    return {
        "python-base": Image(PYTHON_BASE, Path(), Path(), None),  # podman import of the rootfs (python_base)
        "vllm-base": Image(VLLM_BASE, ROOT / "tests/images/vllm-base/Dockerfile", ROOT / "tests/images/vllm-base",
                           PYTHON_BASE, volumes={ENGINE_VENV: "/engine"}),
        "operator": Image(OPERATOR, ROOT / "images/operator/Dockerfile", ROOT, PYTHON_BASE, wheel_args,
                          OPERATOR_WHEELHOUSE, inputs=("operator",)),
        "serving": Image(tag or SERVING, ROOT / "images/serving/Dockerfile", ROOT / "images/serving", VLLM_BASE,
                         serving_args, SERVING_WHEELHOUSE),
        "standin": Image(STANDIN, ROOT / "tests/images/vllm-standin/Dockerfile", ROOT / "tests", SERVING,
                         inputs=("fixtures/fake_vllm", *RECORDED, "engine/engine_check.py", "images/vllm-standin/vllm")),
        "standin-slim": Image(STANDIN_SLIM, ROOT / "tests/images/vllm-standin-slim/Dockerfile", ROOT / "tests", PYTHON_BASE,
                              wheel_args, OPERATOR_WHEELHOUSE,
                              inputs=("fixtures/fake_vllm", "fixtures/lmcache-0.5.3-server-status", *RECORDED,
                                      "images/vllm-standin/vllm", "images/vllm-standin-slim/lmcache")),
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
        for p in sorted(wh.glob("*.whl")):
            h.update(f"{p.name}:{p.stat().st_size}".encode())
    for src in img.volumes:  # the engine venv: its .done names the build (time, size)
        h.update((src / ".done").read_bytes())
    return h.hexdigest()[:16]


def rootfs() -> Path:
    """A Debian rootfs (debootstrap --variant=minbase plus DEBIAN_PACKAGES) as a tar, cached by
    suite, mirror and package list; its dpkg versions are written beside it."""
    key = hashlib.sha256(json.dumps([DEBIAN_SUITE, DEBIAN_MIRROR, DEBIAN_PACKAGES]).encode()).hexdigest()[:12]
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
        log(f"debootstrap {DEBIAN_SUITE} ({', '.join(DEBIAN_PACKAGES)}) from {DEBIAN_MIRROR}")
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}",
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


def python_base() -> str:
    tar = rootfs()
    key = hashlib.sha256(f"{tar}:{tar.stat().st_size}:{tar.stat().st_mtime_ns}".encode()).hexdigest()[:16]
    if label(PYTHON_BASE, KEY_LABEL) != key:
        REPLACED.extend([i for i in [image_id(PYTHON_BASE)] if i])
        podman("import", "--change", f"LABEL {KEY_LABEL}={key}", "--change", 'CMD ["python3"]',
               str(tar), PYTHON_BASE)
        log(f"imported {PYTHON_BASE}")
    return PYTHON_BASE


def _needs(img: Image) -> None:
    if img.wheelhouse is not None and not any(img.wheelhouse.glob("*.whl")):
        raise SystemExit(f"no wheels in {img.wheelhouse}: run `make {WHEEL_TARGETS.get(img.wheelhouse, 'operator-wheels')}`")
    for src in img.volumes:
        if not (src / ".done").exists():
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
           "-f", str(img.dockerfile), "-t", img.tag,
           "--label", f"{KEY_LABEL}={key}"]
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


def build(name: str) -> str:
    """Build (or reuse) one of NAMES and what it stands on; its tag."""
    table = images()
    chain = {"operator": ["operator"], "serving": ["vllm-base", "serving"],
             "standin": ["vllm-base", "serving", "standin"], "standin-slim": ["standin-slim"], "router": ["router"]}[name]
    python_base()
    for step in chain:
        with locked(f"image-{step}"):
            build_image(table[step])
    while REPLACED:  # the previous builds of these tags, images built on them first
        podman("rmi", REPLACED.pop(), check=False)
    return table[name].tag


def build_all() -> list[str]:
    return [build(name) for name in ("operator", "serving", "standin")]


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
    sv = sub.add_parser("save", help="print the path of a docker-archive tar of the image (built first; cached by image id)")
    sv.add_argument("name", choices=NAMES)
    a = ap.parse_args(argv)
    if a.command == "build":
        for name in a.names:
            print(build(name))
    else:
        print(save(a.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
