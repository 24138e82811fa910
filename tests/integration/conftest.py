"""Fixtures the cluster tests share."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest

from kvtest import OperatorProcess, images, node


@pytest.fixture
def operator(cluster, crd_installed, namespace):
    """The operator as a subprocess, scoped to the test's namespace; its log is printed after the test."""
    proc = OperatorProcess(cluster.env, [namespace])
    yield proc
    proc.stop()
    print(proc.output()[-5000:])


NODE_DISK_ROOT = Path("/var/lib/kvoffload")  # one of the chart's allowedDiskRoots; the only one the real node has


@pytest.fixture
def disk_base():
    """A fresh directory below the real node's disk root, for a resource's spec.offload.disk.path; removed after."""
    NODE_DISK_ROOT.mkdir(exist_ok=True)
    base = NODE_DISK_ROOT / f"t-{uuid.uuid4().hex[:8]}"
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def engine_image(demo) -> str:
    """The real node's stand-in engine image (kvtest.node.STANDIN) built (kvtest.images, cached by its inputs)
    and in the node's containerd; its tag. Build and import times are printed."""
    t0 = time.monotonic()
    tar = images.save(node.STANDIN)
    built = time.monotonic() - t0
    if node.FULL_STANDIN:
        free = shutil.disk_usage(node.containerd_root()).free
        if free < 2 * tar.stat().st_size + (10 << 30):
            pytest.skip(f"{free / 2**30:.0f} GiB free: importing the {tar.stat().st_size / 2**30:.1f} GiB stand-in "
                        f"image needs twice that plus 10 GiB")
    t1 = time.monotonic()
    node.load_images(demo.cluster, [node.STANDIN])
    print(f"{node.STANDIN}: {tar.stat().st_size / 2**20:.0f} MiB archive; build+save {built:.1f}s, "
          f"import {time.monotonic() - t1:.1f}s")
    return images.images()[node.STANDIN].tag


@pytest.fixture(scope="session")
def router_image(demo) -> str:
    """vLLM's router image (images/router/Dockerfile, kvtest.images "router": FROM the local Python base, the wheels
    `make router-wheels` fetched) built and in the node's containerd; its tag, the chart's routerImage. Build and
    import times are printed."""
    t0 = time.monotonic()
    tar = images.save("router")
    built = time.monotonic() - t0
    t1 = time.monotonic()
    node.load_images(demo.cluster, ["router"])
    print(f"router image: {tar.stat().st_size / 2**20:.0f} MiB archive; build+save {built:.1f}s, "
          f"import {time.monotonic() - t1:.1f}s")
    return images.images()["router"].tag
