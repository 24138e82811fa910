"""render: (KVOffloadServe metadata, Spec, Budget, Settings) -> the children, as plain dicts.

The same children for every backend: this module builds the generic pod and children, and the
backend (backends/, spec.offload.backend) adds its fragments: vLLM flags and environment, its config
child, its sidecars, the exporter's flags. Pure and deterministic: the same input always gives
byte-identical manifests, so golden files, `kvoffload render` and the reconciler agree, and a no-op
reconcile writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from .. import backends
from ..api import crd
from ..api.errors import ConfigError
from ..api.managed import SERVER_ZMQ_PORT
from ..api.quantity import format_bytes
from ..api.settings import Settings
from ..api.spec import Spec
from ..backends.base import (
    CONFIG_DIR,
    CONFIG_VOLUME,
    DISK_DIR,
    HTTP_PORT,
    MULTIPROC_DIR,
    NODE_NAME_ENV,
    Backend,
    Sidecar,
    field_env,
)
from ..engine import images
from ..engine import versions as engine_versions
from ..planning.sizing import Budget
from . import autoscaling, disk_tier, pod_security, routing, shared_cache
from .network_policy import network_policy
from .placement import topology_spread

MODELS_DIR = pod_security.MODELS_DIR
# The vLLM container's command: empty the multiprocess dir at EVERY start of the container (it is an
# emptyDir that outlives a crashed vLLM, and prometheus_client would add a dead process's files to
# the new one's), then exec vLLM. sh -c SCRIPT vllm serve ARGS... runs with $0=vllm, $@=serve ARGS,
# so the args stay exactly vLLM's and the vLLM argv is `vllm_argv(container)`: command[3:] + args.
# A failed emptying is reported and does not keep vLLM from starting.
VLLM_PRELUDE = 'find "$PROMETHEUS_MULTIPROC_DIR" -mindepth 1 -delete; exec "$0" "$@"'
VLLM_COMMAND = ["/bin/sh", "-c", VLLM_PRELUDE, "vllm", "serve"]
OWNER_LABEL = "kvoffload.io/serve"
CONFIG_HASH_ANNOTATION = "kvoffload.io/config-hash"
KV_DTYPE_FLAG = {"bf16": "bfloat16", "fp8": "fp8"}
# Kinds the operator owns, in apply order (config before the pods that mount it).
CHILD_KINDS = (("v1", "ConfigMap"), ("v1", "Service"), *routing.KINDS[:3], ("apps/v1", "StatefulSet"), routing.KINDS[3],
               ("policy/v1", "PodDisruptionBudget"), ("networking.k8s.io/v1", "NetworkPolicy"), autoscaling.HPA)


def child_kinds(settings: Settings) -> tuple[tuple[str, str], ...]:
    """The kinds the operator owns with these settings: KEDA's ScaledObject only where the cluster has KEDA
    (auto with a prometheusAddress may pick KEDA: handlers.watch_optional_kinds watches it where served)."""
    maybe_keda = settings.autoscaler == "keda" or (settings.autoscaler == "auto" and bool(settings.prometheus_address))
    return CHILD_KINDS + ((autoscaling.SCALED_OBJECT,) if maybe_keda else ())


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str = ""  # empty in offline rendering: no ownerReferences then


def names(owner_name: str) -> dict[str, str]:
    return {"statefulset": owner_name, "configmap": f"{owner_name}-lmcache", "service": owner_name,
            "headless": f"{owner_name}-pods", "pdb": owner_name, "networkpolicy": owner_name, "autoscaler": owner_name,
            "router": routing.name(owner_name)}


def selector_labels(owner: Owner) -> dict[str, str]:
    return {OWNER_LABEL: owner.name}


def serving_labels(owner: Owner) -> dict[str, str]:
    """Exactly this resource's serving pods (what the router discovers)."""
    return {**selector_labels(owner), "app.kubernetes.io/component": "serving"}


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


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def configmap(owner: Owner, files: dict[str, str], settings: Settings) -> dict[str, Any]:
    """The backend's config child (Backend.config_files), mounted at CONFIG_DIR."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(names(owner.name)["configmap"], owner, settings),
            "data": files}


def _config_mount() -> dict[str, Any]:
    return {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True}


def _vllm_args(spec: Spec, budget: Budget, backend: Backend) -> list[str]:
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
    return args + [*backend.vllm_args(spec, budget), *routing.kv_events_args(spec, budget), *e.extra_args]


def _telemetry_off_env() -> list[dict[str, Any]]:
    # In every container that runs vLLM or LMCache code (the vllm container, the lmcache-server sidecar).
    return [{"name": k, "value": v} for k, v in sorted(images.telemetry_off_env().items())]


def _pod_env() -> list[dict[str, Any]]:
    return [field_env("POD_NAME", "metadata.name"), field_env("POD_NAMESPACE", "metadata.namespace")]


def _vllm_env(spec: Spec, settings: Settings, backend: Backend) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        *backend.vllm_env_head(spec),
        {"name": "PYTHONHASHSEED", "value": settings.python_hash_seed},
        {"name": "PROMETHEUS_MULTIPROC_DIR", "value": MULTIPROC_DIR},
        *_pod_env(),
        *backend.vllm_env(spec),
    ]
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
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


_restricted = pod_security.restricted


def _vllm_container(owner: Owner, spec: Spec, budget: Budget, settings: Settings, backend: Backend,
                    config: bool) -> dict[str, Any]:
    tp = str(spec.engine.tensor_parallel_size)
    request, limit = format_bytes(budget.memory_request), format_bytes(budget.memory_limit)
    mounts = [*([_config_mount()] if config else []),
              shared_cache.shm_mount(owner.name) if spec.offload.shared else {"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "prometheus-multiproc", "mountPath": MULTIPROC_DIR}]
    if spec.offload.disk and backend.in_process:
        mounts.append(_disk_mount(owner, spec, read_only=False))
    mounts += pod_security.engine_mounts(spec)
    return {
        "name": "vllm",
        "image": spec.engine.image,
        "command": list(VLLM_COMMAND),
        "args": _vllm_args(spec, budget, backend),
        "env": _vllm_env(spec, settings, backend),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": spec.resources.cpu, "memory": request, spec.resources.gpu_resource_name: tp,
                         "ephemeral-storage": pod_security.ephemeral_storage(budget)},
            "limits": {"memory": limit, spec.resources.gpu_resource_name: tp},
        },
        "volumeMounts": mounts,
        # Downloading and loading weights: the Budget's start-up seconds before liveness applies.
        "startupProbe": _probe("/health", "http", 10, budget.weights.startup_seconds // 10),
        "readinessProbe": _probe("/health", "http", 5, 3),
        "livenessProbe": _probe("/health", "http", 10, 6),
        "securityContext": pod_security.vllm_security_context(),
    }


def exec_argv(container: dict[str, Any]) -> list[str]:
    """The argv a container finally execs: past a `/bin/sh -c PRELUDE` whose prelude ends in `exec "$0" "$@"` (the
    vLLM container's, the LMCache server's), else its command and args."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv[:2] == ["/bin/sh", "-c"] and len(argv) > 3 and argv[2].endswith('exec "$0" "$@"'):
        return argv[3:]
    return argv


