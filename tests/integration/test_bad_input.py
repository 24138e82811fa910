"""The bad-input catalogue, on the real control plane: every invalid KVOffloadServe is refused.

Each case says where it is refused:
- API: `kubectl apply` (strict field validation, the default) exits non-zero, its stderr names the
  field, and nothing is stored;
- OPERATOR: the API server stores it (only the operator knows the allowed disk roots, the model
  catalog, the image table and GPU sizing) and the operator sets ConfigValid=False with a message
  naming the field.
In both cases no child (ConfigMap, Service, StatefulSet, PodDisruptionBudget labelled
kvoffload.io/serve=<name>) is created, and a running serve's children are not changed.

Sizes that are valid but fit no node are not config errors: the operator renders them and the
scheduler refuses the pod (Scheduled=False, Unschedulable); those are listed separately.

One operator subprocess and one namespace serve the whole module.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from kvtest import ApiError, OperatorProcess, condition
from kvtest.specs import DELETE, live_children, patched, serve

pytestmark = pytest.mark.cluster

API, OPERATOR = "api", "operator"

VALID = serve("placeholder")


@dataclass(frozen=True)
class Case:
    id: str
    changes: dict[str, Any]
    where: str  # API or OPERATOR
    field: str  # the field path the error must name
    needle: str = ""  # more text the error must contain

    @property
    def name(self) -> str:
        return (self.changes.get("metadata.name")
                or re.sub(r"[^a-z0-9]+", "-", self.id.lower()).strip("-")[:52].rstrip("-"))

    def manifest(self) -> dict[str, Any]:
        obj = patched(VALID, self.changes)
        obj["metadata"]["name"] = self.name
        return obj


P = "spec.offload.disk.path"
# The offered pair that is not the default, named in full (a known image's versions cannot be contradicted).
PINNED_026 = {"spec.engine.image": "ghcr.io/kvoffload/vllm-lmcache:0.26.0-0.5.3", "spec.engine.vllmVersion": "0.26.0",
              "spec.engine.lmcacheVersion": "0.5.3"}
CASES = [
    # --- wrong types
    Case("type replicas string", {"spec.replicas": "two"}, API, "spec.replicas", "must be of type integer"),
    Case("type maxModelLen string", {"spec.engine.maxModelLen": "long"}, API, "spec.engine.maxModelLen"),
    Case("type gpuMemoryUtilization string", {"spec.engine.gpuMemoryUtilization": "high"}, API,
         "spec.engine.gpuMemoryUtilization"),
    Case("type metrics enabled string", {"spec.metrics": {"enabled": "yes"}}, API, "spec.metrics.enabled", "boolean"),
    Case("type cpu size integer", {"spec.offload.cpu.size": 40}, API, "spec.offload.cpu.size",
         "must be of type string"),
    Case("type extraArgs string", {"spec.engine.extraArgs": "--enforce-eager"}, API, "spec.engine.extraArgs", "array"),
    Case("type tolerations string", {"spec.scheduling": {"tolerations": "all"}}, API, "spec.scheduling.tolerations",
         "array"),
    Case("type env value integer", {"spec.engine.env": [{"name": "A", "value": 5}]}, API, "spec.engine.env[0].value",
         "string"),
    Case("type model string", {"spec.model": "Qwen/Qwen2.5-7B-Instruct"}, API, "spec.model", "must be of type object"),
    Case("type nodeSelector value integer", {"spec.scheduling": {"nodeSelector": {"pool": 1}}}, API,
         "spec.scheduling.nodeSelector.pool"),
    # --- out-of-range numbers
    Case("range replicas negative", {"spec.replicas": -1}, API, "spec.replicas", "greater than or equal to 0"),
    Case("range replicas 1001", {"spec.replicas": 1001}, API, "spec.replicas"),
    Case("range tp 0", {"spec.engine.tensorParallelSize": 0}, API, "spec.engine.tensorParallelSize"),
    Case("range tp 65", {"spec.engine.tensorParallelSize": 65}, API, "spec.engine.tensorParallelSize"),
    Case("range utilization 0", {"spec.engine.gpuMemoryUtilization": 0}, API, "spec.engine.gpuMemoryUtilization"),
    Case("range utilization 1.5", {"spec.engine.gpuMemoryUtilization": 1.5}, API, "spec.engine.gpuMemoryUtilization"),
    Case("range maxNumSeqs 0", {"spec.engine.maxNumSeqs": 0}, API, "spec.engine.maxNumSeqs"),
    Case("range maxModelLen 8", {"spec.engine.maxModelLen": 8}, API, "spec.engine.maxModelLen"),
    Case("range chunkSize 0", {"spec.offload.chunkSize": 0}, API, "spec.offload.chunkSize"),
    Case("range chunkSize 100000", {"spec.offload.chunkSize": 100000}, API, "spec.offload.chunkSize"),
    Case("range metrics port 80", {"spec.metrics": {"port": 80}}, API, "spec.metrics.port"),
    Case("range headroom 101", {"spec.resources.headroomPercent": 101}, API, "spec.resources.headroomPercent"),
    Case("range layers 0", {"spec.model.architecture": {"layers": 0}}, API, "spec.model.architecture.layers"),
    # --- missing parts
    Case("missing spec", {"spec": DELETE}, API, "spec", "Required value"),
    Case("missing model", {"spec.model": DELETE}, API, "spec.model", "Required value"),
    Case("missing model name", {"spec.model": {"servedName": "x"}}, API, "spec.model.name", "Required value"),
    Case("missing maxModelLen", {"spec.engine": {"maxNumSeqs": 4}}, API, "spec.engine.maxModelLen", "Required value"),
    Case("missing cpu tier", {"spec.offload.cpu": DELETE}, API, "spec.offload.cpu", "Required value"),
    Case("missing disk size", {"spec.offload.disk": {"path": "/mnt/nvme/lmcache"}}, API, "spec.offload.disk.size",
         "Required value"),
    Case("missing secret name", {"spec.model.hfTokenSecret": {"key": "token"}}, API, "spec.model.hfTokenSecret.name",
         "Required value"),
    # --- conflicting fields
    # spec.offload.server PerNode (docs/shared-cache.md): only backend lmcache-server runs a server to share; its L2
    # is on the node; the admin's tmpfs root is known to the operator only.
    Case("conflict server PerNode on lmcache", {"spec.offload.server": "PerNode"}, API, "spec.offload.server",
         "must be Sidecar with spec.offload.backend lmcache"),
    Case("conflict server PerNode with storageClass",
         {"spec.offload.backend": "lmcache-server", "spec.offload.server": "PerNode",
          "spec.offload.disk": {"storageClassName": "local-nvme", "size": "100Gi"}}, API, "spec.offload.server",
         "the allowed value is Sidecar"),
    Case("op server PerNode without the admin's root",
         {"spec.offload.backend": "lmcache-server", "spec.offload.server": "PerNode"}, OPERATOR,
         "spec.offload.server", "sharedMemoryRoot); allowed values here: Sidecar"),
    Case("conflict path and storageClass", {"spec.offload.disk.storageClassName": "local-nvme"}, API,
         "spec.offload.disk",
         "set exactly one of"),
    Case("conflict neither path nor storageClass", {"spec.offload.disk": {"size": "10Gi"}}, API, "spec.offload.disk",
         "set exactly one of"),
    Case("conflict node selectors", {"spec.offload.disk.nodeSelector": {"kvoffload.io/nvme": "true"},
                                     "spec.scheduling": {"nodeSelector": {"kvoffload.io/nvme": "false"}}},
         API, "spec.offload.disk.nodeSelector", "disagree"),
    Case("conflict memory below cpu tier", {"spec.resources.memory": "8Gi"}, API, "spec.resources.memory", "CPU tier"),
    Case("conflict kvHeads vs attentionHeads", {"spec.model.architecture": {"attentionHeads": 32, "kvHeads": 3}}, API,
         "spec.model.architecture.kvHeads", "divide"),
    # --- unknown fields (kubectl's default strict field validation)
    Case("unknown cpuThreshold", {"spec.offload.cpuThreshold": 0.8}, API, "spec.offload.cpuThreshold", "unknown field"),
    Case("unknown typo maxModelLength", {"spec.engine.maxModelLength": 4096}, API, "spec.engine.maxModelLength",
         "unknown field"),
    Case("unknown top-level gpus", {"spec.gpus": 2}, API, "spec.gpus", "unknown field"),
    # --- hostPath escapes (shape, checked by the schema and CEL)
    Case("path dotdot escape", {P: "/mnt/nvme/../../etc"}, API, P, "normalized"),
    Case("path trailing dotdot", {P: "/mnt/nvme/x/.."}, API, P, "normalized"),
    Case("path dot segment", {P: "/mnt/nvme/./x"}, API, P, "normalized"),
    Case("path leading double slash", {P: "//mnt/nvme/x"}, API, P, "normalized"),
    Case("path inner double slash", {P: "/mnt/nvme//x"}, API, P, "normalized"),
    Case("path relative", {P: "mnt/nvme/x"}, API, P),
    Case("path relative dotdot", {P: "../etc"}, API, P),
    Case("path empty", {P: ""}, API, P),
    Case("path with space", {P: "/mnt/nvme/my cache"}, API, P),
    # --- bad quantities
    Case("quantity with space", {"spec.offload.cpu.size": "10 Gi"}, API, "spec.offload.cpu.size", "quantity"),
    Case("quantity negative", {"spec.offload.cpu.size": "-1"}, API, "spec.offload.cpu.size", "quantity"),
    Case("quantity 1e400", {"spec.offload.cpu.size": "1e400"}, API, "spec.offload.cpu.size", "at most 1Pi"),
    Case("quantity 100Ei disk", {"spec.offload.disk.size": "100Ei"}, API, "spec.offload.disk.size", "at most 1Pi"),
    Case("quantity empty", {"spec.offload.cpu.size": ""}, API, "spec.offload.cpu.size", "quantity"),
    Case("quantity zero", {"spec.offload.cpu.size": "0"}, API, "spec.offload.cpu.size", "> 0"),
    Case("quantity infinity", {"spec.resources.gpuMemory": "Infinity"}, API, "spec.resources.gpuMemory", "quantity"),
    Case("quantity double dot", {"spec.offload.disk.size": "1.5.5Gi"}, API, "spec.offload.disk.size", "quantity"),
    Case("quantity shm negative", {"spec.resources.shm": "-4Gi"}, API, "spec.resources.shm", "quantity"),
    # --- enums
    Case("enum eviction lowercase", {"spec.offload.cpu.evictionPolicy": "lru"}, API, "spec.offload.cpu.evictionPolicy",
         "Unsupported value"),
    Case("enum eviction RANDOM", {"spec.offload.cpu.evictionPolicy": "RANDOM"}, API, "spec.offload.cpu.evictionPolicy"),
    Case("enum reclaim Recycle", {"spec.offload.disk.reclaimPolicy": "Recycle"}, API,
         "spec.offload.disk.reclaimPolicy"),
    Case("enum dtype fp4", {"spec.engine.dtype": "fp4"}, API, "spec.engine.dtype"),
    Case("enum kvDtype int4", {"spec.model.kvDtype": "int4"}, API, "spec.model.kvDtype"),
    # --- managed flags and env
    Case("flag max-model-len", {"spec.engine.extraArgs": ["--max-model-len=1"]}, API, "spec.engine.extraArgs",
         "manages"),
    Case("flag underscore spelling", {"spec.engine.extraArgs": ["--max_model_len", "1"]}, API, "spec.engine.extraArgs",
         "manages"),
    Case("flag dotted json key", {"spec.engine.extraArgs": ["--kv-transfer-config.kv_connector=Other"]}, API,
         "spec.engine.extraArgs", "manages"),
    Case("flag tp short", {"spec.engine.extraArgs": ["-tp", "2"]}, API, "spec.engine.extraArgs", "manages"),
    # vLLM's parser takes any unambiguous prefix (allow_abbrev): these set managed flags too
    Case("flag abbrev kv-transfer", {"spec.engine.extraArgs": ["--kv-transfer", '{"kv_connector":"Other"}']}, API,
         "spec.engine.extraArgs", "abbreviate"),
    Case("flag abbrev kv-offloading-s", {"spec.engine.extraArgs": ["--kv-offloading-s", "10"]}, API,
         "spec.engine.extraArgs", "abbreviate"),
    Case("flag abbrev t for tp", {"spec.engine.extraArgs": ["-t", "2"]}, API, "spec.engine.extraArgs", "abbreviate"),
    Case("flag abbrev tensor-parallel", {"spec.engine.extraArgs": ["--tensor-parallel=2"]}, API,
         "spec.engine.extraArgs", "abbreviate"),
    Case("flag abbrev max-model", {"spec.engine.extraArgs": ["--max-model", "1"]}, API, "spec.engine.extraArgs",
         "abbreviate"),
    Case("flag abbrev gpu-memory", {"spec.engine.extraArgs": ["--gpu_memory", "0.5"]}, API, "spec.engine.extraArgs",
         "abbreviate"),
    Case("flag abbrev served-model", {"spec.engine.extraArgs": ["--served-model", "x"]}, API, "spec.engine.extraArgs",
         "abbreviate"),
    # GPU count and memory budget
    Case("flag pipeline parallel", {"spec.engine.extraArgs": ["-pp", "2"]}, API, "spec.engine.extraArgs", "GPU count"),
    Case("flag data parallel", {"spec.engine.extraArgs": ["-dp=2"]}, API, "spec.engine.extraArgs", "GPU count"),
    Case("flag cpu offload gb", {"spec.engine.extraArgs": ["--cpu-offload-gb", "8"]}, API, "spec.engine.extraArgs",
         "memory budget"),
    Case("flag kv cache memory bytes", {"spec.engine.extraArgs": ["--kv-cache-memory-bytes=8G"]}, API,
         "spec.engine.extraArgs",
         "memory budget"),
    Case("flag hybrid kv cache manager on", {"spec.engine.extraArgs": ["--no-disable-hybrid-kv-cache-manager"]}, API,
         "spec.engine.extraArgs", "--no-disable-hybrid-kv-cache-manager"),
    Case("env LMCACHE prefix", {"spec.engine.env": [{"name": "LMCACHE_LOCAL_DISK", "value": "True"}]}, API,
         "spec.engine.env", "LMCACHE_*"),
    Case("env PYTHONHASHSEED", {"spec.engine.env": [{"name": "PYTHONHASHSEED", "value": "1"}]}, API, "spec.engine.env"),
    Case("env model runner", {"spec.engine.env": [{"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "1"}]}, API,
         "spec.engine.env",
         "V2 runner skips LMCache's KV loads"),
    Case("env DO_NOT_TRACK turns telemetry on", {"spec.engine.env": [{"name": "DO_NOT_TRACK", "value": "0"}]}, API,
         "spec.engine.env", "usage telemetry off"),
    Case("env VLLM_NO_USAGE_STATS turns telemetry on",
         {"spec.engine.env": [{"name": "VLLM_NO_USAGE_STATS", "value": "0"}]}, API,
         "spec.engine.env", "VLLM_NO_USAGE_STATS"),
    Case("env POD_NAMESPACE redirects disk", {"spec.engine.env": [{"name": "POD_NAMESPACE", "value": "victim"}]}, API,
         "spec.engine.env", "POD_NAMESPACE"),
    # what the operator decides in the pod (kvoffload/api/managed.py): refused by name, with the reason
    Case("env CUDA_VISIBLE_DEVICES", {"spec.engine.env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0,1,2,3"}]}, API,
         "spec.engine.env", "CUDA_VISIBLE_DEVICES is managed by the operator: the operator decides which GPUs"),
    Case("env NVIDIA_VISIBLE_DEVICES all", {"spec.engine.env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
         API,
         "spec.engine.env", "NVIDIA_VISIBLE_DEVICES is managed by the operator"),
    Case("env HF_HOME elsewhere", {"spec.engine.env": [{"name": "HF_HOME", "value": "/root/.cache"}]}, API,
         "spec.engine.env", "HF_HOME is managed by the operator: the operator decides where the engine's weights"),
    Case("env TMPDIR elsewhere", {"spec.engine.env": [{"name": "A", "value": "1"},
                                                      {"name": "TMPDIR", "value": "/dev/shm"}]},
         API, "spec.engine.env", "TMPDIR is managed by the operator"),
    Case("env HOME and LMCACHE",
         {"spec.engine.env": [{"name": "HOME", "value": "/"}, {"name": "LMCACHE_X", "value": "1"}]},
         API, "spec.engine.env", "HOME is managed by the operator: the operator decides where the engine's weights, "
                                 "caches and temporary files go"),
    Case("flag download-dir moves the weights", {"spec.engine.extraArgs": ["--download-dir=/tmp/w"]}, API,
         "spec.engine.extraArgs",
         "--download-dir"),
    Case("metrics port is vLLM's", {"spec.metrics": {"port": 8000}}, API, "spec.metrics.port",
         "8000 is the vllm container's port"),
    Case("metrics port is the LMCache server's", {"spec.metrics": {"port": 5555}}, API, "spec.metrics.port",
         "5555 is the lmcache-server container's ZMQ port"),
    Case("metrics port is the server's HTTP", {"spec.metrics": {"port": 8081}}, API, "spec.metrics.port", "8081"),
    Case("flag api-key literal", {"spec.engine.extraArgs": ["--api-key=secret"]}, API, "spec.engine.extraArgs",
         "--api-key"),
    Case("env VLLM_API_KEY literal", {"spec.engine.env": [{"name": "VLLM_API_KEY", "value": "secret"}]}, API,
         "spec.engine.env",
         "VLLM_API_KEY"),
    # --- a hostile tenant (issue 32): tokens, host devices, unguarded endpoints, flags that leave the pod's contract
    Case("duplicate env name", {"spec.engine.env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, API,
         "spec.engine.env[1]", "Duplicate value"),
    Case("env HF_TOKEN literal", {"spec.engine.env": [{"name": "HF_TOKEN", "value": "hf_x"}]}, API, "spec.engine.env",
         "HF_TOKEN is managed by the operator: Hugging Face tokens come from spec.model.hfTokenSecret only"),
    Case("env HF_TOKEN from another secret", {"spec.engine.env": [{"name": "HUGGING_FACE_HUB_TOKEN", "valueFrom": {
         "secretKeyRef": {"name": "other", "key": "t"}}}]}, API, "spec.engine.env", "spec.model.hfTokenSecret only"),
    Case("env VLLM_SERVER_DEV_MODE", {"spec.engine.env": [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}]}, API,
         "spec.engine.env", "which the API key does not guard"),
    Case("flag hf-token literal", {"spec.engine.extraArgs": ["--hf-token", "hf_x"]}, API, "spec.engine.extraArgs",
         "--hf-token"),
    Case("flag allowed-local-media-path", {"spec.engine.extraArgs": ["--allowed-local-media-path=/"]}, API,
         "spec.engine.extraArgs", "--allowed-local-media-path"),
    Case("flag kv-events-config", {"spec.engine.extraArgs": ["--kv-events-config", "{}"]}, API, "spec.engine.extraArgs",
         "--kv-events-config"),
    Case("flag uds", {"spec.engine.extraArgs": ["--uds", "/tmp/s"]}, API, "spec.engine.extraArgs", "--uds"),
    Case("flag grpc", {"spec.engine.extraArgs": ["--grpc"]}, API, "spec.engine.extraArgs", "--grpc"),
    Case("flag ssl-keyfile", {"spec.engine.extraArgs": ["--ssl-keyfile", "/tmp/k"]}, API, "spec.engine.extraArgs",
         "--ssl-keyfile"),
    Case("flag api-server-count", {"spec.engine.extraArgs": ["--api-server-count", "4"]}, API, "spec.engine.extraArgs",
         "--api-server-count"),
    Case("flag nnodes", {"spec.engine.extraArgs": ["--nnodes", "2"]}, API, "spec.engine.extraArgs", "--nnodes"),
    Case("flag speculative-config", {"spec.engine.extraArgs": ["--speculative-config", "{}"]}, API,
         "spec.engine.extraArgs",
         "--speculative-config"),
    Case("flag hf-overrides", {"spec.engine.extraArgs": ["--hf-overrides", "{}"]}, API, "spec.engine.extraArgs",
         "--hf-overrides"),
    Case("apiKeySecretRef without name", {"spec.engine.apiKeySecretRef": {"key": "k"}}, API,
         "spec.engine.apiKeySecretRef.name",
         "Required value"),
    Case("networkPolicy namespace invalid", {"spec.networkPolicy": {"servingFrom": ["Team_A"]}}, API,
         "spec.networkPolicy.servingFrom[0]"),
    Case("networkPolicy namespace twice", {"spec.networkPolicy": {"metricsFrom": ["mon", "mon"]}}, API,
         "spec.networkPolicy.metricsFrom[1]", "Duplicate value"),
    Case("spread more than 8 constraints", {"spec.scheduling": {"topologySpreadConstraints": [{}] * 9}}, API,
         "spec.scheduling.topologySpreadConstraints", "must have at most 8 items"),
    # --- names
    Case("name 53 chars", {"metadata.name": "n" * 53}, API, "metadata.name", "at most 52 characters"),
    Case("name with dot", {"metadata.name": "my.serve"}, API, "metadata.name", "DNS-1035"),
    Case("name starts with digit", {"metadata.name": "7b-serve"}, API, "metadata.name", "DNS-1035"),
    Case("name upper case", {"metadata.name": "Serve"}, API, "metadata.name"),
    # --- other shapes the pod would refuse later
    Case("gpuResourceName memory", {"spec.resources.gpuResourceName": "memory"}, API, "spec.resources.gpuResourceName"),
    Case("priorityClassName invalid", {"spec.scheduling": {"priorityClassName": "Bad_Class"}}, API,
         "spec.scheduling.priorityClassName"),
    Case("claimName invalid", {"spec.model.cache": {"claimName": "models/weights"}}, API, "spec.model.cache.claimName"),
    Case("vllmVersion latest", {"spec.engine.vllmVersion": "latest"}, API, "spec.engine.vllmVersion"),
    Case("model name with space", {"spec.model.name": "my model"}, API, "spec.model.name"),
    Case("nodeSelector key invalid", {"spec.scheduling": {"nodeSelector": {"bad key!": "x"}}}, API,
         "spec.scheduling.nodeSelector",
         "label keys"),

    # ---- accepted by the API server, refused by the operator (what only it knows)
    Case("op path outside allowed roots", {P: "/etc/lmcache"}, OPERATOR, P, "outside the allowed roots"),
    Case("op path is the allowed root", {P: "/mnt/nvme"}, OPERATOR, P, "allowed root itself"),
    Case("op path is the root with slash", {P: "/mnt/nvme/"}, OPERATOR, P, "allowed root itself"),
    Case("op path is the second root", {P: "/var/lib/kvoffload"}, OPERATOR, P, "allowed root itself"),
    Case("op path root lookalike", {P: "/mnt/nvme2/kv"}, OPERATOR, P, "outside the allowed roots"),
    Case("op path under root parent", {P: "/mnt/kv"}, OPERATOR, P, "outside the allowed roots"),
    Case("op weights larger than gpu", {"spec.model.name": "meta-llama/Llama-3.1-70B-Instruct",
                                        "spec.resources.gpuMemory": "80Gi"},
         OPERATOR, "spec.resources.gpuMemory", "weights"),
    Case("op low utilization leaves no room", {"spec.engine.gpuMemoryUtilization": 0.05}, OPERATOR,
         "spec.resources.gpuMemory",
         "leaves no room for KV"),
    Case("op maxModelLen too long for gpu", {"spec.model.name": "meta-llama/Llama-2-7b-hf",
                                             "spec.engine.maxModelLen": 1048576},
         OPERATOR, "spec.engine.maxModelLen", "lower"),
    Case("op tp 3 for qwen", {"spec.engine.tensorParallelSize": 3}, OPERATOR, "spec.engine.tensorParallelSize",
         "does not divide"),
    Case("op tp 64 for llama 8b", {"spec.model.name": "meta-llama/Llama-3.1-8B-Instruct",
                                   "spec.engine.tensorParallelSize": 64},
         OPERATOR, "spec.engine.tensorParallelSize"),
    Case("op unknown model", {"spec.model.name": "acme/secret-model-7b"}, OPERATOR, "spec.model.name",
         "not in the built-in catalog"),
    Case("op unknown model partial arch", {"spec.model.name": "acme/secret-model-7b",
                                           "spec.model.architecture": {"layers": 32}},
         OPERATOR, "spec.model.architecture.kvHeads"),
    Case("op image not allowed", {"spec.engine.image": "evil.example/vllm:custom", "spec.engine.vllmVersion": "0.26.0",
                                  "spec.engine.lmcacheVersion": "0.5.3"}, OPERATOR, "spec.engine.image",
         "is not an image the cluster admin allows"),
    Case("op image beside an allowed path", {"spec.engine.image": "registry.examplex/vllm:1",
                                             "spec.engine.vllmVersion": "0.26.0",
                                             "spec.engine.lmcacheVersion": "0.5.3"}, OPERATOR, "spec.engine.image",
         "allowlist (registry.example/*)"),
    Case("op env NVIDIA_MOFED", {"spec.engine.env": [{"name": "NVIDIA_MOFED", "value": "enabled"}]}, OPERATOR,
         "spec.engine.env", "NVIDIA_MOFED is managed by the operator: the NVIDIA container runtime reads NVIDIA_*"),
    Case("op env NVIDIA_IMEX_CHANNELS", {"spec.engine.env": [{"name": "NVIDIA_IMEX_CHANNELS", "value": "all"}]},
         OPERATOR,
         "spec.engine.env", "allowedNvidiaEnv"),
    Case("op unknown image", {"spec.engine.image": "registry.example/vllm:custom"}, OPERATOR, "spec.engine.vllmVersion",
         "version table"),
    Case("op vllm too old", {"spec.engine.image": "registry.example/vllm:old", "spec.engine.vllmVersion": "0.5.0",
                             "spec.engine.lmcacheVersion": "0.5.6"}, OPERATOR, "spec.engine.vllmVersion", "predates"),
    Case("op lmcache too old", {"spec.engine.image": "registry.example/vllm:old", "spec.engine.vllmVersion": "0.27.1",
                                "spec.engine.lmcacheVersion": "0.1.0"}, OPERATOR, "spec.engine.lmcacheVersion",
         "too old"),
    Case("op lmcache image has no vllm pin", {"spec.engine.image": "lmcache/vllm-openai:v0.5.4"}, OPERATOR,
         "spec.engine.vllmVersion", "unpinned"),
    Case("op extraArgs for a vllm without a flag table", {"spec.engine.image": "lmcache/vllm-openai:v0.5.4",
                                                          "spec.engine.vllmVersion": "0.29.0",
                                                          "spec.engine.extraArgs": ["--enforce-eager"]},
         OPERATOR, "spec.engine.extraArgs", "vLLM 0.29.0 has no flag table"),
    Case("op env expandable segments", {"spec.engine.env": [{"name": "PYTORCH_CUDA_ALLOC_CONF",
                                                             "value": "expandable_segments:True"}]},
         OPERATOR, "spec.engine.env", "vLLM 0.33.0 refuses expandable_segments:True"),
    # ---- checked against the image's vLLM's own flag table: vLLM 0.26.0's (the offered pair it pins), the default's
    Case("op flag removed disable-log-requests", {**PINNED_026, "spec.engine.extraArgs": ["--disable-log-requests"]},
         OPERATOR, "spec.engine.extraArgs", "'--disable-log-requests' (vLLM 0.26.0) is not a flag of vLLM 0.26.0"),
    Case("op flag removed swap-space", {"spec.engine.extraArgs": ["--swap-space", "4"]}, OPERATOR,
         "spec.engine.extraArgs",
         "'--swap-space' (vLLM 0.33.0) is not a flag"),
    Case("op flag value on a switch", {"spec.engine.extraArgs": ["--enable-prefix-caching=False"]}, OPERATOR,
         "spec.engine.extraArgs", "--enable-prefix-caching takes no value"),
    Case("op flag ambiguous abbreviation", {"spec.engine.extraArgs": ["--enable-pr"]}, OPERATOR,
         "spec.engine.extraArgs",
         "ambiguous abbreviation"),
    Case("op flag unambiguous abbreviation", {"spec.engine.extraArgs": ["--enforce"]}, OPERATOR,
         "spec.engine.extraArgs",
         "abbreviates --enforce-eager"),
    Case("op flag integer value", {"spec.engine.extraArgs": ["--dbo-decode-token-threshold", "big"]}, OPERATOR,
         "spec.engine.extraArgs", "--dbo-decode-token-threshold takes an integer"),
    # --block-size is refused outright now (the router's KV index and vllm-native count in 16-token blocks).
    Case("flag block size", {"spec.engine.extraArgs": ["--block-size", "32"]}, API, "spec.engine.extraArgs",
         "--block-size"),
    Case("op flag stray positional", {"spec.engine.extraArgs": ["--enforce-eager", "yes"]}, OPERATOR,
         "spec.engine.extraArgs",
         "is not a flag"),
]
API_CASES = [c for c in CASES if c.where == API]
OPERATOR_CASES = [c for c in CASES if c.where == OPERATOR]

# Valid configs that no node can hold: rendered, then refused by kube-scheduler.
UNSCHEDULABLE = [
    Case("sched cpu tier beyond every node", {"spec.offload.cpu.size": "3Ti"}, "scheduler", "Insufficient memory"),
    Case("sched more gpus than any node", {"spec.model.name": "meta-llama/Llama-3.1-405B-Instruct",
                                           "spec.engine.maxModelLen": 8192,
                                           "spec.engine.tensorParallelSize": 16}, "scheduler",
         "Insufficient nvidia.com/gpu"),
]


def test_catalogue_is_big_and_names_are_unique():
    assert len(CASES) >= 40 and len(OPERATOR_CASES) >= 10
    names = [c.name for c in CASES + UNSCHEDULABLE]
    assert len(set(names)) == len(names)


@pytest.fixture(scope="module")
def ns(cluster, crd_installed):
    name = cluster.client.namespace(f"t-bad-input-{uuid.uuid4().hex[:6]}", labels={"kvoffload.io/test": "true"},
                                    timeout=30)
    yield name
    with contextlib.suppress(ApiError):  # not awaited; best effort
        cluster.client.delete("namespace", name, missing_ok=True)


@pytest.fixture(scope="module")
def operator(cluster, ns):
    # The admin allows the mirror the image cases name (operator config allowedImages; evil.example stays refused).
    proc = OperatorProcess(cluster.env, [ns], {"resyncSeconds": 20, "allowedImages": ["registry.example/*"]})
    yield proc
    proc.stop()
    print(proc.output()[-5000:])


def kubectl_apply(cluster, ns: str, obj: dict[str, Any]):
    # JSON, not YAML: PyYAML writes the string "1e18" unquoted and kubectl would read a number.
    # kubectl under test: the error text `kubectl apply` prints for a refused KVOffloadServe
    return cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj), check=False)


def apply_error(cluster, ns: str, obj: dict[str, Any]) -> ApiError | None:
    """Server-side apply (unknown fields refused, as by kubectl's default strict validation); the API server's
    refusal, or None when it stored the object."""
    try:
        cluster.client.apply(obj, ns)
    except ApiError as exc:
        return exc
    return None


def serves(cluster, ns: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in cluster.client.list("kvs", ns)}


def children(cluster, ns: str) -> dict[str, list[dict[str, Any]]]:
    """The operator's children in the namespace, by owning resource."""
    out: dict[str, list[dict[str, Any]]] = {}
    for item in live_children(cluster.client, ns):
        out.setdefault(item["metadata"]["labels"]["kvoffload.io/serve"], []).append(item)
    return out


def verdict_at_generation(obj: dict[str, Any], type_: str = "ConfigValid") -> dict[str, Any] | None:
    """The condition once the operator decided it for this generation. Its first status (Unknown, "working
    on it") carries the generation too, and is not a verdict."""
    c = condition(obj, type_)
    decided = c and c.get("status") in ("True", "False")
    return c if decided and c.get("observedGeneration") == obj["metadata"]["generation"] else None


# ----------------------------------------------------------------------------- refused by the API server


@pytest.fixture(scope="module")
def api_results(cluster, ns):
    """Apply every API case once; nothing may be stored."""
    results = {c.id: kubectl_apply(cluster, ns, c.manifest()) for c in API_CASES}
    return results, set(serves(cluster, ns)), children(cluster, ns)


@pytest.mark.parametrize("case", API_CASES, ids=[c.id for c in API_CASES])
def test_api_server_refuses(cluster, ns, api_results, case):
    results, stored, kids = api_results
    res = results[case.id]
    assert res.returncode != 0, f"accepted: {res.stdout}"
    assert case.field in res.stderr, res.stderr
    assert case.needle in res.stderr, res.stderr
    assert case.name not in stored and case.name not in kids


# Cases refused by a rule of kvoffload.api.rules: the parser refuses the same spec with the same message.
RULE_CASES = [c for c in API_CASES if c.id.startswith(("env ", "metrics port", "conflict "))]


@pytest.mark.parametrize("case", RULE_CASES, ids=[c.id for c in RULE_CASES])
def test_api_server_and_parser_say_the_same(api_results, case):
    from kvoffload.api.errors import ConfigError
    from kvoffload.api.settings import Settings
    from kvoffload.api.spec import parse

    results, _, _ = api_results
    with pytest.raises(ConfigError) as err:
        parse(case.manifest()["spec"], Settings())
    assert err.value.field == case.field and case.needle in err.value.message
    assert err.value.message in results[case.id].stderr, (err.value.message, results[case.id].stderr)


# ----------------------------------------------------------------------------- refused by the operator


@pytest.fixture(scope="module")
def operator_verdicts(cluster, ns, operator):
    for c in OPERATOR_CASES:
        err = apply_error(cluster, ns, c.manifest())
        assert err is None, f"{c.id}: the API server should store it: {err}"
    names = {c.name for c in OPERATOR_CASES}

    def all_judged():
        found = serves(cluster, ns)
        judged = {n: found[n] for n in names if n in found and verdict_at_generation(found[n])}
        return judged if len(judged) == len(names) else None

    judged = cluster.wait_until(all_judged, timeout=120, interval=0.5, message="ConfigValid on every operator case")
    return judged, children(cluster, ns)


@pytest.mark.parametrize("case", OPERATOR_CASES, ids=[c.id for c in OPERATOR_CASES])
def test_operator_refuses(operator_verdicts, case):
    judged, kids = operator_verdicts
    obj = judged[case.name]
    valid = condition(obj, "ConfigValid")
    assert (valid["status"], valid["reason"]) == ("False", "InvalidSpec"), valid
    assert valid["message"].startswith(case.field + ":"), valid["message"]
    assert case.needle in valid["message"], valid["message"]
    assert condition(obj, "Ready")["status"] == "False"
    assert condition(obj, "Scheduled")["status"] == "Unknown"
    assert case.name not in kids, [k["kind"] for k in kids[case.name]]


def test_operator_changes_nothing_when_a_running_serve_turns_bad(cluster, ns, operator):
    """A valid serve runs; invalid updates (refused by the API server or by the operator) leave its children alone."""
    name = "running"
    good = patched(VALID, {"metadata.name": name})
    assert apply_error(cluster, ns, good) is None

    def ready():
        obj = serves(cluster, ns).get(name)
        ok = (obj and condition(obj, "Ready").get("status") == "True"
              and obj["status"].get("observedGeneration") == obj["metadata"]["generation"])
        return obj if ok else None

    cluster.wait_until(ready, timeout=120, message=f"{name} Ready")

    def fingerprint():
        # Controllers write the status of StatefulSets and PDBs; nobody but the operator writes ConfigMaps and Services.
        return {(k["kind"], k["metadata"]["name"]): json.dumps(
                    [k.get("spec"), k.get("data"), k["metadata"].get("labels"), k["metadata"].get("annotations"),
                     k["metadata"].get("generation"), k["metadata"]["resourceVersion"]
                     if k["kind"] in ("ConfigMap", "Service") else ""],
                    sort_keys=True)
                for k in children(cluster, ns).get(name, [])}

    applied = re.compile(rf"apply \w+ {re.escape(ns)}/{name}(-lmcache|-pods)?$", re.M)
    before = fingerprint()
    assert len(before) == 5
    applies_before = len(applied.findall(operator.output()))
    assert applies_before >= 5, "the operator log should show the first applies"
    generation = serves(cluster, ns)[name]["metadata"]["generation"]
    for case in API_CASES[:5] + [c for c in API_CASES if c.field == P][:3]:
        bad = case.manifest()
        bad["metadata"]["name"] = name
        if case.id == "missing spec":
            continue
        assert apply_error(cluster, ns, bad) is not None, case.id
    assert serves(cluster, ns)[name]["metadata"]["generation"] == generation
    for case in OPERATOR_CASES[:4] + OPERATOR_CASES[6:10]:
        bad = case.manifest()
        bad["metadata"]["name"] = name
        err = apply_error(cluster, ns, bad)
        assert err is None, (case.id, err)

        def judged(field=case.field):
            obj = serves(cluster, ns)[name]
            c = verdict_at_generation(obj)
            return c if c and c["status"] == "False" and c["message"].startswith(field + ":") else None

        cluster.wait_until(judged, timeout=60, message=f"{name} ConfigValid=False for {case.id}")
    assert fingerprint() == before
    assert len(applied.findall(operator.output())) == applies_before, (
        "the operator applied a child while the spec was invalid")
    # Back to the valid spec: the same children, still untouched (nothing differs, so nothing is applied).
    assert apply_error(cluster, ns, good) is None
    cluster.wait_until(lambda: (verdict_at_generation(serves(cluster, ns)[name]) or {}).get("status") == "True",
                       timeout=60, message=f"{name} ConfigValid=True again")
    assert fingerprint() == before


# ----------------------------------------------------------------------------- valid, but fits no node


@pytest.mark.parametrize("case", UNSCHEDULABLE, ids=[c.id for c in UNSCHEDULABLE])
def test_scheduler_refuses_what_no_node_can_hold(cluster, ns, operator, case):
    err = apply_error(cluster, ns, case.manifest())
    assert err is None, err

    def unschedulable():
        obj = serves(cluster, ns).get(case.name)
        c = condition(obj, "Scheduled")
        return obj if c.get("status") == "False" and c.get("reason") == "Unschedulable" else None

    obj = cluster.wait_until(unschedulable, timeout=90, message=f"{case.name} Scheduled=False")
    assert case.needle in condition(obj, "Scheduled")["message"]
    assert condition(obj, "ConfigValid")["status"] == "True"
    assert condition(obj, "Ready")["status"] == "False"
    assert {k["kind"] for k in children(cluster, ns)[case.name]} == {"ConfigMap", "Service", "StatefulSet",
                                                                     "PodDisruptionBudget"}


# ----------------------------------------------------------------------------- the node cleaner's live set from the API


def test_disk_cleaner_lists_live_serves_from_the_api(cluster, ns, operator_verdicts, tmp_path):
    """`kvoffload clean-disk --kubeconfig`: stored serves (valid or not) are live, by uid; only the directories of a
    deleted incarnation (its owner marker's uid, not live) go, and only with the final policy Delete."""
    from kvoffload.cli.clean_disk import live_from_api
    from kvoffload.node import disk_prepare, owner_marker
    from kvoffload.node.disk_cleaner import clean

    live = live_from_api(str(cluster.kubeconfig), in_cluster=False)
    stored = OPERATOR_CASES[0].name
    uid = cluster.client.get("kvs", stored, ns)["metadata"]["uid"]
    assert live[(ns, stored)] == uid
    root = tmp_path / "kv"
    gone = str(uuid.uuid4())  # an earlier incarnation of the stored name, and a resource deleted long ago
    for name, owner_uid in ((stored, uid), ("deleted-long-ago", gone), (stored, gone)):
        parent = root / "lmcache" / ns / name
        parent.mkdir(parents=True, exist_ok=True)
        pod = f"{name}-{0 if owner_uid == uid or name != stored else 1}"
        disk_prepare.prepare_pod_dir(str(parent), owner_marker.Owner(ns, name, pod, owner_uid), 1000, 1000)
        (parent / pod / "chunk.pt").write_bytes(b"x" * 64)
    report = clean(str(root), live, deleted={gone: "Delete"}, min_age=0)
    assert sorted(r["path"] for r in report.removed) == [f"lmcache/{ns}/deleted-long-ago/deleted-long-ago-0",
                                                         f"lmcache/{ns}/{stored}/{stored}-1"]
    assert report.bytes_freed == 128
    assert (root / "lmcache" / ns / stored / f"{stored}-0" / "chunk.pt").exists()
