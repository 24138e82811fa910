"""render: (KVOffloadServe metadata, Spec, Budget, Settings) -> the children, as plain dicts.

Pure and deterministic: the same input always gives byte-identical manifests, so golden
files, `kvoffload render` and the reconciler agree, and a no-op reconcile writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import yaml

from ..api import crd
from ..api.errors import ConfigError
from ..api.quantity import format_bytes, gib
from ..api.settings import Settings
from ..api.spec import Spec
from ..engine import images
from ..engine import versions as engine_versions
from ..engine.images import EnginePair
from ..planning import sizing
from ..planning.sizing import Budget
from . import pod_security
from .network_policy import network_policy
from .placement import topology_spread

HTTP_PORT = 8000
CONFIG_DIR = "/etc/lmcache"
CONFIG_FILE = f"{CONFIG_DIR}/lmcache.yaml"
DISK_DIR = "/kvcache"
MULTIPROC_DIR = "/var/run/kvoffload/prometheus"
MODELS_DIR = pod_security.MODELS_DIR
# The vLLM container's command: empty the multiprocess dir at EVERY start of the container (it is an
# emptyDir that outlives a crashed vLLM, and prometheus_client would add a dead process's files to
# the new one's), then exec vLLM. sh -c SCRIPT vllm serve ARGS... runs with $0=vllm, $@=serve ARGS,
# so the args stay exactly vLLM's and the vLLM argv is `vllm_argv(container)`: command[3:] + args.
# A failed emptying is reported and does not keep vLLM from starting.
VLLM_PRELUDE = 'find "$PROMETHEUS_MULTIPROC_DIR" -mindepth 1 -delete; exec "$0" "$@"'
VLLM_COMMAND = ["/bin/sh", "-c", VLLM_PRELUDE, "vllm", "serve"]
KV_TRANSFER_CONFIG = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, separators=(",", ":"))
# Backend lmcache-server: the LMCache server sidecar, reached on the pod's loopback only.
SERVER_ZMQ_PORT = 5555
SERVER_HTTP_PORT = 8081  # /healthcheck and /status (L1/L2 usage, registered engines); not /metrics in 0.5.3
SERVER_TRANSFER_MODE = "engine_driven"  # the server has no GPU: vLLM's workers copy KV into its /dev/shm L1
MP_KV_TRANSFER_CONFIG = json.dumps({
    "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": SERVER_ZMQ_PORT,
                                  "lmcache.mp.mp_transfer_mode": SERVER_TRANSFER_MODE}}, separators=(",", ":"))
OWNER_LABEL = "kvoffload.io/serve"
CONFIG_HASH_ANNOTATION = "kvoffload.io/config-hash"
KV_DTYPE_FLAG = {"bf16": "bfloat16", "fp8": "fp8"}
# Kinds the operator owns, in apply order (config before the pods that mount it).
CHILD_KINDS = (("v1", "ConfigMap"), ("v1", "Service"), ("apps/v1", "StatefulSet"), ("policy/v1", "PodDisruptionBudget"),
               ("networking.k8s.io/v1", "NetworkPolicy"))


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str = ""  # empty in offline rendering: no ownerReferences then


def names(owner_name: str) -> dict[str, str]:
    return {"statefulset": owner_name, "configmap": f"{owner_name}-lmcache", "service": owner_name,
            "headless": f"{owner_name}-pods", "pdb": owner_name, "networkpolicy": owner_name}


def selector_labels(owner: Owner) -> dict[str, str]:
    return {OWNER_LABEL: owner.name}


def labels(owner: Owner, settings: Settings) -> dict[str, str]:
    return {**settings.labels, "app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": owner.name,
            "app.kubernetes.io/component": "serving", "app.kubernetes.io/managed-by": "kvoffload",
            "app.kubernetes.io/part-of": "kvoffload", **selector_labels(owner)}


def _meta(name: str, owner: Owner, settings: Settings, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": owner.namespace, "labels": labels(owner, settings), **extra}
    if owner.uid:
        meta["ownerReferences"] = [{"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "name": owner.name,
                                    "uid": owner.uid, "controller": True, "blockOwnerDeletion": True}]
    return meta


def lmcache_gib(budget: Budget, tier: str) -> float:
    """A tier's per-worker share (Budget) in LMCache's unit: GiB as a float, to 6 decimals."""
    return round(gib(budget.tier(tier).bytes_per_worker), 6)


def server_args(spec: Spec, budget: Budget) -> list[str]:
    """`lmcache server` flags (LMCache 0.5.3's own parser, checked in the fidelity tests): the whole
    replica's L1 (one server serves every TP rank), LRU, and the disk tier as an `fs_native` L2 adapter
    whose max_capacity_gb caps it (the plain `fs` adapter has no capacity limit). The L1 is eager
    (--no-l1-use-lazy) so that vLLM's workers and the server share it through /dev/shm."""
    args = ["--host", "127.0.0.1", "--port", str(SERVER_ZMQ_PORT),
            "--chunk-size", str(spec.offload.chunk_size),
            "--l1-size-gb", repr(round(gib(budget.tier("cpu").bytes), 6)),
            "--eviction-policy", spec.offload.eviction_policy,
            # Eager L1: LMCache 0.5.3 defaults to a lazy L1 on GPU hosts, which turns the /dev/shm
            # transfer off; KV then travels pickled over ZMQ (H200: ~144 MB/s stores, and a retrieve
            # over 4 GiB fails msgpack's limit, hanging vLLM for mq_timeout and killing its engine).
            "--no-l1-use-lazy",
            "--supported-transfer-mode", SERVER_TRANSFER_MODE,
            "--http-host", "127.0.0.1", "--http-port", str(SERVER_HTTP_PORT),
            "--instance-id", "$(POD_NAME)"]
    if spec.offload.disk:
        adapter = {"type": "fs_native", "base_path": DISK_DIR, "max_capacity_gb": round(gib(budget.tier("disk").bytes), 6)}
        args += ["--l2-adapter", json.dumps(adapter, separators=(",", ":"), sort_keys=True)]
    return args


def lmcache_config(spec: Spec, budget: Budget) -> dict[str, Any]:
    """LMCache in-process config: keys and units exactly as `LMCacheEngineConfig` reads them (sizes are GiB
    floats per worker, i.e. per tensor-parallel rank); tests/engine/test_fidelity.py loads every rendered
    config with the image's LMCache (0.5.3 by default) and its own loader."""
    config: dict[str, Any] = {
        "chunk_size": spec.offload.chunk_size,
        "local_cpu": True,  # the disk tier needs it; the CPU tier is the point of this product
        "max_local_cpu_size": lmcache_gib(budget, "cpu"),
        "cache_policy": spec.offload.eviction_policy,
    }
    if spec.offload.disk:
        config["local_disk"] = f"file://{DISK_DIR}/"
        config["max_local_disk_size"] = lmcache_gib(budget, "disk")
    return config


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def configmap(owner: Owner, spec: Spec, budget: Budget, settings: Settings) -> dict[str, Any]:
    text = f"# Rendered by kvoffload for LMCache {spec.engine.lmcache_version}. Edit the KVOffloadServe, not this.\n" + yaml.safe_dump(
        lmcache_config(spec, budget), sort_keys=True)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(names(owner.name)["configmap"], owner, settings),
            "data": {"lmcache.yaml": text}}


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def _offload_args(spec: Spec, budget: Budget) -> list[str]:
    backend = spec.offload.backend
    if backend == "vllm-native":
        # GiB over all TP ranks (vLLM's CacheConfig.kv_offloading_size): OffloadingConnector, CPU tier only.
        size = sizing.native_offloading_size_gib(budget.tier("cpu").bytes)
        return ["--kv-offloading-backend", "native", "--kv-offloading-size", repr(size)]
    return ["--kv-transfer-config", MP_KV_TRANSFER_CONFIG if backend == "lmcache-server" else KV_TRANSFER_CONFIG]