def vllm_argv(container: dict[str, Any]) -> list[str]:
    """The argv the vLLM container finally execs (`vllm serve MODEL ...`), without the prelude."""
    if container["command"][:3] != VLLM_COMMAND[:3]:
        raise ValueError(f"container {container.get('name')!r} was not rendered with VLLM_COMMAND")
    return exec_argv(container)


# Where the hostPath init container sees <root>/<rel>/<namespace>/<name>, the parent of the pod's directory.
DISK_PARENT_DIR = "/var/run/kvoffload/disk-parent"
TERMINATION_LOG = "/dev/termination-log"  # kubelet's default terminationMessagePath
DISK_INIT = "prepare-disk-tier"  # the disk tier's init container (and the `kvoffload` sub-command it runs)


POD_DIR = "$(POD_NAME)"  # a serving pod's own directory below <root>/<rel>/<namespace>/<name>


def _disk_sub_path(owner: Owner, spec: Spec, *, pod: str | None = POD_DIR) -> str:
    """Everything below the admin's root: the tenant's part of the path, then namespace/name(/pod). kubelet
    opens each of these components with O_NOFOLLOW and refuses one that leaves the volume (the root)."""
    assert spec.offload.disk is not None
    tail = f"$(POD_NAMESPACE)/{owner.name}" + (f"/{pod}" if pod else "")
    return f"{spec.offload.disk.below_root}/{tail}"


