"""Property-based fuzzing of the pure pipeline: spec dict -> Spec -> Budget -> children.

For any input, `pipeline.desired` either raises a ConfigError naming a `spec.` / `metadata.`
field, or returns children that are valid manifests (kinds, names, memory = limit >= CPU tier,
GPU limit = TP, LMCache sizes per worker x TP = totals, hostPath only below an allowed root and
always with a per-pod subPathExpr, no managed flag or env var overridden, YAML round-trips).

Bounded for `make test` (a few hundred examples, derandomized so CI is stable); set
KVO_FUZZ_EXAMPLES=5000 for a longer, randomized run.
"""

from __future__ import annotations

import copy
import json
import math
import os
import posixpath
import re
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes.utils.quantity import parse_quantity

from kvoffload.api import crd
from kvoffload.api.errors import ConfigError
from kvoffload.api.quantity import GiB
from kvoffload.api.settings import Settings
from kvoffload.controller import pipeline
from kvoffload.engine import flags as vllm_flags
from kvoffload.planning import catalog
from kvoffload.rendering import render
from kvtest.strategies import SMALL_MODELS, anything, valid_specs

EXAMPLES = int(os.environ.get("KVO_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=EXAMPLES or 250, deadline=None, derandomize=not EXAMPLES, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ_SMALL = settings(FUZZ, max_examples=EXAMPLES or 80)
SETTINGS = Settings()
CHILD_KINDS = {kind for _, kind in render.CHILD_KINDS}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
QUANTITY = re.compile(r"[+-]?([0-9]+([.][0-9]*)?|[.][0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i|[mkMGTPE])?")
FIELD = re.compile(r"(spec|metadata)(\.[A-Za-z0-9_.\[\]]+)?")

# Plausible wrong values, per field: what a user could type.
BAD_VALUES: dict[str, list[Any]] = {
    "offload.disk.path": ["/mnt/nvme", "/mnt/nvme/", "/mnt/nvme/../../etc", "/mnt/nvme/./x", "//mnt/nvme/x",
                          "/mnt/nvme//x",
                          "mnt/nvme/x", "/etc/kv", "/mnt/nvme2/x", "/", "", "/mnt/nvme/x/..", "/var/lib/kvoffload",
                          "/mnt/nvme/x y"],
    "offload.cpu.size": ["10 Gi", "-1", "1e400", "", "Infinity", "NaN", "0", "1.5.5Gi", "1Ki5", "1Gi\n", "2Pi", True,
                         40.5],
    "offload.chunkSize": [0, 100000, -1, "256", 256.5],
    "offload.cpu.evictionPolicy": ["lru", "RANDOM", "", None],
    "offload.disk.reclaimPolicy": ["Recycle", "delete"],
    "engine.extraArgs": [["--max-model-len=1"], ["--max_model_len", "1"], ["--kv-transfer-config.kv_connector=X"],
                         ["-tp=2"],
                         ["--model"], "--enforce-eager", [1]],
    "engine.env": [[{"name": "LMCACHE_LOCAL_DISK", "value": "True"}], [{"name": "POD_NAMESPACE", "value": "victim"}],
                   [{"name": "PYTHONHASHSEED", "value": "1"}], [{"value": "x"}], [{"name": "A", "value": 1}], "A=1"],
    "engine.tensorParallelSize": [0, 3, 65, "2", True],
    "engine.gpuMemoryUtilization": [0, 1.5, -0.1, "0.9", float("nan")],
    "engine.maxModelLen": [8, 16777217, 10**7, "long", None],
    "engine.image": ["registry.example/unknown:1", ["x"], 5],
    "engine.vllmVersion": ["0.5.0", "latest", 5],
    "model.name": ["acme/unknown", "bad name!", "", "x" * 300, 7],
    "model.architecture": [{"layers": 32}, {"kvHeads": 3, "attentionHeads": 32}, {"layers": 0}, {"layers": 2000},
                           "big"],
    "model.kvDtype": ["int4", "FP8"],
    "resources.gpuMemory": ["1Gi", "0", "1e400", "1Ei"],
    "resources.gpuResourceName": ["memory", "cpu", "gpu", ""],
    "resources.memory": ["1Gi", "-5Gi", "2Pi"],
    "resources.cpu": ["lots", "0", "-1"],
    "resources.headroomPercent": [101, -1, "10"],
    "replicas": [-1, 1001, "2", True, 2.5],
    "metrics.port": [80, 70000, "9400"],
    "metrics.enabled": ["false", 0],
    "scheduling.nodeSelector": [{"kvoffload.io/nvme": "false"}, {"bad key": "x"}, {"a": "x" * 64}, {"a": 1}, ["a"]],
    "scheduling.tolerations": ["all", [1], {}],
    "scheduling.priorityClassName": ["Bad_Class", 7],
    "model.hfTokenSecret.name": ["Bad_Name", 5, ""],
    "model.cache.claimName": ["a/b", ["x"]],
}

def _container_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a dict in `node` (where garbage can be put)."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, dict):
                out += _container_paths(v, (*prefix, k))
    return out


@st.composite
def garbage_specs(draw) -> Any:
    """A valid spec with 1-3 values replaced: plausible mistakes for that field, or random values of random types
    at random places (existing keys or new ones); sometimes the whole spec is garbage."""
    spec = draw(valid_specs())
    leaves = sorted(crd.leaf_paths())
    for _ in range(draw(st.integers(1, 3))):
        choice = draw(st.integers(0, 2))
        if choice == 0:
            path = tuple(draw(st.sampled_from(sorted(BAD_VALUES))).split("."))
            value = draw(st.sampled_from(BAD_VALUES[".".join(path)]))
        elif choice == 1:
            path, value = tuple(draw(st.sampled_from(leaves)).split(".")), draw(anything)
        else:
            parent = draw(st.sampled_from(_container_paths(spec)))
            path = (*parent, draw(st.one_of(st.sampled_from(["size", "path", "name", "x", "cpu", "disk"]),
                                            st.text(max_size=8))))
            value = draw(anything)
        node = spec
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    return spec if draw(st.integers(0, 9)) else draw(anything)


good_names = st.one_of(st.from_regex(r"[a-z]([-a-z0-9]{0,50}[a-z0-9])?", fullmatch=True),
                       st.sampled_from(["svc", "a" * 52]))
names = st.one_of(good_names, st.sampled_from(["a" * 53, "my.serve", "7b", "Serve", "", "x-", "-x"]),
                  st.text(max_size=60))

# ----------------------------------------------------------------------------- the properties


def bytes_of(q: str) -> int:
    assert isinstance(q, str) and QUANTITY.fullmatch(q), q
    return int(parse_quantity(q))


def check_children(name: str, spec_dict: dict[str, Any], d: pipeline.Desired) -> None:
    spec, kids = d.spec, d.children
    kinds = [c["kind"] for c in kids]
    assert set(kinds) <= CHILD_KINDS and sorted(kinds) == sorted(["ConfigMap", "Service", "Service", "StatefulSet",
                                                                   "PodDisruptionBudget"]
                                                                  + (["NetworkPolicy"] if spec.network_policy else []))
    for child in kids:
        meta = child["metadata"]
        assert len(meta["name"]) <= 63 and DNS_LABEL.fullmatch(meta["name"]), meta["name"]
        assert meta["namespace"] == "ns" and meta["labels"][render.OWNER_LABEL] == name
        assert all(len(v) <= 63 and LABEL_VALUE.fullmatch(v) for v in meta["labels"].values())
        assert meta["ownerReferences"][0]["uid"] == "uid-1"
    sts = next(c for c in kids if c["kind"] == "StatefulSet")
    assert sts["spec"]["replicas"] == spec.replicas
    last_pod = f"{sts['metadata']['name']}-{max(spec.replicas - 1, 0)}"
    assert len(last_pod) <= 63 and DNS_LABEL.fullmatch(last_pod)
    pod = sts["spec"]["template"]["spec"]
    containers = pod["containers"] + pod.get("initContainers", [])
    for c in containers:
        assert DNS_LABEL.fullmatch(c["name"])
        assert all(isinstance(a, str) for a in c.get("command", []) + c.get("args", [])), c.get("args")
        for e in c.get("env", []):
            assert (isinstance(e["name"], str) and isinstance(e.get("value", ""), str)
                    and isinstance(e.get("valueFrom", {}), dict))
    vllm = pod["containers"][0]
    res, tp = vllm["resources"], spec.engine.tensor_parallel_size
    assert res["requests"]["memory"] == res["limits"]["memory"]
    assert bytes_of(res["limits"]["memory"]) >= spec.offload.cpu_size
    if spec.resources.memory is None:
        assert bytes_of(res["limits"]["memory"]) > spec.offload.cpu_size
    bytes_of(res["requests"]["cpu"])
    gpu = spec.resources.gpu_resource_name
    assert gpu not in ("cpu", "memory") and "/" in gpu
    assert res["limits"][gpu] == res["requests"][gpu] == str(tp)
    # Every refused flag (managed, GPU count, memory budget) appears at most once: as the operator rendered it.
    table = vllm_flags.table(spec.engine.vllm_version)
    dests = [table.options[a.split("=")[0]].dest for a in vllm["args"] if a.startswith("--") and table]
    for dest in set(dests):
        if dest in vllm_flags.REFUSED_DESTS:
            assert dests.count(dest) == 1, (dest, vllm["args"])
    env_names = [e["name"] for e in vllm["env"]]
    for managed in crd.MANAGED_ENV:
        assert env_names.count(managed) <= 1, env_names
    assert [n for n in env_names if n.startswith(crd.MANAGED_ENV_PREFIX)] == ["LMCACHE_CONFIG_FILE"]
    assert vllm["args"][vllm["args"].index("--tensor-parallel-size") + 1] == str(tp)
    # LMCache sizes: GiB per worker x TP = the per-replica totals.
    cm = next(c for c in kids if c["kind"] == "ConfigMap")
    lmcache = yaml.load(cm["data"]["lmcache.yaml"], Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert lmcache["chunk_size"] == spec.offload.chunk_size and lmcache["local_cpu"] is True
    assert math.isclose(lmcache["max_local_cpu_size"] * tp, spec.offload.cpu_size / GiB, rel_tol=1e-9,
                        abs_tol=1e-6 * tp)
    if spec.offload.disk:
        assert math.isclose(lmcache["max_local_disk_size"] * tp, spec.offload.disk.size / GiB, rel_tol=1e-9,
                            abs_tol=1e-6 * tp)
    else:
        assert "local_disk" not in lmcache and "max_local_disk_size" not in lmcache
    # hostPath: exactly an allowed root (never a tenant's path), and every mount a subPath below it: the tenant's
    # part of the path, then the pod's own directory (the init container: its parent, <namespace>/<name>).
    volumes = {v["name"]: v for v in pod["volumes"]}
    for v in volumes.values():
        if "hostPath" in v:
            path = v["hostPath"]["path"]
            assert path in SETTINGS.allowed_disk_roots and v["hostPath"]["type"] == "Directory", v
            assert spec.offload.disk is not None and spec.offload.disk.path is not None
            rel = spec.offload.disk.path[len(path):].strip("/")
            assert rel and posixpath.normpath(rel) == rel and not rel.startswith(".."), rel
            for c in containers:
                for m in c.get("volumeMounts", []):
                    if m["name"] == v["name"]:
                        own = f"{rel}/$(POD_NAMESPACE)/{name}" + ("" if c["name"] == "prepare-disk-tier"
                                                                  else "/$(POD_NAME)")
                        assert m["subPathExpr"] == own, m
    for c in containers:
        assert {m["name"] for m in c.get("volumeMounts", [])} <= set(volumes)
    # Plain data: YAML and JSON round-trip.
    text = yaml.dump_all(kids, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper))
    assert list(yaml.load_all(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))) == kids
    assert json.loads(json.dumps(kids)) == kids


def run_pipeline(name: Any, spec_dict: Any) -> pipeline.Desired | None:
    original = copy.deepcopy(spec_dict)
    try:
        d = pipeline.desired(name, "ns", "uid-1", spec_dict, SETTINGS)
    except ConfigError as err:
        assert isinstance(err.field, str) and FIELD.fullmatch(err.field), err.field
        assert err.message and isinstance(err.message, str)
        d = None
    assert spec_dict == original or (isinstance(original, float) and math.isnan(original)), (
        "the pipeline must not mutate its input")
    return d


@FUZZ
@given(name=good_names, spec_dict=valid_specs())
def test_valid_specs_render_valid_manifests_or_name_the_field(name, spec_dict):
    d = run_pipeline(name, spec_dict)
    if d is not None:
        check_children(name, spec_dict, d)


@FUZZ
@given(name=names, spec_dict=garbage_specs())
def test_garbage_never_crashes_the_pipeline(name, spec_dict):
    d = run_pipeline(name, spec_dict)
    if d is not None:
        check_children(name, spec_dict, d)


@FUZZ_SMALL
@given(model=st.sampled_from(SMALL_MODELS), tp=st.sampled_from([1, 2, 4, 8]), cpu_gib=st.integers(1, 512),
       disk_gib=st.integers(0, 4096), max_len=st.integers(256, 32768), gpu=st.sampled_from(["80Gi", "141Gi"]),
       seqs=st.integers(1, 512))
def test_plausible_specs_mostly_succeed(model, tp, cpu_gib, disk_gib, max_len, gpu, seqs):
    """Not everything is an error: well-formed specs render (or fail only on GPU sizing or TP, naming that field)."""
    spec_dict = {"model": {"name": model}, "engine": {"maxModelLen": max_len, "tensorParallelSize": tp,
                                                      "maxNumSeqs": seqs},
                 "offload": {"cpu": {"size": f"{cpu_gib}Gi"}}, "resources": {"gpuMemory": gpu}}
    if disk_gib:
        spec_dict["offload"]["disk"] = {"path": "/mnt/nvme/kv", "size": f"{disk_gib}Gi"}
    try:
        d = pipeline.desired("svc", "ns", "uid-1", spec_dict, SETTINGS)
    except ConfigError as err:
        assert (err.field
                in ("spec.resources.gpuMemory", "spec.engine.maxModelLen", "spec.engine.tensorParallelSize")), err
        return
    check_children("svc", spec_dict, d)
    assert d.budget.tier("cpu").bytes == cpu_gib * GiB


def test_known_crashers_are_config_errors():
    """Inputs that once escaped as OverflowError, InvalidOperation, TypeError or AttributeError."""
    base = {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxModelLen": 16384},
            "offload": {"cpu": {"size": "16Gi"}, "disk": {"path": "/mnt/nvme/lmcache", "size": "100Gi"}}}
    crashers = [
        ("offload.cpu.size", "1e400"), ("offload.cpu.size", "Infinity"), ("offload.cpu.size", "NaN"),
        ("offload.cpu.size", True),
        ("offload.cpu.size", float("inf")), ("offload.cpu.size", "10 Gi"), ("offload.cpu.size", "1e999999999"),
        ("resources.gpuMemory", "1e400"), ("resources.shm", "1e400"), ("resources.engineBaseline", "9Ei"),
        ("engine.image", ["x"]), ("engine.vllmVersion", 5), ("engine.env", [{"name": 5}]),
        ("engine.env", [{"name": "A", "value": 5}]),
        ("engine.extraArgs", "abc"), ("engine.extraArgs", [5]), ("engine.extraArgs", ["--max_model_len=1"]),
        ("engine.extraArgs", ["--kv-transfer-config.kv_connector=X"]),
        ("engine.env", [{"name": "POD_NAMESPACE", "value": "victim"}]),
        ("resources.gpuResourceName", ["a"]), ("resources.gpuResourceName", "memory"), ("offload.disk.path", 5),
        ("model.servedName", 5), ("model.hfTokenSecret", {"name": 5}), ("model.cache", {"claimName": ["x"]}),
        ("model.cache", {"claimName": "pvc", "readOnly": "false"}), ("metrics", {"enabled": "false"}),
        ("scheduling", {"priorityClassName": 7}), ("scheduling", {"nodeSelector": {"bad key": "x"}}),
        ("model.architecture", {"layers": 2000}),
    ]
    for dotted, value in crashers:
        spec_dict = copy.deepcopy(base)
        *parents, leaf = dotted.split(".")
        node = spec_dict
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
        try:
            pipeline.desired("svc", "ns", "uid-1", spec_dict, SETTINGS)
        except ConfigError as err:
            assert err.field.startswith("spec." + dotted.split(".")[0]), (dotted, err)
        else:
            raise AssertionError(f"{dotted}={value!r} was accepted")
    for bad_name in ("my.serve", "7b", "Serve", "a" * 53, ""):
        try:
            pipeline.desired(bad_name, "ns", "uid-1", base, SETTINGS)
        except ConfigError as err:
            assert err.field == "metadata.name"
        else:
            raise AssertionError(f"name {bad_name!r} was accepted")


def test_every_catalog_model_renders_at_its_natural_tp():
    for hf_id in catalog.known_models():
        model = catalog.lookup(hf_id)
        tp = next(t for t in (1, 2, 4, 8, 16) if model.params * 2 / t < 100 * GiB and model.attention_heads % t == 0)
        spec_dict = {"model": {"name": hf_id}, "engine": {"maxModelLen": 4096, "tensorParallelSize": tp},
                     "offload": {"cpu": {"size": "64Gi"}, "disk": {"path": "/var/lib/kvoffload/kv", "size": "1Ti"}},
                     "resources": {"gpuMemory": "141Gi"}}
        check_children("svc", spec_dict, pipeline.desired("svc", "ns", "uid-1", spec_dict, SETTINGS))