def _vllm_args(spec: Spec, budget: Budget) -> list[str]:
    e = spec.engine
    args = [spec.model.name,
            "--host", "0.0.0.0", "--port", str(HTTP_PORT),
            "--served-model-name", spec.model.served_name,
            "--max-model-len", str(e.max_model_len),
            "--gpu-memory-utilization", repr(e.gpu_memory_utilization),
            "--max-num-seqs", str(e.max_num_seqs),
            "--tensor-parallel-size", str(e.tensor_parallel_size),
            "--dtype", e.dtype]
    if spec.model.kv_dtype != "auto":
        args += ["--kv-cache-dtype", KV_DTYPE_FLAG[spec.model.kv_dtype]]
    return args + [*_offload_args(spec, budget), *e.extra_args]


def _telemetry_off_env() -> list[dict[str, Any]]:
    # In every container that runs vLLM or LMCache code (the vllm container, the lmcache-server sidecar).
    return [{"name": k, "value": v} for k, v in sorted(images.telemetry_off_env().items())]


def _vllm_env(spec: Spec, settings: Settings) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        *([{"name": "LMCACHE_CONFIG_FILE", "value": CONFIG_FILE}] if spec.offload.backend == "lmcache" else []),
        {"name": "PYTHONHASHSEED", "value": settings.python_hash_seed},
        {"name": "PROMETHEUS_MULTIPROC_DIR", "value": MULTIPROC_DIR},
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
    ]
    if spec.offload.backend == "lmcache":
        # What this pair needs for the in-process connector to really load KV (vLLM 0.26.0: the V1 model
        # runner; LMCacheConnectorV1 skips loads under V2). LMCacheMPConnector has no such early return.
        pair = EnginePair(spec.engine.vllm_version, spec.engine.lmcache_version)
        env += [{"name": k, "value": v} for k, v in sorted(images.connector_env(pair).items())]
    env += _telemetry_off_env()
    env += pod_security.engine_env(spec)
    if spec.engine.api_key_secret:
        secret, key = spec.engine.api_key_secret
        env.append({"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    if spec.model.hf_token_secret:
        secret, key = spec.model.hf_token_secret
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    return env + [dict(v) for v in spec.engine.env]


def _probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": 5}


_restricted = pod_security.restricted


def _vllm_container(owner: Owner, spec: Spec, budget: Budget, settings: Settings) -> dict[str, Any]:
    tp = str(spec.engine.tensor_parallel_size)
    memory = format_bytes(budget.memory_limit)
    in_process = spec.offload.backend == "lmcache"
    mounts = [*([{"name": "lmcache-config", "mountPath": CONFIG_DIR, "readOnly": True}] if in_process else []),
              {"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "prometheus-multiproc", "mountPath": MULTIPROC_DIR}]
    if spec.offload.disk and in_process:
        mounts.append(_disk_mount(owner, spec, read_only=False))
    mounts += pod_security.engine_mounts(spec)
    return {
        "name": "vllm",
        "image": spec.engine.image,
        "command": list(VLLM_COMMAND),
        "args": _vllm_args(spec, budget),
        "env": _vllm_env(spec, settings),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": spec.resources.cpu, "memory": memory, spec.resources.gpu_resource_name: tp,
                         "ephemeral-storage": pod_security.ephemeral_storage(budget)},
            "limits": {"memory": memory, spec.resources.gpu_resource_name: tp},
        },
        "volumeMounts": mounts,
        # Downloading and loading weights: the Budget's start-up seconds before liveness applies.
        "startupProbe": _probe("/health", "http", 10, budget.weights.startup_seconds // 10),
        "readinessProbe": _probe("/health", "http", 5, 3),
        "livenessProbe": _probe("/health", "http", 10, 6),
        "securityContext": pod_security.vllm_security_context(),
    }


def vllm_argv(container: dict[str, Any]) -> list[str]:
    """The argv the vLLM container finally execs (`vllm serve MODEL ...`), without the prelude."""
    if container["command"][:3] != VLLM_COMMAND[:3]:
        raise ValueError(f"container {container.get('name')!r} was not rendered with VLLM_COMMAND")
    return container["command"][3:] + container["args"]


def _disk_mount(owner: Owner, spec: Spec, *, read_only: bool) -> dict[str, Any]:
    # readOnly is omitempty in the API: only ever write `true`, or the live object never matches.
    mount: dict[str, Any] = {"name": "kv-disk", "mountPath": DISK_DIR, **({"readOnly": True} if read_only else {})}
    if spec.offload.disk and spec.offload.disk.path:
        # Each pod gets <path>/<namespace>/<name>/<pod>; kubelet refuses a subPath that escapes the volume.
        mount["subPathExpr"] = f"$(POD_NAMESPACE)/{owner.name}/$(POD_NAME)"
    return mount


def _disk_init_container(owner: Owner, spec: Spec) -> dict[str, Any]:
    # LMCache 0.5.6 starts with an empty index and never counts old files: empty the directory
    # first or the disk fills past its budget after every restart.
    script = ('set -eu; d="' + DISK_DIR + '"; '
              'find "$d" -xdev -mindepth 1 -delete; ' + pod_security.disk_init_handover(spec) +
              'echo "kvoffload: emptied $d ($POD_NAMESPACE/' + owner.name + '/$POD_NAME)"')
    return {
        "name": "prepare-disk-tier",
        "image": spec.engine.image,
        "command": ["/bin/sh", "-c", script],
        "env": [_field_env("POD_NAME", "metadata.name"), _field_env("POD_NAMESPACE", "metadata.namespace")],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
        "volumeMounts": [_disk_mount(owner, spec, read_only=False)],
        "securityContext": pod_security.disk_init_security_context(spec),
    }


def _server_container(owner: Owner, spec: Spec, budget: Budget, settings: Settings) -> dict[str, Any]:
    """The LMCache server as a native sidecar (an init container that keeps running): it starts, and
    must answer /healthcheck, before vLLM starts, and it outlives vLLM container restarts, so the
    L1 in the pod's /dev/shm and the L2 directory stay warm. It needs no GPU (engine-driven transfer)."""
    # Request: the server process. Limit: + the L1, which the server faults in itself when it sees a
    # GPU (LMCache's alloc_shm_pinned_ptr); the vLLM container requests it, so the pod counts it once.
    request, limit = format_bytes(budget.server_memory), format_bytes(budget.server_memory_limit)
    health = ("import urllib.request; urllib.request.urlopen("
              f"'http://127.0.0.1:{SERVER_HTTP_PORT}/healthcheck', timeout=4)")
    exec_probe = {"exec": {"command": ["python3", "-c", health]}, "timeoutSeconds": 5}
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.offload.disk:
        mounts.append(_disk_mount(owner, spec, read_only=False))
    return {
        "name": "lmcache-server",
        "image": spec.engine.image,
        "restartPolicy": "Always",
        "command": ["lmcache", "server"],
        "args": server_args(spec, budget),
        "env": [_field_env("POD_NAME", "metadata.name"), _field_env("POD_NAMESPACE", "metadata.namespace"),
                *_telemetry_off_env()],
        "resources": {"requests": {"cpu": "1", "memory": request}, "limits": {"memory": limit}},
        "volumeMounts": mounts,
        # Importing LMCache takes seconds to tens of seconds; vLLM starts once this passes.
        "startupProbe": {**exec_probe, "periodSeconds": 5, "failureThreshold": 60},
        "livenessProbe": {**exec_probe, "periodSeconds": 10, "failureThreshold": 6},
        "securityContext": _restricted(),
    }


def _versions_init_container(spec: Spec) -> dict[str, Any]:
    # The serving image itself says which vLLM / LMCache / torch it holds; the exporter serves that
    # as kvoffload_engine_info and the operator compares it with the pair it rendered for.
    return {
        "name": "report-engine-versions",
        "image": spec.engine.image,
        "command": ["python3", "-c", engine_versions.REPORT_SCRIPT, engine_versions.VERSIONS_FILE],
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "volumeMounts": [{"name": "engine-info", "mountPath": engine_versions.ENGINE_DIR}],
        "securityContext": _restricted(readOnlyRootFilesystem=True),
    }


def _exporter_container(owner: Owner, spec: Spec, budget: Budget, settings: Settings) -> dict[str, Any]:
    backend = spec.offload.backend
    args = ["exporter",
            "--listen", f"$(POD_IP):{spec.metrics_port}",  # the pod IP only, not every interface
            "--vllm-metrics-url", f"http://127.0.0.1:{HTTP_PORT}/metrics"]
    mounts = [{"name": "prometheus-multiproc", "mountPath": MULTIPROC_DIR, "readOnly": True},
              {"name": "engine-info", "mountPath": engine_versions.ENGINE_DIR, "readOnly": True}]
    if backend == "lmcache":
        args += ["--multiproc-dir", MULTIPROC_DIR, "--lmcache-config", CONFIG_FILE]
        mounts.insert(0, {"name": "lmcache-config", "mountPath": CONFIG_DIR, "readOnly": True})
    else:
        args += ["--backend", backend, "--cpu-capacity-bytes", str(budget.tier("cpu").bytes)]
        if backend == "lmcache-server":
            args += ["--lmcache-server-url", f"http://127.0.0.1:{SERVER_HTTP_PORT}/status"]
            if spec.offload.disk:
                args += ["--disk-capacity-bytes", str(budget.tier("disk").bytes)]
    args += ["--tensor-parallel-size", str(spec.engine.tensor_parallel_size),
             "--kv-bytes-per-token", str(budget.kv_bytes_per_token),
             "--engine-versions-file", engine_versions.VERSIONS_FILE]
    if spec.offload.disk:
        args += ["--disk-dir", DISK_DIR]
        mounts.append(_disk_mount(owner, spec, read_only=True))
    return {
        "name": "exporter",
        "image": settings.exporter_image,
        "imagePullPolicy": settings.exporter_image_pull_policy,
        "command": ["kvoffload"],
        "args": args,
        # kubelet expands the disk mount's subPathExpr from this container's own env, and refuses to
        # create the container when a variable is missing (CreateContainerConfigError).
        "env": [_field_env("POD_IP", "status.podIP"),
                *([_field_env("POD_NAME", "metadata.name"), _field_env("POD_NAMESPACE", "metadata.namespace")]
                  if spec.offload.disk else [])],
        "ports": [{"name": "metrics", "containerPort": spec.metrics_port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
        "volumeMounts": mounts,
        "livenessProbe": _probe("/healthz", "metrics", 20, 3),
        "securityContext": _restricted(readOnlyRootFilesystem=True, runAsNonRoot=True, runAsUser=65532, runAsGroup=65532),
    }


def _volumes(owner: Owner, spec: Spec, budget: Budget) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        *([{"name": "lmcache-config", "configMap": {"name": names(owner.name)["configmap"]}}]
          if spec.offload.backend == "lmcache" else []),
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": format_bytes(budget.shm)}},
        {"name": "prometheus-multiproc", "emptyDir": {"sizeLimit": "256Mi"}},
    ]
    if spec.metrics_enabled:
        volumes.append({"name": "engine-info", "emptyDir": {"sizeLimit": "1Mi"}})
    disk = spec.offload.disk
    if disk and disk.path:
        volumes.append({"name": "kv-disk", "hostPath": {"path": disk.path, "type": "DirectoryOrCreate"}})
    elif disk:
        volumes.append({"name": "kv-disk", "ephemeral": {"volumeClaimTemplate": {
            "metadata": {"labels": selector_labels(owner)},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": disk.storage_class,
                     "resources": {"requests": {"storage": format_bytes(budget.tier("disk").bytes)}}}}}})
    return volumes + pod_security.engine_volumes(spec, budget)


def statefulset(owner: Owner, spec: Spec, budget: Budget, settings: Settings, config_hash: str) -> dict[str, Any]:
    containers = [_vllm_container(owner, spec, budget, settings)]
    if spec.metrics_enabled:
        containers.append(_exporter_container(owner, spec, budget, settings))
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # vLLM never talks to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": pod_security.pod_security_context(),
        "containers": containers,
        "volumes": _volumes(owner, spec, budget),
    }
    init = ([_disk_init_container(owner, spec)] if spec.offload.disk else []) + (
        [_versions_init_container(spec)] if spec.metrics_enabled else [])
    if spec.offload.backend == "lmcache-server":
        init.append(_server_container(owner, spec, budget, settings))
    if init:
        pod["initContainers"] = init
    node_selector = {**spec.scheduling.node_selector, **(spec.offload.disk.node_selector if spec.offload.disk else {})}
    if node_selector:
        pod["nodeSelector"] = dict(sorted(node_selector.items()))
    if spec.scheduling.tolerations:
        pod["tolerations"] = [dict(t) for t in spec.scheduling.tolerations]
    if spec.scheduling.affinity:
        pod["affinity"] = spec.scheduling.affinity
    if spec.scheduling.priority_class_name:
        pod["priorityClassName"] = spec.scheduling.priority_class_name
    spread = topology_spread(spec, selector_labels(owner))
    if spread:
        pod["topologySpreadConstraints"] = spread
    n = names(owner.name)
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _meta(n["statefulset"], owner, settings),
        "spec": {
            "replicas": spec.replicas,
            "serviceName": n["headless"],
            "podManagementPolicy": "Parallel",  # replicas are independent caches; no ordering needed
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(owner)},
            "template": {"metadata": {"labels": labels(owner, settings),
                                      "annotations": {CONFIG_HASH_ANNOTATION: config_hash}},
                         "spec": pod},
        },
    }


