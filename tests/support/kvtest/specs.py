"""One spec builder and one children lister for every test.

- `spec(**patch)`: a KVOffloadServe spec (Llama-3.1-8B with CPU and disk tiers) with dotted-path overrides
  written `a__b__c=value` (None deletes the key); `SERVE_SPEC` is the one the local cluster's GPU nodes hold.
- `patched(obj, {"spec.a.b": value})`: any object with dotted-path changes (DELETE removes the key).
- `serve(name, **patch)`: a whole KVOffloadServe manifest for the cluster tests.
- `rendered(spec)` and `live_children(client, ns)`: what the operator renders, and what the cluster holds, of the
  kinds the renderer owns (`render.CHILD_KINDS`, its own list).
- The status inputs the condition tests read: a clock, a body, a StatefulSet and pods as the API server writes them.
"""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from typing import Any

import yaml

from kvoffload.api import crd
from kvoffload.api.quantity import to_bytes
from kvoffload.api.settings import Settings
from kvoffload.controller import pipeline
from kvoffload.engine import images
from kvoffload.planning.sizing import MemoryDefaults
from kvoffload.rendering import render

from .paths import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# The admin's tmpfs root for spec.offload.server PerNode that tests/cluster/demo-values.yaml gives the demo's operator
# (test_chart checks they agree): the examples are rendered with it, as the demo's operator renders them.
SHARED_MEMORY_ROOT = "/run/kvoffload-shm"
EXAMPLE_SETTINGS = Settings(shared_memory_root=SHARED_MEMORY_ROOT)
# The LMCache server container's memory request when the spec does not set resources.serverBaseline: its process (the
# operator's serverBaseline setting, declared once in api/settings.py) + headroom (headroomPercent, at least 1 GiB).
SERVER_BASELINE = to_bytes(Settings().server_baseline, "serverBaseline")
SERVER_REQUEST = SERVER_BASELINE + max(MemoryDefaults().headroom_min,
                                       -(-SERVER_BASELINE * Settings().headroom_percent // 100))
BASE: dict[str, Any] = {
    "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
    "engine": {"maxModelLen": 32768},
    "offload": {"cpu": {"size": "40Gi"}, "disk": {"path": "/mnt/nvme/lmcache", "size": "200Gi"}},
    "resources": {"gpuMemory": "80Gi"},
}
# What the local cluster's GPU nodes (tests/cluster/nodes.yaml, 141Gi H200s) hold.
SERVE_SPEC: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxModelLen": 16384},
    "offload": {"cpu": {"size": "16Gi"}, "disk": {"path": "/mnt/nvme/lmcache", "size": "100Gi"}},
    "resources": {"gpuMemory": "141Gi"},
}
# The serving image's engine pair (the operator's default image), spelt out in the spec: `spec(**PAIR)`.
_DEFAULT = images.KNOWN_IMAGES[images.DEFAULT_IMAGE]
PAIR = {"engine__image": images.DEFAULT_IMAGE, "engine__vllmVersion": _DEFAULT.vllm,
        "engine__lmcacheVersion": _DEFAULT.lmcache}
# Llama-3.1-8B's published config.json, the fields vLLM reads (no weights, no tokenizer needed).
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "head_dim": 128,
                "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128009, "tie_word_embeddings": False}
DELETE = object()


def _changed(obj: dict[str, Any], changes: dict[str, Any], sep: str, delete: object) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(sep)
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        if value is delete:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


def spec(base: dict[str, Any] | None = None, **patch: Any) -> dict[str, Any]:
    """`base` (BASE) with `a__b=value` overrides; a value of None deletes the key."""
    return _changed(BASE if base is None else base, patch, "__", None)


def patched(obj: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A copy of `obj` with dotted-path changes (`spec.offload.disk.path`); DELETE removes the key."""
    return _changed(obj, changes, ".", DELETE)


def serve(name: str, base: dict[str, Any] | None = None, **patch: Any) -> dict[str, Any]:
    """A KVOffloadServe manifest named `name`: spec(base or SERVE_SPEC, **patch)."""
    return {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": name},
            "spec": spec(SERVE_SPEC if base is None else base, **patch)}


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def rendered(spec_dict: dict[str, Any], settings: Settings | None = None, name: str = "svc",
             namespace: str = "team-a") -> list[dict[str, Any]]:
    """The children the operator renders for a spec."""
    return pipeline.desired(name, namespace, "uid-1", spec_dict, settings or Settings()).children


def pod_template(children: list[dict[str, Any]]) -> dict[str, Any]:
    return next(c for c in children if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]


CHILD_KINDS = tuple(kind for _, kind in render.CHILD_KINDS)
_PLURAL = {"NetworkPolicy": "networkpolicies"}


def child_resources() -> tuple[str, ...]:
    """Resource names (kubectl-style) of the kinds the operator owns."""
    return tuple(_PLURAL.get(kind, kind.lower() + "s") for kind in CHILD_KINDS)


def live_children(client: Any, namespace: str, owner: str | None = None, *,
                  labelled: bool = True) -> list[dict[str, Any]]:
    """Every object of the renderer's child kinds in `namespace`: those labelled as the operator's (of `owner`, when
    given), or all of them with labelled=False (to see what the operator may have left unlabelled)."""
    labels: Any = None
    if labelled:
        labels = {render.OWNER_LABEL: owner} if owner else render.OWNER_LABEL
    return [obj for resource in child_resources() for obj in client.list(resource, namespace, labels=labels)]


def children_by_name(client: Any, namespace: str, owner: str) -> dict[tuple[str, str], dict[str, Any]]:
    """live_children of `owner`, keyed (kind, name)."""
    return {(o["kind"], o["metadata"]["name"]): o for o in live_children(client, namespace, owner)}


def wait_condition(cluster: Any, namespace: str, name: str, type_: str, status: str, timeout: float = 90,
                   reason: str | None = None) -> dict[str, Any]:
    """The KVOffloadServe once its condition `type_` has `status` (and `reason`, when given)."""
    from .client import condition

    def check() -> dict[str, Any] | None:
        obj = cluster.client.get_or_none("kvs", name, namespace)
        c = condition(obj, type_)
        return obj if c.get("status") == status and (reason is None or c.get("reason") == reason) else None
    return cluster.wait_until(check, timeout=timeout, message=f"{name} {type_}={status}")


def wait_ready(cluster: Any, namespace: str, name: str, generation: int | None = None,
               timeout: float = 120) -> dict[str, Any]:
    """The KVOffloadServe once Ready=True for its generation (or `generation`)."""
    from .client import condition

    def check() -> dict[str, Any] | None:
        obj = cluster.client.get_or_none("kvs", name, namespace)
        gen = generation or obj["metadata"]["generation"]
        ok = condition(obj, "Ready").get("status") == "True" and obj["status"].get("observedGeneration") == gen
        return obj if ok else None
    return cluster.wait_until(check, timeout=timeout, message=f"{name} Ready at its generation")


# ----------------------------------------------------------------------------- status inputs

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
T1 = datetime(2026, 1, 2, tzinfo=timezone.utc)


def body(generation: int = 1, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "svc", "namespace": "ns", "generation": generation}, "status": status or {}}


def sts(replicas: int = 1, ready: int = 1, updated: int = 1, gen: int = 1, observed: int = 1, current: str = "r1",
        update: str = "r1") -> dict[str, Any]:
    return {"metadata": {"generation": gen}, "status": {"replicas": replicas, "readyReplicas": ready,
                                                        "updatedReplicas": updated,
                                                        "observedGeneration": observed, "currentRevision": current,
                                                        "updateRevision": update}}


def pod(name: str = "svc-0", node: str = "gpu-node-0", scheduled: bool = True, message: str = "",
        initialized: bool = True) -> dict[str, Any]:
    conds = [{"type": "PodScheduled", "status": "True" if scheduled else "False",
              **({} if scheduled else {"reason": "Unschedulable", "message": message})},
             {"type": "Initialized", "status": "True" if initialized else "False"}]
    return {"metadata": {"name": name}, "spec": {"nodeName": node} if scheduled else {},
            "status": {"conditions": conds}}


def ready_pod(name: str = "svc-0") -> dict[str, Any]:
    p = pod(name)
    p["status"]["conditions"].append({"type": "Ready", "status": "True"})
    return p
