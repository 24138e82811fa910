"""What makes a serving pod acceptable to Pod Security "restricted", and its pod-local storage.

Every pod runs as a fixed non-root user with a RuntimeDefault seccomp profile, no capabilities and
no privilege escalation. The vLLM container's root file system is read-only: everything the engine
writes goes to a volume sized by the Budget (planning.sizing.WeightBudget) and counted in its
ephemeral-storage request:
- HF_HOME (/models): the weights, an emptyDir unless a PVC holds them (spec.model.cache). An
  emptyDir outlives container restarts, so a crash does not download the weights again.
- HOME: vLLM/torch.compile, Triton, FlashInfer and numba caches (XDG_CACHE_HOME is below it).
- /tmp.

A pod with a hostPath disk tier is refused at "baseline" and "restricted" whatever its security
context (hostPath volumes are "privileged"-only). Its init container (the operator's image, `kvoffload
prepare-disk-tier`) runs as root with only CHOWN, DAC_OVERRIDE and FOWNER to create, mark and empty the pod's
node directory and hand it to the serving user: kubelet creates its parents root-owned, and the engine does not
run as root.
"""

from __future__ import annotations

from typing import Any

from ..api.quantity import format_bytes
from ..api.spec import Spec
from ..planning.sizing import Budget

# The serving user. vLLM images define no user of their own (they run as root); any non-root UID
# works once HOME and the caches are on volumes. 1000 is the first regular user on Debian/Ubuntu
# images; fsGroup makes every volume that supports it writable for this group.
SERVING_UID = 1000
SERVING_GID = 1000
MODELS_DIR = "/models"
HOME_DIR = "/home/vllm"
TMP_DIR = "/tmp"
# Capabilities the hostPath init container needs: chown the directory kubelet created as root
# (CHOWN) and empty it whatever its files' owners (DAC_OVERRIDE, FOWNER).
HOSTPATH_INIT_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER"]
# PerNode's shared /dev/shm directory: hand it to the serving user (CHOWN), and set its mode again once it is no
# longer root's (FOWNER: a later pod's init step finds it owned by UID 1000).
SHM_INIT_CAPS = ["CHOWN", "FOWNER"]


def restricted(**extra: Any) -> dict[str, Any]:
    """A fresh container security context that Pod Security "restricted" admits.

    Fresh: children share no mutable parts."""
    return {"allowPrivilegeEscalation": False, "privileged": False, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}, **extra}


def pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": SERVING_UID, "runAsGroup": SERVING_GID, "fsGroup": SERVING_GID,
            # A large model-cache PVC is re-owned only when its root is not ours yet, not file by file at every start.
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"}}


def vllm_security_context() -> dict[str, Any]:
    return restricted(readOnlyRootFilesystem=True, runAsNonRoot=True, runAsUser=SERVING_UID, runAsGroup=SERVING_GID)


def sidecar_security_context() -> dict[str, Any]:
    """A backend's sidecar (the LMCache server): the serving user (the pod's), read-only root; it writes
    only to the pod's volumes (its /tmp: tmp_mount)."""
    return restricted(readOnlyRootFilesystem=True)


def uses_host_path(spec: Spec) -> bool:
    return bool(spec.offload.disk and spec.offload.disk.path)


def disk_init_security_context(spec: Spec) -> dict[str, Any]:
    if uses_host_path(spec):
        return {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
                "runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0,
                "capabilities": {"drop": ["ALL"], "add": list(HOSTPATH_INIT_CAPS)},
                "seccompProfile": {"type": "RuntimeDefault"}}
    return restricted(readOnlyRootFilesystem=True, runAsNonRoot=True, runAsUser=SERVING_UID, runAsGroup=SERVING_GID)


def shm_init_security_context() -> dict[str, Any]:
    """PerNode's shared /dev/shm directory: kubelet makes it root-owned; this init step, root with CHOWN and FOWNER
    only, hands it to the serving user (the server and vLLM both run as it)."""
    return {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0,
            "capabilities": {"drop": ["ALL"], "add": list(SHM_INIT_CAPS)}, "seccompProfile": {"type": "RuntimeDefault"}}


def engine_env(spec: Spec) -> list[dict[str, Any]]:
    """Where the engine writes: every path on a volume, none on the read-only root file system."""
    return [{"name": "HOME", "value": HOME_DIR},
            # getpass.getuser() (torch's cache paths) needs a name without /etc/passwd
            {"name": "USER", "value": "vllm"},
            {"name": "XDG_CACHE_HOME", "value": f"{HOME_DIR}/.cache"},
            {"name": "XDG_CONFIG_HOME", "value": f"{HOME_DIR}/.config"},
            {"name": "HF_HOME", "value": MODELS_DIR},
            {"name": "TMPDIR", "value": TMP_DIR}]


def tmp_mount() -> dict[str, Any]:
    """The pod's /tmp (an emptyDir of the Budget's size), shared by the engine and its sidecars."""
    return {"name": "tmp", "mountPath": TMP_DIR}


def engine_mounts(spec: Spec) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [{"name": "home", "mountPath": HOME_DIR}, tmp_mount()]
    if spec.model.cache_claim:
        mounts.append({"name": "model-cache", "mountPath": MODELS_DIR,
                       **({"readOnly": True} if spec.model.cache_read_only else {})})
    else:
        mounts.append({"name": "models", "mountPath": MODELS_DIR})
    return mounts


def engine_volumes(spec: Spec, budget: Budget) -> list[dict[str, Any]]:
    w = budget.weights
    volumes: list[dict[str, Any]] = [
        {"name": "home", "emptyDir": {"sizeLimit": format_bytes(w.storage("compile_cache"))}},
        {"name": "tmp", "emptyDir": {"sizeLimit": format_bytes(w.storage("tmp"))}},
    ]
    if spec.model.cache_claim:
        claim = {"claimName": spec.model.cache_claim, **({"readOnly": True} if spec.model.cache_read_only else {})}
        volumes.append({"name": "model-cache", "persistentVolumeClaim": claim})
    else:
        volumes.append({"name": "models", "emptyDir": {"sizeLimit": format_bytes(w.volume)}})
    return volumes


def ephemeral_storage(budget: Budget) -> str:
    return format_bytes(budget.weights.ephemeral_storage)