def _disk_mount(owner: Owner, spec: Spec, *, read_only: bool, pod: str = POD_DIR) -> dict[str, Any]:
    # readOnly is omitempty in the API: only ever write `true`, or the live object never matches.
    mount: dict[str, Any] = {"name": "kv-disk", "mountPath": DISK_DIR, **({"readOnly": True} if read_only else {})}
    if spec.offload.disk and spec.offload.disk.path:
        # Each pod gets <root>/<rel>/<namespace>/<name>/<pod>; kubelet refuses a subPath that escapes the volume.
        mount["subPathExpr"] = _disk_sub_path(owner, spec, pod=pod)
    return mount


def _disk_init_container(owner: Owner, spec: Spec, budget: Budget, settings: Settings,
                         backend: Backend, pod: str = POD_DIR) -> dict[str, Any]:
    # LMCache's in-process disk tier starts with an empty index and never counts old files: its directory is
    # emptied first or the disk fills past its budget after every restart. A backend whose engine reads its old
    # files again keeps them while the fingerprint holds (rendering/disk_tier.py). The operator's own image (it
    # carries `kvoffload`), never the tenant's: this container is the only one that runs as root.
    if pod_security.uses_host_path(spec):
        args = ["prepare-disk-tier", "--parent", DISK_PARENT_DIR, "--namespace", "$(POD_NAMESPACE)",
                "--name", owner.name, "--pod", pod, *(["--owner-uid", owner.uid] if owner.uid else []),
                "--chown", f"{pod_security.SERVING_UID}:{pod_security.SERVING_GID}"]
        reuse, fp = disk_tier.reusable(spec, budget, backend), disk_tier.fingerprint(spec, budget, settings, backend)
        if reuse is not None and fp is not None:
            args += ["--fingerprint", disk_tier.encode(fp), "--keep-bytes", str(reuse.keep_bytes)]
        mount = {"name": "kv-disk", "mountPath": DISK_PARENT_DIR, "subPathExpr": _disk_sub_path(owner, spec, pod=None)}
    else:
        args, mount = ["prepare-disk-tier", "--dir", DISK_DIR], _disk_mount(owner, spec, read_only=False, pod=pod)
    # Kept or emptied, and why: kubelet copies this file into the pod's status, which the operator reads
    # (controller/conditions.py, DiskTierReady).
    args += ["--report", TERMINATION_LOG]
    return {
        "name": DISK_INIT,
        "image": settings.kvoffload_image,
        "imagePullPolicy": settings.exporter_image_pull_policy,
        "command": ["kvoffload"],
        "args": args,
        "env": _pod_env(),
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
        "volumeMounts": [mount],
        "securityContext": pod_security.disk_init_security_context(spec),
    }


def _sidecars(owner: Owner, spec: Spec, budget: Budget, backend: Backend) -> list[dict[str, Any]]:
    pod = Sidecar(image=spec.engine.image, env=[*_pod_env(), *_telemetry_off_env()],
                  disk_mount=_disk_mount(owner, spec, read_only=False) if spec.offload.disk else None,
                  tmp_mount=pod_security.tmp_mount(), security_context=pod_security.sidecar_security_context())
    return backend.sidecars(spec, budget, pod)


SHM_INIT = "prepare-shared-memory"  # PerNode: the init step that hands the shared /dev/shm directory to UID 1000
WAIT_INIT = "wait-for-shared-cache"  # PerNode: the serving pod's init step that waits for its node's server


