"""Shared builders for unit tests."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

BASE: dict[str, Any] = {
    "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
    "engine": {"maxModelLen": 32768},
    "offload": {"cpu": {"size": "40Gi"}, "disk": {"path": "/mnt/nvme/lmcache", "size": "200Gi"}},
    "resources": {"gpuMemory": "80Gi"},
}


def spec(**patch: Any) -> dict[str, Any]:
    """BASE with dotted-path overrides; a value of None deletes the key."""
    out = copy.deepcopy(BASE)
    for dotted, value in patch.items():
        *parents, leaf = dotted.split("__")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())
