"""One source of truth: crds/, the chart's CRD and the Python parser agree with kvoffload.api.crd."""

import dataclasses

import yaml

from kvoffload.api import crd
from kvoffload.api.settings import Settings
from kvoffload.api.spec import parse
from kvoffload.cli import generate
from kvtest import ROOT

FULL_SPEC = {
    "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "servedName": "llama", "kvDtype": "fp8",
              "architecture": {"layers": 32, "attentionHeads": 32, "kvHeads": 8, "headDim": 128,
                               "parameters": 8030261248},
              "hfTokenSecret": {"name": "hf", "key": "token"}, "cache": {"claimName": "models", "readOnly": True}},
    "replicas": 2,
    "engine": {"image": "registry.example/mirror/vllm-lmcache:1", "vllmVersion": "0.26.0", "lmcacheVersion": "0.5.3",
               "maxModelLen": 32768, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 16, "tensorParallelSize": 2,
               "dtype": "bfloat16", "extraArgs": ["--enable-prefix-caching"],
               "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}],
               "apiKeySecretRef": {"name": "vllm-api-key", "key": "api-key"}},
    "offload": {"backend": "lmcache", "chunkSize": 256,
                "cpu": {"size": "40Gi", "evictionPolicy": "LFU", "readGbps": 50},
                "disk": {"path": "/mnt/nvme/kv", "size": "100Gi", "reclaimPolicy": "Retain",
                         "nodeSelector": {"kvoffload.io/nvme": "true"}, "readGbps": 6.5}},
    "resources": {"gpuResourceName": "nvidia.com/gpu", "gpuMemory": "80Gi", "cpu": "8", "memory": "120Gi",
                  "engineBaseline": "4Gi", "perWorkerOverhead": "2Gi", "stagingPerWorker": "1Gi", "shm": "4Gi",
                  "headroomPercent": 10},
    "scheduling": {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                   "affinity": {}, "priorityClassName": "serving",
                   "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                                  "whenUnsatisfiable": "DoNotSchedule"}]},
    "metrics": {"enabled": True, "port": 9400},
    "networkPolicy": {"servingFrom": ["gateway"], "metricsFrom": ["monitoring"]},
    "routing": {"enabled": True, "policy": "cache_aware", "replicas": 2},
}

# The disk tier is either a hostPath or an ephemeral volume: one spec cannot set both.
EPHEMERAL_SPEC = {**FULL_SPEC, "offload": {**FULL_SPEC["offload"],
                                           "disk": {"storageClassName": "local-nvme", "size": "100Gi"}}}
# Fields of one backend only (backends/*.refuses): the LMCache server's memory needs backend lmcache-server (LRU).
SERVER_SPEC = {**FULL_SPEC, "offload": {**FULL_SPEC["offload"], "backend": "lmcache-server", "cpu": {"size": "40Gi"},
                                        "server": "PerNode"},
               # PerNode needs LMCache >= 0.5.6 (engine/images.SHARED_SERVER_MIN_LMCACHE), whose server floor is 4Gi.
               "engine": {**FULL_SPEC["engine"], "vllmVersion": "0.33.0", "lmcacheVersion": "0.5.6"},
               "resources": {**FULL_SPEC["resources"], "serverBaseline": "4Gi"}}


def test_generated_files_are_current():
    assert generate.main(["--root", str(ROOT), "--check"]) == 0


def test_chart_crd_equals_plain_crd_once_helm_renders_it():
    text = (ROOT / generate.CHART_FILE).read_text()
    rendered = "\n".join(line for line in text.splitlines() if "{{" not in line
                         and "helm.sh/resource-policy" not in line)
    chart_crd = yaml.safe_load(rendered)
    chart_crd["metadata"].pop("annotations")
    assert chart_crd == yaml.safe_load((ROOT / generate.CRD_FILE).read_text()) == crd.crd()
# spec.autoscaling with every field: scale to zero (wakeQuery) needs the operator setting autoscaler keda.
AUTOSCALED_SPEC = {**FULL_SPEC, "autoscaling": {
    "minReplicas": 0, "maxReplicas": 4, "scaleUpPeriodSeconds": 60, "scaleDownWindowSeconds": 600,
    "wakeQuery": "sum(queued)",
    "targets": {"waitingRequestsPerReplica": 4, "kvCacheUsagePercent": 85, "queueTimeP90Milliseconds": 2000}}}
KEDA = Settings(autoscaler="keda", prometheus_address="http://prometheus.monitoring.svc:9090")


def test_parser_reads_exactly_the_fields_the_schema_declares(monkeypatch):
    from kvoffload.api import spec as spec_mod

    read: set[str] = set()
    get = spec_mod._Reader.get
    monkeypatch.setattr(spec_mod._Reader, "get", lambda self, path, *default: read.add(path)
                        or get(self, path, *default))
    mirror = Settings(allowed_images=("registry.example/mirror/*",))  # FULL_SPEC's image
    parse(FULL_SPEC, mirror)
    parse(EPHEMERAL_SPEC, mirror)
    parse(SERVER_SPEC, dataclasses.replace(mirror, shared_memory_root="/run/kvoffload-shm"))
    parse(AUTOSCALED_SPEC, dataclasses.replace(KEDA, allowed_images=mirror.allowed_images))
    assert read >= crd.leaf_paths(), sorted(crd.leaf_paths() - read)
    parent_paths = {p.rsplit(".", 1)[0] for p in crd.leaf_paths()} | {""}
    extra = {p for p in read - crd.leaf_paths() if p not in parent_paths}
    assert not extra, f"parser reads fields the CRD does not declare: {sorted(extra)}"


def test_full_spec_sets_every_leaf():
    def leaves(d, prefix=""):
        out = set()
        for k, v in d.items():
            p = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict) and v and p in {q.rsplit('.', 1)[0] for q in crd.leaf_paths()
                                                   if q.startswith(p + ".")}:
                out |= leaves(v, p)
            else:
                out.add(p)
        return out
    assert (leaves(FULL_SPEC) | leaves(EPHEMERAL_SPEC) | leaves(SERVER_SPEC) | leaves(AUTOSCALED_SPEC)
            == crd.leaf_paths())


def _walk(node, path="spec"):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{name}")
    if "items" in node:
        yield from _walk(node["items"], path + "[]")


def test_every_field_is_described():
    missing = [p for p, n in _walk(crd.spec_schema()) if not n.get("description") and not p.endswith("[]")]
    missing += [p for p, n in _walk(crd.status_schema(), "status") if not n.get("description") and not p.endswith("[]")]
    assert not missing


def test_no_threshold_knob_and_the_docs_say_why():
    paths = crd.leaf_paths()
    assert not any("threshold" in p.lower() for p in paths)
    assert "no CPU fill threshold" in crd.spec_schema()["properties"]["offload"]["properties"]["cpu"]["description"]


def test_scale_subresource_and_printer_columns():
    version = crd.crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert version["subresources"]["status"] == {}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[0] == "Ready" and "Memory" in names and names[-1] == "Age"


def test_planning_errors_name_real_crd_fields() -> None:
    """spec.PLAN_FIELDS turns the planner's input names into CRD paths: each must exist in the schema."""
    from kvoffload.api.spec import PLAN_FIELDS

    for key, path in PLAN_FIELDS.items():
        assert path.startswith("spec."), key
        assert crd.schema_at(path.removeprefix("spec.")), f"{key} -> {path} is not in the CRD"