def _operator_step(name: str, args: list[str], settings: Settings, security: dict[str, Any],
                   mounts: list[dict[str, Any]] | None = None,
                   env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An init step that runs the operator's own image (`kvoffload <name> ARGS`), never the tenant's."""
    return {
        "name": name,
        "image": settings.kvoffload_image,
        "imagePullPolicy": settings.exporter_image_pull_policy,
        "command": ["kvoffload"],
        "args": [name, *args],
        **({"env": env} if env else {}),
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
        **({"volumeMounts": mounts} if mounts else {}),
        "securityContext": security,
    }


def _shm_init_container(owner: Owner, settings: Settings) -> dict[str, Any]:
    # kubelet creates <root>/<namespace>/<name> root-owned (the root's mode) for whichever pod of the node mounts it
    # first; the server and vLLM run as the serving user. As root with CHOWN and FOWNER only; it sees the resource's
    # own directory, never the root.
    return _operator_step(SHM_INIT, ["--dir", shared_cache.SHM_MOUNT_PATH,
                                     "--chown", f"{pod_security.SERVING_UID}:{pod_security.SERVING_GID}"],
                          settings, pod_security.shm_init_security_context(), [shared_cache.shm_mount(owner.name)],
                          _pod_env())


def _wait_for_server(spec: Spec, settings: Settings) -> dict[str, Any]:
    # vLLM's LMCacheMPConnector asks the server its chunk size when vLLM starts and fails the start when no answer
    # comes within lmcache.mp.mq_timeout (LMCache 0.5.3 vllm_multi_process_adapter.py); after that it runs degraded
    # without one. So a replica waits here for its node's server (the operator creates it once the replica is bound
    # to the node) instead of crash-looping; kubelet restarts this step when it gives up.
    return _operator_step(WAIT_INIT, ["--address", f"{spec.offload.shared_address}:{SERVER_ZMQ_PORT}"], settings,
                          _restricted(readOnlyRootFilesystem=True, runAsNonRoot=True, runAsUser=65532,
                                      runAsGroup=65532))


def shared_server_pod(owner: Owner, spec: Spec, budget: Budget, settings: Settings) -> dict[str, Any]:
    """The pod of a node's shared LMCache server (PerNode; rendering/shared_cache.py pins it to the node): the
    backend's server container, the serving pods' /dev/shm directory, and the L2 in the server's own directory beside
    its replicas' (<root>/<rel>/<namespace>/<name>/<name>-cache), kept or emptied by the disk fingerprint as a
    serving pod's is. Non-root, read-only root, no capabilities; only the init steps run as root."""
    backend = backends.get(spec.offload.backend)
    here = shared_cache.server_dir(owner.name)
    disk = spec.offload.disk is not None
    parts = Sidecar(image=spec.engine.image, env=[*_pod_env(), *_telemetry_off_env()],
                    disk_mount=_disk_mount(owner, spec, read_only=False, pod=here) if disk else None,
                    tmp_mount=pod_security.tmp_mount(), security_context=pod_security.sidecar_security_context(),
                    shm_mount=shared_cache.shm_mount(owner.name))
    init = [_shm_init_container(owner, settings),
            *([_disk_init_container(owner, spec, budget, settings, backend, pod=here)] if disk else [])]
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": pod_security.pod_security_context(),
        "initContainers": init,
        "containers": backend.shared_server(spec, budget, parts),
        "volumes": [shared_cache.shm_volume(spec), {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
                    *(_disk_volume(owner, spec, budget) if disk else [])],
    }
    if spec.scheduling.tolerations:  # the node's taints that its replicas tolerate
        pod["tolerations"] = [dict(t) for t in spec.scheduling.tolerations]
    if spec.scheduling.priority_class_name:
        pod["priorityClassName"] = spec.scheduling.priority_class_name
    return pod


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


def _exporter_container(owner: Owner, spec: Spec, budget: Budget, settings: Settings, backend: Backend,
                        config: bool) -> dict[str, Any]:
    args = ["exporter",
            "--listen", f"$(POD_IP):{spec.metrics_port}",  # the pod IP only, not every interface
            "--vllm-metrics-url", f"http://127.0.0.1:{HTTP_PORT}/metrics",
            *backend.exporter_args(spec, budget)]
    mounts = [*([_config_mount()] if config else []),
              {"name": "prometheus-multiproc", "mountPath": MULTIPROC_DIR, "readOnly": True},
              {"name": "engine-info", "mountPath": engine_versions.ENGINE_DIR, "readOnly": True}]
    args += ["--tensor-parallel-size", str(spec.engine.tensor_parallel_size),
             "--kv-bytes-per-token", str(budget.kv_bytes_per_token),
             "--engine-versions-file", engine_versions.VERSIONS_FILE]
    if _pod_disk(spec):
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
        "env": [field_env("POD_IP", "status.podIP"),
                # PerNode: the node the shared server's figures are labelled with (Backend.exporter_args).
                *([field_env(NODE_NAME_ENV, "spec.nodeName")] if spec.offload.shared else []),
                *([field_env("POD_NAME", "metadata.name"), field_env("POD_NAMESPACE", "metadata.namespace")]
                  if _pod_disk(spec) and spec.offload.disk and spec.offload.disk.path else [])],
        "ports": [{"name": "metrics", "containerPort": spec.metrics_port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
        "volumeMounts": mounts,
        "livenessProbe": _probe("/healthz", "metrics", 20, 3),
        "securityContext": _restricted(readOnlyRootFilesystem=True, runAsNonRoot=True, runAsUser=65532,
                                       runAsGroup=65532),
    }


def _pod_disk(spec: Spec) -> bool:
    """The serving pod holds the disk tier: always, but with a shared server (PerNode), whose pod holds it."""
    return spec.offload.disk is not None and not spec.offload.shared


def _disk_volume(owner: Owner, spec: Spec, budget: Budget) -> list[dict[str, Any]]:
    disk = spec.offload.disk
    if disk and disk.path:
        # Exactly the admin's root, which must exist (Directory): a missing root means the NVMe is not mounted,
        # and DirectoryOrCreate would put the cache on the node's root file system instead.
        return [{"name": "kv-disk", "hostPath": {"path": disk.root, "type": "Directory"}}]
    if disk:
        return [{"name": "kv-disk", "ephemeral": {"volumeClaimTemplate": {
            "metadata": {"labels": selector_labels(owner)},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": disk.storage_class,
                     "resources": {"requests": {"storage": format_bytes(budget.tier("disk").bytes)}}}}}}]
    return []


def _volumes(owner: Owner, spec: Spec, budget: Budget, config: bool) -> list[dict[str, Any]]:
    shm = (shared_cache.shm_volume(spec) if spec.offload.shared else
           {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": format_bytes(budget.shm)}})
    volumes: list[dict[str, Any]] = [
        *([{"name": CONFIG_VOLUME, "configMap": {"name": names(owner.name)["configmap"]}}] if config else []),
        shm,
        {"name": "prometheus-multiproc", "emptyDir": {"sizeLimit": "256Mi"}},
    ]
    if spec.metrics_enabled:
        volumes.append({"name": "engine-info", "emptyDir": {"sizeLimit": "1Mi"}})
    if _pod_disk(spec):
        volumes += _disk_volume(owner, spec, budget)
    return volumes + pod_security.engine_volumes(spec, budget)


def statefulset(owner: Owner, spec: Spec, budget: Budget, settings: Settings, config_hash: str, *,
                config: bool) -> dict[str, Any]:
    """`config`: the backend has a config child (mounted in the vllm and exporter containers)."""
    backend = backends.get(spec.offload.backend)
    containers = [_vllm_container(owner, spec, budget, settings, backend, config)]
    if spec.metrics_enabled:
        containers.append(_exporter_container(owner, spec, budget, settings, backend, config))
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # vLLM never talks to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": pod_security.pod_security_context(),
        "containers": containers,
        "volumes": _volumes(owner, spec, budget, config),
    }
    init = ([_disk_init_container(owner, spec, budget, settings, backend)] if _pod_disk(spec) else []) + (
        [_shm_init_container(owner, settings), _wait_for_server(spec, settings)] if spec.offload.shared else []) + (
        [_versions_init_container(spec)] if spec.metrics_enabled else []) + _sidecars(owner, spec, budget, backend)
    if init:
        pod["initContainers"] = init
    node_selector = {**spec.scheduling.node_selector, **(spec.offload.disk.node_selector if spec.offload.disk else {})}
    if node_selector:
        pod["nodeSelector"] = dict(sorted(node_selector.items()))
    if spec.scheduling.tolerations:
        pod["tolerations"] = [dict(t) for t in spec.scheduling.tolerations]
    # PerNode: new replicas prefer nodes where the resource's server runs, and start warm there (docs/autoscaling.md).
    affinity = (shared_cache.with_warm_start(owner.name, spec.scheduling.affinity) if spec.offload.shared
                else spec.scheduling.affinity)
    if affinity:
        pod["affinity"] = affinity
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
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(names(owner.name)["pdb"], owner, settings),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner)}}}


