"""The KVOffloadServe CRD: the one source of truth for the API.

`crds/` and the chart's CRD template are generated from `crd()` (`make generate`), the
parser reads defaults from `schema()`, and tests prove all three agree. Every field has a
description, so `kubectl explain kvs.spec...` teaches the API; bounds, enums and CEL rules
let the API server refuse bad input before the operator sees it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from ..engine import flags, images
from ..engine import router as engine_router
from . import conditions, managed, rules

GROUP = "kvoffload.io"
VERSION = "v1alpha1"
KIND = "KVOffloadServe"
PLURAL = "kvoffloadserves"
SINGULAR = "kvoffloadserve"
SHORT_NAMES = ["kvs"]

# Every spelling of a vLLM flag that extraArgs may not use in any supported vLLM (from the flag tables:
# flags the operator renders, and flags that change the GPU count or the memory budget). The API server
# refuses these and their abbreviations; the operator also refuses unknown flags per vLLM version.
REFUSED_FLAGS = flags.refused_spellings()
# Environment variables spec.engine.env may not set, each with why (api/managed.py; api/rules.ENV refuses them).
MANAGED_ENV = tuple(managed.ENV)
MANAGED_ENV_PREFIX = managed.ENV_PREFIX


@functools.cache
def backend_declarations() -> dict[str, Any]:
    """What each spec.offload.backend declares to the API (its name, summary, engine pair and the fields it
    refuses): data/backends.json, written by `make generate` from the backends' registry (backends/,
    a layer above this one)."""
    return json.loads((Path(__file__).parent / "data" / "backends.json").read_text(encoding="utf-8"))
# vLLM's FlexibleArgumentParser reads `--max_model_len` as `--max-model-len` and `--kv-transfer-config.x=y` as a
# sub-key of `--kv-transfer-config`, and (allow_abbrev) any unambiguous prefix as the whole flag: `--max-model`
# and `-t` set --max-model-len and -tp. So an argument is refused when, read as vLLM reads it, it is a prefix
# of a refused spelling (a test proves no allowed flag is such a prefix).
CEL_FLAG = "a.split('=')[0].split('.')[0].replace('_', '-')"
CEL_REFUSED_ARG = f"a.startsWith('-') && REFUSED.exists(m, m.startsWith({CEL_FLAG}))"
# Largest quantity accepted anywhere (1 PiB): far beyond any node, and sums of terms stay well inside int64.
MAX_QUANTITY = "1Pi"
MAX_QUANTITY_LENGTH = 32  # characters of a quantity string (the API server's limit is longer; bounded for CEL's cost)
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Child and pod names derive from metadata.name, and Service names must be DNS-1035 labels.
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_NAME = 52
MAX_VERSION_PODS = 10  # pod names listed per running version set in status.versions.running
# A fully-qualified extended resource (nvidia.com/gpu): never cpu, memory or another built-in resource.
EXTENDED_RESOURCE = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?[.])*[a-z0-9]([-a-z0-9]*[a-z0-9])?"
                     r"/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
LABEL_KEY_MAX = 317  # characters: a 253-character DNS prefix, '/', a 63-character name
LABEL_KEY = (r"^(([a-z0-9]([-a-z0-9]*[a-z0-9])?[.])*[a-z0-9]([-a-z0-9]*[a-z0-9])?/)?"
             r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

Schema = dict[str, Any]
_AT_MOST = f" && !quantity(self).isGreaterThan(quantity('{MAX_QUANTITY}'))"
QUANTITY_RULE = "isQuantity(self) && !quantity(self).isLessThan(quantity('0'))" + _AT_MOST
POSITIVE_QUANTITY_RULE = "isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))" + _AT_MOST


def _s(description: str, **kw: Any) -> Schema:
    return {"type": "string", "description": description, **kw}


def _i(description: str, **kw: Any) -> Schema:
    return {"type": "integer", "description": description, **kw}


def _q(description: str, *, positive: bool = True, **kw: Any) -> Schema:
    """A Kubernetes quantity as a string (`40Gi`, `500G`), checked by the API server's CEL quantity library."""
    rule = POSITIVE_QUANTITY_RULE if positive else QUANTITY_RULE
    allowed = "> 0" if positive else ">= 0"
    return _s(description, maxLength=MAX_QUANTITY_LENGTH, **kw,
              **{"x-kubernetes-validations": [{"rule": rule, "message": f"must be a Kubernetes quantity {allowed} "
                                                                           f"and at most {MAX_QUANTITY}, "
                                                                           "e.g. 40Gi or 500G"}]})


def _gbps(tier: str, setting: str) -> Schema:
    """A read bandwidth in GB/s: the figure that decides whether this tier's hits beat recomputing the prefix."""
    return {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 10000, "description": (
        f"Read bandwidth of the {tier} back into the GPU, in GB/s (10^9 bytes per second), for this resource's nodes. "
        "It decides whether reloading a max-length prefix from this tier is slower than recomputing it (a warning in "
        "ConfigValid, status.budget.reload). Defaults to the operator "
        f"setting {setting}; status says which figure was used.")}