def _service_ports(spec: Spec) -> list[dict[str, Any]]:
    ports = [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]
    if spec.metrics_enabled:
        ports.append({"name": "metrics", "port": spec.metrics_port, "targetPort": "metrics", "protocol": "TCP"})
    return ports


def services(owner: Owner, spec: Spec, settings: Settings) -> list[dict[str, Any]]:
    n = names(owner.name)
    serving = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(n["service"], owner, settings),
               "spec": {"type": "ClusterIP", "selector": selector_labels(owner), "ports": _service_ports(spec)}}
    headless = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(n["headless"], owner, settings),
                "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector_labels(owner),
                         "ports": _service_ports(spec)}}
    return [serving, headless]


def pdb(owner: Owner, settings: Settings) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(names(owner.name)["pdb"], owner, settings),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner)}}}


def endpoint(owner: Owner) -> str:
    return f"http://{names(owner.name)['service']}.{owner.namespace}.svc:{HTTP_PORT}/v1"


def check_name(name: str) -> None:
    """Children are <name>, <name>-lmcache, <name>-pods and pods <name>-<ordinal>; Services need DNS-1035 labels."""
    if not isinstance(name, str) or len(name) > crd.MAX_NAME or not re.fullmatch(crd.NAME_PATTERN.strip("^$"), name):
        raise ConfigError("metadata.name", f"{name!r} must be a DNS-1035 label (a-z, 0-9, '-', starting with a letter) of at "
                                           f"most {crd.MAX_NAME} characters so child and pod names fit in 63")


def children(owner: Owner, spec: Spec, budget: Budget, settings: Settings) -> list[dict[str, Any]]:
    """Every child, in apply order (owner.name passed check_name: pipeline.desired checks it first)."""
    if spec.offload.backend != "lmcache":  # no LMCache config file: the server's flags or vLLM's own flags say it all
        return [*services(owner, spec, settings), statefulset(owner, spec, budget, settings, _hash(spec.offload.backend)),
                pdb(owner, settings)]
    cm = configmap(owner, spec, budget, settings)
    policy = network_policy(_meta(names(owner.name)["networkpolicy"], owner, settings), spec, settings,
                            selector_labels(owner), HTTP_PORT)
    return [cm, *services(owner, spec, settings), statefulset(owner, spec, budget, settings, _hash(cm["data"])),
            pdb(owner, settings), *([policy] if policy else [])]