def endpoint(owner: Owner, spec: Spec | None = None) -> str:
    """The in-cluster URL clients call: the router's with spec.routing, else the serving Service's."""
    if spec is not None and spec.routing is not None:
        return routing.endpoint(owner.name, owner.namespace)
    return f"http://{names(owner.name)['service']}.{owner.namespace}.svc:{HTTP_PORT}/v1"


def check_name(name: str) -> None:
    """Children are <name>, <name>-lmcache, <name>-pods and pods <name>-<ordinal>; Services need DNS-1035 labels."""
    if not isinstance(name, str) or len(name) > crd.MAX_NAME or not re.fullmatch(crd.NAME_PATTERN.strip("^$"), name):
        raise ConfigError("metadata.name", f"{name!r} must be a DNS-1035 label (a-z, 0-9, '-', starting with a letter) "
                                           f"of at most {crd.MAX_NAME} characters so child and pod names fit in 63")


def children(owner: Owner, spec: Spec, budget: Budget, settings: Settings,
             workers: tuple[str, ...] = (), nodes: tuple[shared_cache.Node, ...] = (),
             address: str = "") -> list[dict[str, Any]]:
    """Every child, in apply order (owner.name passed check_name: pipeline.desired checks it first), for every
    backend: the generic ones, plus the backend's config child and its fragments of the pod. `spec` has its routing
    policy resolved (routing.resolve); `workers` are the Ready serving pods' IPs (routing.workers). PerNode: `nodes`
    get a shared server (shared_cache.nodes), which the replicas reach at `address` (its Service's ClusterIP; empty:
    its DNS name)."""
    backend = backends.get(spec.offload.backend)
    spec = shared_cache.with_address(spec, owner.name, owner.namespace, address)
    shared = shared_cache.children(
        lambda name: _meta(name, owner, settings), owner.name, serving_labels(owner),
        {k: v for k, v in labels(owner, settings).items() if k != OWNER_LABEL}, nodes,
        lambda: shared_server_pod(owner, spec, budget, settings)) if spec.offload.shared else []
    files = backend.config_files(spec, budget)  # None: the backend's flags say it all
    config = [configmap(owner, files, settings)] if files is not None else []
    # The pods roll when the config changes (or the backend does). PerNode: also when the chunk size does, which vLLM's
    # connector reads from its node's server once, at start (a server replaced with another keeps its replicas).
    engines_read = files if files is not None else backend.name
    sts = statefulset(owner, spec, budget, settings,
                      _hash([engines_read, spec.offload.chunk_size] if spec.offload.shared else engines_read),
                      config=bool(config))
    policy = network_policy(_meta(names(owner.name)["networkpolicy"], owner, settings), spec, settings,
                            selector_labels(owner), HTTP_PORT,
                            {routing.ROUTER_LABEL: owner.name} if spec.routing is not None else None,
                            routing.event_ports(spec))
    scaler = autoscaling.autoscaler(_meta(names(owner.name)["autoscaler"], owner, settings), owner.name,
                                    owner.namespace,
                                    spec, budget, settings)
    rbac, router = routing.children(lambda: _meta(names(owner.name)["router"], owner, settings), owner.name,
                                    owner.namespace,
                                    spec, serving_labels(owner), budget, settings, workers)
    # The shared servers before the StatefulSet: a replica's vLLM waits for its node's server.
    return [*config, *services(owner, spec, settings), *shared, *rbac, *router[:1], sts, *router[1:],
            pdb(owner, settings),
            *([policy] if policy else []), *([scaler] if scaler else [])]