def _o(description: str, properties: dict[str, Schema], *, required: list[str] | None = None,
       rules: list[dict[str, str]] | None = None, **kw: Any) -> Schema:
    out: Schema = {"type": "object", "description": description, "properties": properties, **kw}
    if required:
        out["required"] = required
    if rules:
        out["x-kubernetes-validations"] = rules
    return out


def _labels(description: str) -> Schema:
    # Bounded so the CEL cost estimator accepts rules over these maps.
    return {"type": "object", "description": description, "maxProperties": 32,
            "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE},
            "x-kubernetes-validations": [{"rule": f"self.all(k, k.size() <= {LABEL_KEY_MAX} "
                                                  f"&& k.matches('{LABEL_KEY}'))",
                                          "message": "keys must be Kubernetes label keys ([prefix/]name)"}]}


def _free(description: str, type_: str = "object") -> Schema:
    """A Kubernetes core type passed through to the pod as is (the API server validates it on the pod)."""
    s: Schema = {"type": type_, "description": description}
    if type_ == "array":
        s["items"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    else:
        s["x-kubernetes-preserve-unknown-fields"] = True
    return s


def _architecture() -> Schema:
    return _o(
        "Model shape, for models outside the built-in catalog or "
        "to correct it. Each field set here wins over the catalog.",
        {
            "layers": _i("Number of transformer layers (num_hidden_layers in config.json).", minimum=1, maximum=1024),
            "attentionHeads": _i("Number of attention (query) heads (num_attention_heads).", minimum=1, maximum=1024),
            "kvHeads": _i("Number of key/value heads (num_key_value_heads; equals attentionHeads without GQA).",
                          minimum=1, maximum=1024),
            "headDim": _i("Dimension of one attention head (head_dim, or hidden_size / num_attention_heads).",
                          minimum=1, maximum=4096),
            "parameters": _i("Parameter count, used to size the weights in GPU memory (e.g. 8030261248).", minimum=1,
                             maximum=10**15, format="int64"),
        },
        rules=rules.at("spec.model.architecture"),
    )


def _model() -> Schema:
    return _o(
        "The model to serve.",
        {
            "name": _s("Hugging Face model id (e.g. meta-llama/Llama-3.1-8B-Instruct) "
                       "or a path inside the model cache volume.",
                       minLength=1, maxLength=256, pattern=r"^[A-Za-z0-9_./-]+$"),
            "servedName": _s("Name clients use in API requests (vLLM --served-model-name); defaults to name.",
                             maxLength=256),
            "architecture": _architecture(),
            "kvDtype": _s("Element type of the KV cache (vLLM --kv-cache-dtype). auto follows engine.dtype; "
                          "fp8 halves the KV bytes per token; bf16 needs "
                          "engine.dtype auto or bfloat16 from vLLM 0.33 on.",
                          enum=["auto", "bf16", "fp8"], default="auto"),
            "hfTokenSecret": _o(
                "Secret holding a Hugging Face token, for gated models. Exposed to vLLM as HF_TOKEN.",
                {"name": _s("Secret name, in the same namespace.", minLength=1, maxLength=253, pattern=DNS_SUBDOMAIN),
                 "key": _s("Key in the Secret.", default="token", minLength=1, maxLength=253,
                           pattern=r"^[-._a-zA-Z0-9]+$")},
                required=["name"]),
            "cache": _o(
                "A PersistentVolumeClaim that holds downloaded weights, mounted as the Hugging Face cache (HF_HOME) so "
                "restarts skip the download. Without it the weights go to an emptyDir sized from the model's weight "
                "bytes (+10% + 2Gi), counted in the pod's ephemeral-storage request and kept across container "
                "restarts, not pod restarts (status.budget.weights).",
                {"claimName": _s("PVC name, in the same namespace.", minLength=1, maxLength=253, pattern=DNS_SUBDOMAIN),
                 "readOnly": {"type": "boolean", "description": "Mount the claim read-only (weights already present).",
                              "default": False}},
                required=["claimName"]),
        },
        required=["name"],
    )


def _engine() -> Schema:
    return _o(
        "The vLLM engine.",
        {
            "image": _s("Serving image with vLLM and LMCache. Defaults to the operator's default image.",
                        maxLength=512),
            "vllmVersion": _s("vLLM version inside image, required when the "
                              "image is not in the operator's version table.",
                              pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$"),
            "lmcacheVersion": _s("LMCache version inside image, required when the "
                                 "image is not in the operator's version table.",
                                 pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$"),
            "maxModelLen": _i("Longest sequence (prompt + output) in tokens (vLLM --max-model-len). "
                              "At least one such sequence must fit in the GPU tier.",
                              minimum=16, maximum=16777216),
            "gpuMemoryUtilization": {"type": "number",
                                     "description": "Fraction of each GPU's memory vLLM may use, in (0, 1] "
                                                    "(vLLM --gpu-memory-utilization).",
                                     "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "default": 0.9},
            "maxNumSeqs": _i("Maximum sequences served at once (vLLM --max-num-seqs).", minimum=1, maximum=65536,
                             default=256),
            "tensorParallelSize": _i("GPUs per replica the model is sharded over (vLLM --tensor-parallel-size). "
                                     "The pod asks for this many GPUs.",
                                     minimum=1, maximum=64, default=1),
            "dtype": _s("Weight and activation type (vLLM --dtype). auto means the model's own (bf16 for the catalog).",
                        enum=["auto", "bfloat16", "float16"], default="auto"),
            "extraArgs": {"type": "array", "maxItems": 64, "description": (
                "Extra vLLM command-line arguments, checked against the flag table of the image's vLLM version "
                f"({', '.join(flags.supported_versions())}): unknown flags, abbreviations, values vLLM would refuse, "
                "flags the operator manages and flags that change the GPU count or the memory budget are refused: "
                + ", ".join(REFUSED_FLAGS) + "."),
                "items": {"type": "string", "maxLength": 1024},
                "x-kubernetes-validations": [{
                    "rule": "self.all(a, !(" + CEL_REFUSED_ARG.replace("REFUSED", _cel_list(REFUSED_FLAGS)) + "))",
                    "message": "extraArgs may not set or abbreviate a flag the operator manages or one that changes "
                               "the GPU count or the memory budget (also spelt with _ or as --flag.key): "
                               + ", ".join(REFUSED_FLAGS)}]},
            "env": {"type": "array", "maxItems": 64, "description": (
                "Extra environment variables for the vLLM container (Kubernetes EnvVar). Variables the operator "
                "manages are refused, each with its reason: the operator's own wiring, which GPUs the container sees, "
                "and where weights, caches and temporary files go: " + ", ".join(MANAGED_ENV)
                + " and any LMCACHE_* (put engine settings in spec.offload)."),
                # A map keyed by name, as the pod spec's env is: the API server refuses a name set twice.
                "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                "items": {"type": "object", "required": ["name"], "x-kubernetes-preserve-unknown-fields": True,
                          "properties": {"name": _s("Variable name.", minLength=1, maxLength=256),
                                         "value": _s("Variable value."),
                                         "valueFrom": _free("Source of the value (Kubernetes EnvVarSource).")}},
                # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is refused by the operator only: a CEL rule over
                # env values (no maxLength) exceeds the API server's cost budget.
                "x-kubernetes-validations": rules.at("spec.engine.env")},
            "apiKeySecretRef": _o(
                "Secret holding the API key clients must send (Authorization: Bearer KEY) for vLLM's /v1 endpoints; "
                "exposed to vLLM as VLLM_API_KEY (vLLM's --api-key, which is refused in extraArgs so the key never "
                "appears in the pod spec). /health and /metrics stay open, so probes and scrapes need no key.",
                {"name": _s("Secret name, in the same namespace.", minLength=1, maxLength=253, pattern=DNS_SUBDOMAIN),
                 "key": _s("Key in the Secret.", default="api-key", minLength=1, maxLength=253,
                           pattern=r"^[-._a-zA-Z0-9]+$")},
                required=["name"]),
        },
        required=["maxModelLen"],
    )


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


def _offload() -> Schema:
    no_threshold = ("There is no CPU fill threshold: LMCache writes each chunk to every tier at store time "
                    "(write-through), and each tier evicts on its own when "
                    "full; a disk hit is copied back into the CPU tier.")
    cpu = _o(
        "Warm tier: pinned host memory, allocated in full when the engine starts (it cannot be reclaimed, so it is "
        "part of the pod's memory request = limit). " + no_threshold,
        {"size": _q("Pinned CPU memory for KV chunks, per replica (split evenly over the tensor-parallel ranks; "
                    "LMCache's max_local_cpu_size is this ÷ tensorParallelSize, in GiB)."),
         "evictionPolicy": _s("Which chunk a full tier drops (LMCache "
                              "cache_policy; applies to the CPU and disk tiers).",
                              enum=["LRU", "LFU", "FIFO", "MRU"], default="LRU"),
         "readGbps": _gbps("CPU tier (pinned host memory, per GPU)", "cpuReadGbps")},
        required=["size"],
    )
    disk = _o(
        "Cold tier: node-local NVMe. Needs the CPU tier. Either a hostPath under a root the cluster admin allowed "
        "(path; its pods are admitted only in namespaces at Pod Security \"privileged\"), or a generic ephemeral "
        "volume from a StorageClass (storageClassName; admitted at \"restricted\", like pods without a disk tier). "
        "Each pod gets its own directory <path>/<namespace>/<name>/<pod>, emptied before the engine starts: LMCache "
        "never reads back files of an earlier process and does not count them against its budget. " + no_threshold,
        {"path": _s("Absolute node directory under one of the operator's allowed "
                    "roots (not the root itself), e.g. /mnt/nvme/lmcache.",
                    maxLength=512, pattern=r"^/[A-Za-z0-9._/-]*$",
                    **{"x-kubernetes-validations": rules.at("spec.offload.disk.path")}),
         "storageClassName": _s("StorageClass of a generic ephemeral volume used instead of a hostPath (Pod Security "
                                "\"restricted\" and \"baseline\" namespaces refuse hostPath pods).",
                                maxLength=253, pattern=DNS_SUBDOMAIN),
         "size": _q("Disk budget per replica (split over the tensor-parallel ranks; LMCache's max_local_disk_size is "
                    "this ÷ tensorParallelSize, in GiB). LMCache never writes more than this."),
         "reclaimPolicy": _s("What happens to node directories when a pod or the resource goes: Delete (emptied at "
                             "every pod start; removed from nodes by the node cleaner when the resource is deleted) or "
                             "Retain (left for the admin).",
                             enum=["Delete", "Retain"], default="Delete"),
         "nodeSelector": _labels("Node labels that mark nodes with this disk; defaults to the operator's NVMe label."),
         "readGbps": _gbps("disk tier (one node-local device shared by the pod's ranks)", "diskReadGbps")},
        required=["size"],
        rules=rules.at("spec.offload.disk"),
    )
    return _o(
        "KV-cache offloading: hot blocks stay in GPU memory, warm ones go to pinned CPU memory, cold ones to "
        "node-local disk. spec.offload.backend chooses the engine that does it (docs/backends.md compares them).",
        {"backend": _s("Who holds the CPU and disk tiers. " + " ".join(
                           f"{b['name']}: {b['summary']}" for b in backend_declarations()["backends"]),
                       enum=[b["name"] for b in backend_declarations()["backends"]],
                       default=backend_declarations()["default"]),
         "chunkSize": _i("Tokens per LMCache chunk (chunk_size, or the LMCache server's --chunk-size); the unit "
                         "stored, looked up and evicted: a shared prefix is reused in whole chunks only. Larger chunks "
                         "store and reload faster (H200, 32k-token prompt: a cold request +10.8 % at 256, +6.0 % at "
                         "2048; reload 0.110 s vs 0.068 s; docs/benchmarks.md). vllm-native offloads whole vLLM KV "
                         "blocks and refuses any value but the default.",
                         minimum=16, maximum=8192, default=256),
         "server": _s("Where the LMCache server of backend lmcache-server runs. Sidecar: one in every serving pod, its "
                      "L1 and L2 that pod's own. PerNode: one server pod per node where this resource's replicas run, "
                      "shared by them (each prefix stored once per node; a replica added or restarted there starts "
                      "warm), kept a grace period after the last replica left the node; vLLM reaches it through a "
                      "per-resource shared-memory directory under the operator's sharedMemoryRoot (hostPath: Pod "
                      "Security \"privileged\") and a node-local Service; needs LMCache >= "
                      f"{'.'.join(map(str, images.SHARED_SERVER_MIN_LMCACHE))} (refused with an older image). Other "
                      "backends run no server: docs/shared-cache.md.",
                      enum=list(rules.SERVER_PLACEMENTS), default=rules.SIDECAR),
         "cpu": cpu,
         "disk": disk},
        required=["cpu"],
        rules=rules.at("spec.offload"),
    )


def backend_refusals(spec: Schema | None = None) -> list[tuple[str, str, list[Any] | None, str]]:
    """Every (backend, spec path, values still allowed, message tail) the backends declare (Backend.refuses),
    one message for the CEL rule (prefixed with the field) and the operator's check (spec.parse). Allowed:
    the declared values, else the field's CRD default (the API server writes it), else None (must be unset)."""
    spec = _cached_spec_schema() if spec is None else spec
    decl = backend_declarations()["backends"]
    out = []
    for b in decl:
        for path, refusal in b["refuses"].items():
            others = " or ".join(o["name"] for o in decl if path not in o["refuses"])
            node = spec
            for part in path.split("."):
                node = node["properties"][part]
            if "allowed" in refusal:
                tail = (f"must be {' or '.join(refusal['allowed'])} with spec.offload.backend {b['name']} "
                        f"({refusal['why']}); other values need backend {others}")
            else:
                tail = (f"is not supported with spec.offload.backend {b['name']} ({refusal['why']}); "
                        f"remove spec.{path} or use backend {others}")
            allowed = refusal.get("allowed") or ([node["default"]] if "default" in node else None)
            out.append((b["name"], path, allowed, tail))
    return out


def _cel(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else json.dumps(value)


def _add_backend_rules(spec: Schema) -> None:
    """The CEL form of backend_refusals, on spec.offload for its own fields, else on the spec."""
    default = backend_declarations()["default"]
    for name, path, allowed, tail in backend_refusals(spec):
        host, rel = ("offload", path.removeprefix("offload.")) if path.startswith("offload.") else ("", path)
        backend = "self.backend" if host else "self.offload.backend"
        chosen = (f"(!has({backend}) || {backend} == '{name}')" if name == default else
                  f"(has({backend}) && {backend} == '{name}')")
        parts = rel.split(".")
        present = " && ".join(f"has(self.{'.'.join(parts[:i + 1])})" for i in range(len(parts)))
        rule = f"!{chosen} || " + (f"!({present})" if len(parts) > 1 else f"!{present}")
        if allowed is not None:
            rule += f" || self.{rel} in [{', '.join(_cel(v) for v in allowed)}]"
        node = spec["properties"][host] if host else spec
        node.setdefault("x-kubernetes-validations", []).append(
            {"rule": rule, "fieldPath": f".{rel}", "message": f"spec.{path} {tail}"})


def _resources() -> Schema:
    return _o(
        "Resources of each serving pod. Memory is computed from the "
        "tiers (request = limit); the fields here override the terms.",
        {"gpuResourceName": _s("Extended resource that counts GPUs (domain/name).", default="nvidia.com/gpu",
                               maxLength=253,
                               pattern=EXTENDED_RESOURCE),
         "gpuMemory": _q("Memory of one GPU, used for sizing the GPU tier (e.g. 80Gi for H100, 141Gi for H200, 24Gi "
                         "for an RTX 4090). Defaults to the operator's setting."),
         "cpu": _q("CPU request of the vLLM container.", default="4"),
         "memory": _q("Memory request = limit of the vLLM container, replacing "
                      "the computed figure (it must still hold the CPU tier)."),
         "engineBaseline": _q("Host memory of vLLM's API server and engine core, before KV tiers.", positive=False),
         "perWorkerOverhead": _q("Host memory of each tensor-parallel worker process (torch, CUDA runtime).",
                                 positive=False),
         "stagingPerWorker": _q("Pinned staging buffers per tensor-parallel worker for GPU/CPU/disk copies.",
                                positive=False),
         "serverBaseline": _q("Host memory of the LMCache server process (backend lmcache-server), before its CPU "
                              "tier: its container's memory request is this plus headroom; its limit adds the L1.",
                              positive=False),
         "shm": _q("Size of the memory-backed /dev/shm (counts against the memory limit)."),
         "headroomPercent": _i("Headroom added on top of the sum, in percent.", minimum=0, maximum=100)},
    )


def _scheduling() -> Schema:
    return _o(
        "Where serving pods may run.",
        {"nodeSelector": _labels("Node labels pods require."),
         "tolerations": _free("Pod tolerations (Kubernetes Toleration list).", "array"),
         "affinity": _free("Pod affinity (Kubernetes Affinity)."),
         "priorityClassName": _s("PriorityClass of the pods.", maxLength=253, pattern=DNS_SUBDOMAIN),
         "topologySpreadConstraints": {**_free(
             "Pod topology spread constraints (Kubernetes TopologySpreadConstraint list). Unset: replicas spread "
             "softly over nodes (maxSkew 1 over kubernetes.io/hostname, whenUnsatisfiable ScheduleAnyway). An empty "
             "list turns spreading off.",
             "array"), "maxItems": 8}},
    )


def _network_policy() -> Schema:
    namespaces = {"type": "array", "maxItems": 64, "x-kubernetes-list-type": "set",
                  "items": _s("Namespace name.", minLength=1, maxLength=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")}
    return _o(
        "A NetworkPolicy for the serving pods: when set, only pods in servingFrom namespaces reach the serving port "
        "(8000, the OpenAI API and vLLM's own /metrics), only pods in metricsFrom namespaces (and the operator's, for "
        "the OffloadActive probe) reach the exporter's metrics port, and nothing else reaches the pods. Egress is not "
        "restricted. Needs a network plugin that enforces NetworkPolicy.",
        {"servingFrom": {**namespaces, "description": "Namespaces whose pods may call the serving port. Empty: none."},
         "metricsFrom": {**namespaces, "default": ["monitoring"],
                         "description": "Namespaces whose pods may scrape the exporter's metrics port (Prometheus)."}},
    )


def _metrics() -> Schema:
    return _o(
        "The per-tier metrics exporter sidecar.",
        {"enabled": {"type": "boolean", "description": "Run the exporter sidecar in every pod.", "default": True},
         "port": _i("Port of the exporter's /metrics. Not a port another container of the pod listens on: "
                    + ", ".join(map(str, managed.PORTS)) + ".", minimum=1024, maximum=65535, default=9400,
                    **{"x-kubernetes-validations": rules.at("spec.metrics.port")})},
    )


REMOVED_TARGETS = ("promptRecomputePercent",)  # kept in the schema only to be refused with why (rules.py)
AUTOSCALERS = ("auto", "hpa", "keda")  # the operator setting `autoscaler`: what spec.autoscaling renders (settings.py)


def _autoscaling() -> Schema:
    per = "per replica, averaged over the replicas"
    return _o(
        "Scale the replicas on load: the operator renders a HorizontalPodAutoscaler (autoscaling/v2) on this "
        "resource's scale subresource, or a KEDA ScaledObject when the operator's setting autoscaler is keda. The "
        "autoscaler then owns spec.replicas (leave it out of your manifests; docs/autoscaling.md). Several targets: "
        "the largest replica count wins.",
        {"minReplicas": _i("Fewest replicas. 0 scales to zero when idle (KEDA only; needs wakeQuery): the first "
                           "request after that waits a whole engine start-up (status.budget.weights.startupSeconds).",
                           minimum=0, maximum=1000, default=1),
         "maxReplicas": _i("Most replicas.", minimum=1, maximum=1000),
         "targets": _o(
             "What one replica should carry; set at least one.",
             {"waitingRequestsPerReplica": _i(f"Requests queued in vLLM (vllm:num_requests_waiting), {per}.",
                                              minimum=1, maximum=100000),
              "kvCacheUsagePercent": _i(f"GPU KV-cache usage in percent (vllm:kv_cache_usage_perc x 100), {per}.",
                                        minimum=1, maximum=100),
              "queueTimeP90Milliseconds": _i(
                  "90th percentile, over the last 2 minutes, of the time requests waited in vLLM's queue before their "
                  "prefill started, in ms (histogram_quantile over vllm:request_queue_time_seconds), for the whole "
                  "service: it falls as replicas are added because each replica's queue is shorter.",
                  minimum=1, maximum=600000),
              "promptRecomputePercent": _i(
                  "Removed as a target (refused): " + rules.RECOMPUTE_REMOVED_WHY, minimum=1, maximum=100)},
             rules=rules.at("spec.autoscaling.targets")),
         "scaleUpPeriodSeconds": _i("Replicas at most double per this many seconds, so that load queued while new "
                                    "engines start does not add still more. Default: the engine's start-up budget "
                                    "(startupSeconds), at most 1800.",
                                    minimum=1, maximum=1800),
         "scaleDownWindowSeconds": _i("Replicas are removed only after the load has stayed low this long (the HPA's "
                                      "scale-down stabilization window; KEDA's cooldownPeriod before scaling to zero). "
                                      "Default: the engine's start-up budget, at least 300, at most 3600: a replica "
                                      "removed too early costs a whole start-up to get back.", minimum=0, maximum=3600),
         "wakeQuery": _s("A PromQL expression for the demand that exists while no replica runs (for example requests "
                         "queued in your gateway for this model); a value above 0 starts the first replica, and it "
                         "counts like waitingRequestsPerReplica. Every selector in it must carry namespace=\"<this "
                         "resource's namespace>\" (the operator parses it and refuses anything else: the Prometheus is "
                         "shared by every namespace). KEDA only; required with minReplicas 0.", minLength=1,
                         maxLength=1024)},
        required=["maxReplicas", "targets"],
        rules=rules.at("spec.autoscaling"),
    )


def _routing() -> Schema:
    return _o(
        "Cache-aware routing: vLLM's router (vllm-router " + engine_router.VERSION
        + ") in front of the replicas, in its own "
        "Deployment and Service, discovering exactly this resource's serving pods through the API server. Requests "
        "that share a prefix go to the replica that holds it instead of being spread at random, so each replica's "
        "tiers hold different prefixes rather than copies. status.endpoint then names the router. docs/routing.md says "
        "how each tier is credited.",
        {"enabled": {"type": "boolean", "default": True,
                     "description": "Run the router (false keeps the section "
                                    "but removes the router and its children)."},
         "policy": _s("How the router picks a replica. auto: cache_aware, on every backend (it served best on real "
                      "engines: docs/benchmarks.md). "
                      "kv_aware: follows the engines' KV events (the router is started with each Ready replica and "
                      "its event publisher, and rolls when they change), crediting a hit in each tier "
                      "by what it saves against recomputing (status.routing.credits). cache_aware: a per-replica "
                      "prefix tree of the requests' tokens, sized from the tiers worth reloading "
                      "(status.routing.maxTreeSize). round_robin: no cache affinity.",
                      enum=list(engine_router.POLICIES), default="auto"),
         "replicas": _i("Router pods. Each keeps its own view of the caches, so more than one splits the affinity "
                        "between them; 1 is enough for most fleets (the router is a small Rust proxy).",
                        minimum=1, maximum=10, default=1)},
        rules=rules.at("spec.routing"),
    )


def spec_schema() -> Schema:
    spec = _o(
        "Desired state of a vLLM + LMCache service with KV-cache offloading.",
        {"model": _model(),
         "replicas": _i("Number of serving pods (each a full copy of the model). With spec.autoscaling the autoscaler "
                       "sets it through the scale subresource and the operator follows; leave it out of manifests "
                       "then, or a re-apply resets it (docs/autoscaling.md).", minimum=0, maximum=1000, default=1),
         "engine": _engine(),
         "offload": _offload(),
         "resources": _resources(),
         "scheduling": _scheduling(),
         "metrics": _metrics(),
         "networkPolicy": _network_policy(),
         "autoscaling": _autoscaling(),
         "routing": _routing()},
        required=["model", "engine", "offload"],
        rules=rules.at("spec"),
    )
    _add_backend_rules(spec)
    return spec


def _condition() -> Schema:
    return _o(
        "A condition (Kubernetes API conventions).",
        {"type": _s(", ".join(conditions.TYPES[:-1]) + " or " + conditions.TYPES[-1] + "."),
         "status": _s("True, False or Unknown.", enum=["True", "False", "Unknown"]),
         "reason": _s("CamelCase reason: " + "; ".join(f"{c.type}: {', '.join(c.reasons)}"
                                                       for c in conditions.CONDITIONS)
                      + " (Reconciling also carries Ready's)."),
         "message": _s("Human-readable detail."),
         "lastTransitionTime": _s("When status last changed.", format="date-time"),
         "observedGeneration": _i("Generation the condition was computed from.", format="int64")},
        required=["type", "status"],
    )


def status_schema() -> Schema:
    # The default status makes a resource the operator has not seen yet read "generation not
    # observed" (observedGeneration 0 < generation) to kstatus (Helm --wait, Flux) and Argo CD,
    # instead of "no status: current". The API server applies it when it serves the object.
    return _o(
        "Observed state, written by the operator.",
        {"observedGeneration": _i("Generation of the spec the operator last rolled out (0: none yet).", format="int64"),
         "conditions": {"type": "array", "description": conditions.summary(),
                        "items": _condition(), "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
         "replicas": _i("Pods that exist.", format="int32"),
         "readyReplicas": _i("Pods that are Ready.", format="int32"),
         "selector": _s("Label selector of the pods (for the scale subresource and HPA)."),
         "endpoint": _s("In-cluster URL of the OpenAI-compatible API (the router's, with spec.routing)."),
         "routing": _o("The router (spec.routing): what it runs and whether it is available.", {
             "policy": _s("The policy the router runs (spec.routing.policy with auto resolved)."),
             "deployment": _s("Name of the router's Deployment (and Service)."),
             "readyReplicas": _i("Router pods that are ready.", format="int32"),
             "maxTreeSize": _i("cache_aware: each replica's prefix-tree budget in the router's characters (the tokens "
                               "of the largest tier worth reloading x 8, the "
                               "characters the router writes per token id).",
                               format="int64"),
             "credits": {"type": "object", "additionalProperties": {"type": "number"},
                         "description": "kv_aware: the credit of a hit in each offload tier (1 - reload / recompute "
                                        "time, 0 when reloading is slower than recomputing), as rendered into the "
                                        "router's --kv-penalty-* flags."},
             "eventTiers": {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "atomic",
                            "description": "kv_aware: the tiers whose KV events the engines publish to the router "
                                           "(gpu; cpu with backend vllm-native)."},
             "unseenTiers": {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "atomic",
                             "description": "kv_aware: the tiers worth a hit whose KV events the engines do not "
                                            "publish (the router cannot credit their hits)."},
             "workers": _i("kv_aware: serving pods the router was started with (their KV events indexed); pods "
                           "that became Ready since are routed on load until the router rolls.", format="int32")}),
         "versions": _o("The engine: the pair the operator rendered for, and what the pods really run.", {
             "image": _s("Serving image."),
             "renderedFor": _o("The vLLM / LMCache pair the pods were rendered for (spec.engine versions, else the "
                               "operator's image table).", {"vllm": _s("vLLM version."),
                                                            "lmcache": _s("LMCache version.")}),
             "running": {"type": "array", "x-kubernetes-list-type": "atomic",
                         "description": "What the pods' exporters report (kvoffload_engine_info, read from the serving "
                                        "image by its init container): one entry per distinct version set. Empty until "
                                        "an exporter answers.",
                         "items": _o("One version set and the pods that run it.", {
                             "vllm": _s("vLLM version ('none': not installed)."),
                             "lmcache": _s("LMCache version ('none': not installed)."),
                             "torch": _s("torch version ('none': not installed)."),
                             "podCount": _i("Pods that run it.", format="int32"),
                             "pods": {"type": "array", "maxItems": MAX_VERSION_PODS, "x-kubernetes-list-type": "atomic",
                                      "description": f"The first {MAX_VERSION_PODS} of those pods, by name.",
                                      "items": {"type": "string"}}})}}),
         "summary": _o("Short figures for kubectl get.", {
             "gpuTokens": _i("Tokens the GPU tier holds.", format="int64"),
             "cpuTokens": _i("Tokens the CPU tier holds.", format="int64"),
             "diskTokens": _i("Tokens the disk tier holds.", format="int64"),
             "memory": _s("Memory request = limit of the vLLM container."),
             "serverMemory": _s("Memory request of the LMCache server container (backend lmcache-server)."),
             "serverMemoryLimit": _s("Memory limit of the LMCache server container: its request + the L1, which it "
                                     "faults in itself when it sees a GPU (backend lmcache-server).")}),
         "autoscaling": _o("What the autoscaler wants and why (spec.autoscaling), "
                           "read from its HorizontalPodAutoscaler.", {
             "autoscaler": _s("hpa or keda (the operator setting, auto resolved when the operator started)."),
             "horizontalPodAutoscaler": _s("Name of the HorizontalPodAutoscaler (KEDA's is keda-hpa-<name>)."),
             "currentReplicas": _i("Replicas the autoscaler last saw.", format="int32"),
             "desiredReplicas": _i("Replicas the autoscaler wants.", format="int32"),
             "lastScaleTime": _s("When it last changed the replica count.", format="date-time"),
             "metrics": {"type": "array", "x-kubernetes-list-type": "atomic",
                         "description": "Each target: its value now.",
                         "items": _o("One target.", {"target": _s("The spec.autoscaling.targets field (or wakeQuery)."),
                                                     "current": _s("Its value now, in the target's unit."),
                                                     "want": _s("The target's value.")})},
             "reason": _s("The autoscaler's reason (the HorizontalPodAutoscaler's conditions)."),
             "message": _s("The same, for humans.")}),
         "budget": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                    "description": "The computed budget: KV bytes per token, tokens and sequences per tier, memory "
                                   "terms, /dev/shm, reload vs recompute."}},
        default={"observedGeneration": 0},
    )


def schema() -> Schema:
    return {"type": "object",
            "description": "KVOffloadServe runs vLLM with LMCache KV-cache "
                           "offloading (GPU, pinned CPU, node-local disk).",
            "properties": {"apiVersion": {"type": "string", "description": "APIVersion of this object."},
                           "kind": {"type": "string", "description": "Kind of this object."},
                           "metadata": {"type": "object"},
                           "spec": spec_schema(),
                           "status": status_schema()},
            "required": ["spec"],
            "x-kubernetes-validations": [
                {"rule": f"self.metadata.name.size() <= {MAX_NAME}",
                 "message": f"metadata.name must be at most {MAX_NAME} characters so child and pod names fit in 63"},
                {"rule": f"self.metadata.name.matches('{NAME_PATTERN}')",
                 "message": "metadata.name must be a DNS-1035 label (lower-case letters, digits and '-', starting with "
                            "a letter): it names Services and pods"}]}


def printer_columns() -> list[dict[str, Any]]:
    return [
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "Available", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "GPU-Tokens", "type": "integer", "jsonPath": ".status.summary.gpuTokens"},
        {"name": "Backend", "type": "string", "jsonPath": ".spec.offload.backend"},
        {"name": "CPU", "type": "string", "jsonPath": ".spec.offload.cpu.size"},
        {"name": "CPU-Tokens", "type": "integer", "jsonPath": ".status.summary.cpuTokens", "priority": 1},
        {"name": "Disk", "type": "string", "jsonPath": ".spec.offload.disk.size"},
        {"name": "Disk-Tokens", "type": "integer", "jsonPath": ".status.summary.diskTokens", "priority": 1},
        {"name": "Memory", "type": "string", "jsonPath": ".status.summary.memory"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}",
                     "labels": {"app.kubernetes.io/name": "kvoffload", "app.kubernetes.io/part-of": "kvoffload"}},
        "spec": {
            "group": GROUP,
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": SHORT_NAMES, "categories": ["all", "kvoffload"]},
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": schema()},
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                         "statusReplicasPath": ".status.replicas",
                                                         "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": printer_columns(),
            }],
        },
    }


@functools.lru_cache(maxsize=1)
def _cached_spec_schema() -> Schema:
    return spec_schema()


def schema_at(path: str) -> Schema:
    """The (shared, read-only) schema node at a dotted spec path, e.g. `offload.chunkSize`."""
    node = _cached_spec_schema()
    for part in path.split("."):
        node = node["properties"][part]
    return node


def default_at(path: str) -> Any:
    """The schema default at a dotted spec path (e.g. `offload.chunkSize`), or None."""
    return schema_at(path).get("default")


def leaf_paths(node: Schema | None = None, prefix: str = "") -> set[str]:
    """Every leaf field of the spec, as dotted paths; pass-through Kubernetes types count as leaves. A removed
    field (REMOVED_TARGETS: in the schema only to be refused with why) is not one you can set."""
    node = spec_schema() if node is None else node
    if prefix in {f"autoscaling.targets.{t}" for t in REMOVED_TARGETS}:
        return set()
    props = node.get("properties")
    if node.get("type") != "object" or not props or node.get("x-kubernetes-preserve-unknown-fields"):
        return {prefix}
    out: set[str] = set()
    for name, child in props.items():
        out |= leaf_paths(child, f"{prefix}.{name}" if prefix else name)
    return out
