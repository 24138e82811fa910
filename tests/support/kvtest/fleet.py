"""The fleet: pools of kwok nodes (GPU servers, workstations) -> Node objects on loopback addresses."""

from __future__ import annotations

import copy
import ipaddress
import os
from pathlib import Path
from typing import Iterable

from .paths import DEFAULT_NODES_FILE

NODE_IP_BASE = ipaddress.IPv4Address("127.0.1.1")  # node i -> 127.0.1.1 + i
POD_CIDR_BASE = ipaddress.IPv4Address("127.16.0.0")  # node i -> 127.16.0.0/24 + i*256
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")


def make_fleet(
    gpu_nodes: int = 3,
    workstations: int = 1,
    *,
    gpus_per_node: int = 8,
    gpu_node_cpu: int | str = 192,
    gpu_node_memory: str = "2Ti",
    gpu_product: str = "NVIDIA-H200",
    gpu_memory_mib: int = 143771,
    workstation_gpus: int = 1,
    workstation_cpu: int | str = 32,
    workstation_memory: str = "128Gi",
    workstation_gpu_product: str = "NVIDIA-GeForce-RTX-4090",
    workstation_gpu_memory_mib: int = 24564,
    pods: int = 110,
    gpu_node_prefix: str = "gpu-node",
    workstation_prefix: str = "workstation",
    extra_pools: Iterable[dict] = (),
) -> list[dict]:
    """A fleet description (list of pools) for render_nodes()/Cluster.apply_fleet().

    make_fleet() is the default fleet (3 x 8-GPU H200 servers with NVMe, 1 RTX-4090
    workstation); make_fleet(gpu_nodes=100, workstations=0) is a scale-test fleet.
    """
    pools: list[dict] = []
    if gpu_nodes:
        pools.append({
            "name": gpu_node_prefix, "count": int(gpu_nodes),
            "capacity": {"cpu": str(gpu_node_cpu), "memory": gpu_node_memory, "pods": str(pods),
                         "ephemeral-storage": "30Ti", "nvidia.com/gpu": str(gpus_per_node)},
            "labels": {"kvoffload.io/nvme": "true", "nvidia.com/gpu.product": gpu_product,
                       "nvidia.com/gpu.memory": str(gpu_memory_mib),
                       "nvidia.com/gpu.count": str(gpus_per_node)},
        })
    if workstations:
        pools.append({
            "name": workstation_prefix, "count": int(workstations),
            "capacity": {"cpu": str(workstation_cpu), "memory": workstation_memory,
                         "pods": str(pods), "ephemeral-storage": "2Ti",
                         "nvidia.com/gpu": str(workstation_gpus)},
            "labels": {"nvidia.com/gpu.product": workstation_gpu_product,
                       "nvidia.com/gpu.memory": str(workstation_gpu_memory_mib),
                       "nvidia.com/gpu.count": str(workstation_gpus)},
        })
    pools.extend(copy.deepcopy(list(extra_pools)))
    return pools


def load_fleet(path: str | os.PathLike | None = None) -> list[dict]:
    """Fleet from FILE, else env KVO_NODES_CONFIG, else env counts, else nodes.yaml."""
    import yaml

    path = path or os.environ.get("KVO_NODES_CONFIG")
    if path:
        data = yaml.safe_load(Path(path).read_text())
        return data["pools"] if isinstance(data, dict) else data
    if os.environ.get("KVO_GPU_NODES") or os.environ.get("KVO_WORKSTATIONS"):
        return make_fleet(int(os.environ.get("KVO_GPU_NODES", "3")),
                          int(os.environ.get("KVO_WORKSTATIONS", "1")))
    return yaml.safe_load(DEFAULT_NODES_FILE.read_text())["pools"]


def node_ip(index: int) -> str:
    return str(NODE_IP_BASE + index)


def node_pod_cidr(index: int) -> str:
    return f"{POD_CIDR_BASE + index * 256}/24"


def node_addresses(name: str, index: int) -> list[dict]:
    # Both types must be present: kwok's node-initialize stage rewrites `addresses` when
    # either is missing (and, with no --node-name, writes an empty list). The apiserver only
    # ever uses InternalIP (--kubelet-preferred-address-types), so the Hostname is never
    # resolved through DNS.
    return [{"type": "InternalIP", "address": node_ip(index)}, {"type": "Hostname", "address": name}]


def render_nodes(pools: list[dict], start_index: int = 0) -> list[dict]:
    """Node objects (with status) for a fleet; node IPs and pod CIDRs are loopback."""
    nodes = []
    i = start_index
    for pool in pools:
        for n in range(int(pool.get("count", 1))):
            name = f"{pool['name']}-{n}"
            cap = {k: str(v) for k, v in pool["capacity"].items()}
            labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                      "kubernetes.io/arch": "amd64", "type": "kwok",
                      "kvoffload.io/pool": pool["name"]}
            labels.update({k: str(v) for k, v in (pool.get("labels") or {}).items()})
            annotations = {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"}
            annotations.update(pool.get("annotations") or {})
            nodes.append({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": labels, "annotations": annotations},
                "spec": {"podCIDR": node_pod_cidr(i), "podCIDRs": [node_pod_cidr(i)],
                         "taints": list(pool.get("taints") or [])},
                "status": {"capacity": cap, "allocatable": dict(cap),
                           "addresses": node_addresses(name, i)},
            })
            i += 1
    names = [n["metadata"]["name"] for n in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate node names in fleet: {names}")
    return nodes
