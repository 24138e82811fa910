"""Removing a field from a KVOffloadServe's spec removes it from the live children, for every optional
spec field, on the real API server (GitOps users remove fields all the time).

Each row of FIELDS sets one optional field (plus what it needs), waits until the operator rolled that
generation out and the field reached the live children, then removes the field with a JSON patch and
waits for the next generation. The live children must then hold exactly the operator's rendering of
the spec as the API server now holds it (with its defaults): every field the rendering sets, with its
value; no path that only the old rendering had; no child that only the old rendering had (pruned); and
status.budget the new budget. A row whose field the operator only reads (a check, or the node
cleaner's policy) says so, and its children must not move.

The table covers every optional field of the CRD schema (`test_the_table_covers_every_optional_field`),
so a new field fails here until it has a row.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvoffload.api import crd
from kvoffload.api.settings import from_dict
from kvoffload.controller import pipeline
from kvoffload.controller.reconcile import covers
from kvoffload.rendering import render, shared_cache
from kvtest import OperatorProcess, condition

BASE = {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxModelLen": 4096},
        "offload": {"cpu": {"size": "1Gi"}}}
NO_PODS = {"replicas": 0}  # only the children matter here; the replicas row alone makes a pod
DISK = {"offload": {"disk": {"path": "/mnt/nvme/lmcache", "size": "10Gi"}}}
# What the operator below runs with, so the test renders as it does; its admin allows registry.local's images.
# sharedMemoryRoot: the admin's tmpfs root, without which spec.offload.server PerNode is refused
# (nothing else reads it).
CONFIG = {"resyncSeconds": 20, "allowedImages": ["registry.local/*"], "sharedMemoryRoot": "/run/kvoffload-shm"}
SETTINGS = from_dict(CONFIG)
# A KEDA-only field is checked against this setting in the table test; the operator below (autoscaler hpa)
# must refuse it instead, naming the field to change.
KEDA_SETTINGS = from_dict({**CONFIG, "autoscaler": "keda", "prometheusAddress": "http://127.0.0.1:9090"})
SCALE = {"maxReplicas": 3, "targets": {"waitingRequestsPerReplica": 4}}


@dataclass(frozen=True)
class Row:
    path: str  # the optional field, dotted under spec
    value: Any
    needs: dict[str, Any] = field(default_factory=lambda: dict(NO_PODS))  # what else the spec must hold
    instead: dict[str, Any] | None = None  # removable only by setting its alternative (a one-of pair)
    renders: bool = True  # False: the operator only reads it (a check, the node cleaner); nothing moves
    refused_by_hpa: str | None = None  # KEDA only: with autoscaler hpa, generation 1 is refused naming this field


FIELDS = [
    Row("model.servedName", "my-model"),
    Row("model.architecture", {"layers": 40, "attentionHeads": 28, "kvHeads": 4, "headDim": 128,
                               "parameters": 7615616512}),
    Row("model.architecture.layers", 40),
    Row("model.architecture.attentionHeads", 56, renders=False),  # only checked (TP must divide it)
    Row("model.architecture.kvHeads", 2),
    Row("model.architecture.headDim", 64),
    Row("model.architecture.parameters", 20_000_000_000),
    Row("model.kvDtype", "fp8"),
    Row("model.hfTokenSecret", {"name": "hf"}),
    Row("model.hfTokenSecret.key", "tok", needs={**NO_PODS, "model": {"hfTokenSecret": {"name": "hf"}}}),
    Row("model.cache", {"claimName": "weights"}),
    Row("model.cache.readOnly", True, needs={**NO_PODS, "model": {"cache": {"claimName": "weights"}}}),
    Row("replicas", 0, needs={}),
    Row("engine.image", "registry.local/vllm:custom",
        needs={**NO_PODS, "engine": {"vllmVersion": "0.33.0", "lmcacheVersion": "0.5.6"}}),
    # On a known image a declared version must be the image's own (engine/images.py resolve): a check, nothing moves.
    Row("engine.vllmVersion", "0.33.0", renders=False),
    Row("engine.lmcacheVersion", "0.5.6", renders=False),
    Row("engine.gpuMemoryUtilization", 0.8),
    Row("engine.maxNumSeqs", 64),
    Row("engine.tensorParallelSize", 2),
    Row("engine.dtype", "float16"),
    Row("engine.extraArgs", ["--enable-chunked-prefill"]),
    Row("engine.env", [{"name": "FOO", "value": "1"}]),
    Row("engine.apiKeySecretRef", {"name": "api"}),
    Row("engine.apiKeySecretRef.key", "k", needs={**NO_PODS, "engine": {"apiKeySecretRef": {"name": "api"}}}),
    Row("offload.backend", "lmcache-server"),
    Row("offload.chunkSize", 512),
    # PerNode: the node-local Service and the NetworkPolicy appear (no replica, so no node server), the vLLM line
    # connects to that Service instead of the sidecar, which goes.
    Row("offload.server", "PerNode", needs={**NO_PODS, "offload": {"backend": "lmcache-server"}}),
    Row("offload.cpu.evictionPolicy", "LFU"),
    Row("offload.cpu.readGbps", 20),
    Row("offload.disk.readGbps", 1.5, needs={**NO_PODS, **DISK}),
    Row("offload.disk", {"path": "/mnt/nvme/lmcache", "size": "10Gi"}),
    Row("offload.disk.path", "/mnt/nvme/lmcache", needs={**NO_PODS, "offload": {"disk": {"size": "10Gi"}}},
        instead={"storageClassName": "local-nvme"}),
    Row("offload.disk.storageClassName", "local-nvme", needs={**NO_PODS, "offload": {"disk": {"size": "10Gi"}}},
        instead={"path": "/mnt/nvme/lmcache"}),
    Row("offload.disk.reclaimPolicy", "Retain", needs={**NO_PODS, **DISK}, renders=False),  # the node cleaner reads it
    Row("offload.disk.nodeSelector", {"disk": "fast"}, needs={**NO_PODS, **DISK}),
    Row("resources", {"gpuMemory": "141Gi", "cpu": "8"}),
    Row("resources.gpuResourceName", "example.com/gpu"),
    Row("resources.gpuMemory", "141Gi"),
    Row("resources.cpu", "8"),
    Row("resources.memory", "64Gi"),
    Row("resources.engineBaseline", "8Gi"),
    Row("resources.perWorkerOverhead", "4Gi"),
    Row("resources.stagingPerWorker", "2Gi"),
    Row("resources.serverBaseline", "5Gi",  # above LMCache 0.5.6's 4Gi floor, which is also its default
        needs={**NO_PODS, "offload": {"backend": "lmcache-server"}}),
    Row("resources.shm", "4Gi"),
    Row("resources.headroomPercent", 20),
    Row("scheduling", {"nodeSelector": {"zone": "a"}}),
    Row("scheduling.nodeSelector", {"zone": "a"}),
    Row("scheduling.tolerations", [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]),
    Row("scheduling.affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}),
    Row("scheduling.priorityClassName", "high"),
    Row("scheduling.topologySpreadConstraints", [{"maxSkew": 1, "topologyKey": "zone",
                                                  "whenUnsatisfiable": "ScheduleAnyway"}]),
    Row("metrics", {"enabled": False}),
    Row("metrics.enabled", False),
    Row("metrics.port", 9500),
    Row("networkPolicy", {}),
    Row("networkPolicy.servingFrom", ["team-a"]),
    Row("networkPolicy.metricsFrom", ["prom"]),
    Row("autoscaling", SCALE),  # replicas 0: the HPA controller leaves a scaled-to-zero target alone
    Row("autoscaling.minReplicas", 2, needs={**NO_PODS, "autoscaling": SCALE}),
    Row("autoscaling.scaleUpPeriodSeconds", 60, needs={**NO_PODS, "autoscaling": SCALE}),
    Row("autoscaling.scaleDownWindowSeconds", 900, needs={**NO_PODS, "autoscaling": SCALE}),
    Row("autoscaling.targets.waitingRequestsPerReplica", 8,
        needs={**NO_PODS, "autoscaling": {**SCALE, "targets": {"kvCacheUsagePercent": 80}}}),
    Row("autoscaling.targets.kvCacheUsagePercent", 80, needs={**NO_PODS, "autoscaling": SCALE}),
    Row("autoscaling.targets.queueTimeP90Milliseconds", 20, needs={**NO_PODS, "autoscaling": SCALE}),
    Row("autoscaling.wakeQuery", "sum(gateway_queued{namespace='ns',model='m'})",
        needs={**NO_PODS, "autoscaling": {**SCALE, "minReplicas": 0}}, instead={"minReplicas": 1},
        refused_by_hpa="spec.autoscaling.minReplicas"),
    # spec.routing: removing it prunes the router's Deployment, Service, ServiceAccount, Role and RoleBinding.
    Row("routing", {}),
    Row("routing.enabled", False, needs={**NO_PODS, "routing": {}}),
    Row("routing.policy", "round_robin", needs={**NO_PODS, "routing": {}}),
    Row("routing.replicas", 2, needs={**NO_PODS, "routing": {}}),
]


def optional_paths(schema: dict[str, Any], prefix: str = "") -> list[str]:
    """Every optional field of the schema, dotted (fields inside an optional object included); not the removed
    ones (crd.REMOVED_TARGETS: in the schema only to be refused)."""
    out = []
    for name, sub in (schema.get("properties") or {}).items():
        path = prefix + name
        if path in {f"autoscaling.targets.{t}" for t in crd.REMOVED_TARGETS}:
            continue
        if name not in schema.get("required", []):
            out.append(path)
        if sub.get("type") == "object":
            out += optional_paths(sub, path + ".")
    return out


def merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and v and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def with_field(row: Row) -> dict[str, Any]:
    spec = merged(BASE, row.needs)
    *head, last = row.path.split(".")
    node = spec
    for key in head:
        node = node.setdefault(key, {})
    node[last] = copy.deepcopy(row.value)
    return spec


def without_field(row: Row) -> dict[str, Any]:
    """The spec once `removal` is applied (before the API server's defaults)."""
    spec = merged(BASE, row.needs)
    if row.instead:
        parent = row.path.rsplit(".", 1)[0].split(".")
        node = spec
        for key in parent:
            node = node.setdefault(key, {})
        node.update(copy.deepcopy(row.instead))
    return spec


def removal(row: Row) -> list[dict[str, Any]]:
    """The JSON patch that removes the field (or swaps it for its alternative)."""
    pointer = "/spec/" + row.path.replace(".", "/")
    ops = [{"op": "remove", "path": pointer}]
    for key, value in (row.instead or {}).items():
        ops.append({"op": "add", "path": pointer.rsplit("/", 1)[0] + "/" + key, "value": value})
    return ops


def _item_key(i: int, item: Any) -> Any:
    """A list item's place: its name where it has one (containers, volumes, env: server-side apply merges those
    lists by name, so an item's index moves when one before it goes), else its index."""
    return ("name", item["name"]) if isinstance(item, dict) and isinstance(item.get("name"), str) else i


def leaves(obj: Any, path: tuple = ()) -> dict[tuple, Any]:
    """Every leaf of an object by its path (list items by name or index; an empty map or list is a leaf)."""
    if isinstance(obj, dict) and obj:
        return {p: v for k, sub in obj.items() for p, v in leaves(sub, (*path, k)).items()}
    if isinstance(obj, list) and obj:
        return {p: v for i, sub in enumerate(obj) for p, v in leaves(sub, (*path, _item_key(i, sub))).items()}
    return {path: obj}


def has_path(obj: Any, path: tuple) -> bool:
    for key in path:
        if isinstance(obj, dict) and key in obj:
            obj = obj[key]
        elif isinstance(obj, list) and isinstance(key, tuple):
            found = [x for x in obj if isinstance(x, dict) and x.get("name") == key[1]]
            if not found:
                return False
            obj = found[0]
        elif isinstance(obj, list) and isinstance(key, int) and key < len(obj):
            obj = obj[key]
        else:
            return False
    return True


def key(child: dict[str, Any]) -> tuple[str, str]:
    return child["kind"], child["metadata"]["name"]


def name_of(row: Row) -> str:
    return "f-" + row.path.lower().replace(".", "-")[:48]


def rendered(obj: dict[str, Any], cluster: Any) -> pipeline.Desired:
    """What the operator renders for the resource as the API server holds it (defaults filled in). PerNode: with its
    Service's ClusterIP, which the operator reads back and writes into the vLLM line (no node runs a replica here, so
    no node server)."""
    meta = obj["metadata"]
    address = ""
    if ((obj["spec"].get("offload") or {}).get("server")) == "PerNode":
        svc = cluster.client.get_or_none("services", shared_cache.service_name(meta["name"]), meta["namespace"])
        address = ((svc or {}).get("spec") or {}).get("clusterIP", "")
    return pipeline.desired(meta["name"], meta["namespace"], meta["uid"], obj["spec"], SETTINGS, address=address)


def test_the_table_covers_every_optional_field():
    assert sorted(r.path for r in FIELDS) == sorted(optional_paths(crd.spec_schema()))
    for row in FIELDS:  # each row really changes what the operator renders, or says it does not
        settings = KEDA_SETTINGS if row.refused_by_hpa else SETTINGS
        before, after = (pipeline.desired("x", "ns", "u", s, settings) for s in (with_field(row), without_field(row)))
        moved = before.applied != after.applied or before.budget.to_dict() != after.budget.to_dict()
        assert moved == row.renders, row.path


@pytest.fixture
def operator(cluster, crd_installed, namespace):
    proc = OperatorProcess(cluster.env, [namespace], CONFIG)
    yield proc
    proc.stop()
    print(proc.output()[-3000:])


def live_children(cluster, ns: str, name: str) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for _, kind in render.CHILD_KINDS:
        for item in cluster.client.list(kind.lower(), ns, labels={render.OWNER_LABEL: name}):
            out[(kind, item["metadata"]["name"])] = item
    return out


def rolled_out(cluster, ns: str, name: str, generation: int, refused: str | None = None) -> dict[str, Any] | None:
    """The resource once the operator handled `generation`: valid, or (`refused`) refused naming that field."""
    obj = cluster.client.get("kvs", name, ns)
    st = obj.get("status") or {}
    if obj["metadata"]["generation"] == generation and st.get("observedGeneration") == generation:
        valid = condition(obj, "ConfigValid")
        if refused:
            assert valid["status"] == "False" and refused in valid["message"], valid
        else:
            assert valid["status"] == "True", valid
        return obj
    return None


@pytest.mark.cluster
def test_removing_any_optional_field_removes_it_from_the_children(cluster, namespace, operator):
    for row in FIELDS:
        cluster.client.create({"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND,
                               "metadata": {"name": name_of(row)}, "spec": with_field(row)}, namespace)
    before: dict[str, pipeline.Desired | None] = {}
    for row in FIELDS:
        obj = cluster.wait_until(lambda row=row: rolled_out(cluster, namespace, name_of(row), 1, row.refused_by_hpa),
                                 timeout=120, message=f"{row.path}: generation 1 rolled out")
        if row.refused_by_hpa:  # nothing was rendered; the removal below must then roll out in full
            before[row.path] = None
            continue
        before[row.path] = rendered(obj, cluster)
        live = live_children(cluster, namespace, name_of(row))
        for child in before[row.path].applied:  # the field reached the live children
            assert key(child) in live and covers(child, live[key(child)]), (row.path, key(child))
    for row in FIELDS:
        cluster.client.patch("kvs", name_of(row), removal(row), namespace, type="json")
    failures = []
    for row in FIELDS:
        name = name_of(row)
        obj = cluster.wait_until(lambda name=name: rolled_out(cluster, namespace, name, 2), timeout=120,
                                 message=f"{row.path}: removal rolled out")
        after, old = rendered(obj, cluster), before[row.path]
        live = live_children(cluster, namespace, name)
        new_keys = {key(c) for c in after.applied}
        if set(live) != new_keys:
            failures.append(f"{row.path}: children {sorted(live)}, expected {sorted(new_keys)}")
        if (obj["status"].get("budget") or {}) != after.budget.to_dict():
            failures.append(f"{row.path}: status.budget is not the budget without the field")
        olds = {key(c): c for c in old.applied} if old else {}
        for child in after.applied:
            have = live.get(key(child))
            if have is None:
                continue
            if not covers(child, have):
                failures.append(f"{row.path}: live {key(child)} differs from the rendering without the field")
            old_child = olds.get(key(child))
            gone = [p for p in leaves(old_child) if p not in leaves(child) and has_path(have, p)] if old_child else []
            if gone:
                failures.append(f"{row.path}: live {key(child)} still holds {gone[:5]}")
        if not row.renders:
            assert old is not None and old.applied == after.applied, row.path
    assert not failures, "\n".join(failures)
