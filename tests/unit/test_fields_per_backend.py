"""Every spec field takes effect on every backend, or is refused there (issue 27: spec.networkPolicy rendered
nothing for lmcache-server and vllm-native while ConfigValid said the spec was valid).

For each (backend, field) the field is set to a value other than its default on a spec that is valid for
that backend, and the operator's output must move: the children it applies, the status it writes, the
node disk cleaner's verdict (the one reader of reclaimPolicy), or its verdict on the spec (a field that
only bounds another, like attentionHeads for tensorParallelSize). A field refused on one backend and
taken by another is refused naming the field (or the object holding it) and the backend."""

from __future__ import annotations

import pytest

from kvoffload import backends
from kvoffload.api import crd
from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings
from kvoffload.controller import conditions, pipeline
from kvoffload.node import disk_cleaner, owner_marker
from kvtest.specs import PAIR, spec

NO_DISK = {"offload__disk": None}
SCALED = {"autoscaling__maxReplicas": 4, "autoscaling__targets__waitingRequestsPerReplica": 4}

# field -> (what the base spec needs for the field to matter, the field's value). Every leaf of the CRD is here
# (test_every_field_is_tried), so a new field is tried on every backend from its first commit.
CUSTOM_IMAGE = {"engine__image": "registry.example/vllm-lmcache:custom", "engine__vllmVersion": "0.26.0",
                "engine__lmcacheVersion": "0.5.3"}
CASES: dict[str, tuple[dict, object]] = {
    "model.name": ({}, "Qwen/Qwen2.5-7B-Instruct"),
    "model.servedName": ({}, "chat"),
    "model.kvDtype": ({}, "fp8"),
    "model.hfTokenSecret.name": ({}, "hf"),
    "model.hfTokenSecret.key": ({"model__hfTokenSecret__name": "hf"}, "other"),
    "model.cache.claimName": ({}, "weights"),
    "model.cache.readOnly": ({"model__cache__claimName": "weights"}, True),
    "model.architecture.layers": ({}, 40),
    "model.architecture.attentionHeads": ({"engine__tensorParallelSize": 2}, 3),  # only bounds TP
    "model.architecture.kvHeads": ({}, 4),
    "model.architecture.headDim": ({}, 64),
    "model.architecture.parameters": ({}, 9_000_000_000),
    "replicas": ({}, 3),
    "engine.image": ({}, "registry.example/vllm-lmcache:custom"),
    # Versions say what an image the operator does not know holds (a known image's are its table's).
    "engine.vllmVersion": (CUSTOM_IMAGE, "0.26.1"),
    "engine.lmcacheVersion": (CUSTOM_IMAGE, "0.5.4"),
    "engine.maxModelLen": ({}, 16384),
    "engine.gpuMemoryUtilization": ({}, 0.85),
    "engine.maxNumSeqs": ({}, 64),
    "engine.tensorParallelSize": ({}, 2),
    "engine.dtype": ({}, "float16"),
    "engine.extraArgs": ({}, ["--seed", "7"]),
    "engine.env": ({}, [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]),
    "engine.apiKeySecretRef.name": ({}, "api"),
    "engine.apiKeySecretRef.key": ({"engine__apiKeySecretRef__name": "api"}, "other"),
    "offload.backend": None,  # the axis itself
    "offload.chunkSize": ({}, 512),
    "offload.server": ({}, "PerNode"),
    "offload.cpu.size": ({}, "48Gi"),
    "offload.cpu.evictionPolicy": ({}, "LFU"),
    "offload.cpu.readGbps": ({}, 5),
    "offload.disk.readGbps": ({}, 7),
    "offload.disk.path": ({}, "/mnt/nvme/other"),
    "offload.disk.storageClassName": ({}, {"storageClassName": "local-nvme", "size": "200Gi"}),  # in place of path
    "offload.disk.size": ({}, "300Gi"),
    "offload.disk.reclaimPolicy": ({}, "Retain"),
    "offload.disk.nodeSelector": ({}, {"example.com/nvme": "fast"}),
    "resources.gpuResourceName": ({}, "example.com/gpu"),
    "resources.gpuMemory": ({}, "141Gi"),
    "resources.cpu": ({}, "8"),
    "resources.memory": ({}, "200Gi"),
    "resources.engineBaseline": ({}, "6Gi"),
    "resources.perWorkerOverhead": ({}, "3Gi"),
    "resources.stagingPerWorker": ({}, "2Gi"),
    "resources.serverBaseline": ({}, "5Gi"),  # above LMCache 0.5.6's 4Gi floor (engine/images.py), so it changes it
    "resources.shm": ({}, "4Gi"),
    "resources.headroomPercent": ({}, 20),
    "scheduling.nodeSelector": ({}, {"example.com/pool": "serving"}),
    "scheduling.tolerations": ({}, [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]),
    "scheduling.affinity": ({},
                            {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "example.com/pool", "operator": "In", "values": ["serving"]}]}]}}}),
    "scheduling.priorityClassName": ({}, "serving"),
    "scheduling.topologySpreadConstraints": ({}, []),
    "metrics.enabled": ({}, False),
    "metrics.port": ({}, 9500),
    "networkPolicy.servingFrom": ({}, ["clients"]),
    "networkPolicy.metricsFrom": ({"networkPolicy__servingFrom": ["clients"]}, ["prometheus"]),
    "autoscaling.minReplicas": (SCALED, 2),
    "autoscaling.maxReplicas": (SCALED, 6),
    "autoscaling.targets.waitingRequestsPerReplica": ({**SCALED,
                                                       "autoscaling__targets__waitingRequestsPerReplica": None,
                                                       "autoscaling__targets__kvCacheUsagePercent": 80}, 4),
    "autoscaling.targets.kvCacheUsagePercent": (SCALED, 80),
    "autoscaling.targets.queueTimeP90Milliseconds": (SCALED, 500),
    "autoscaling.scaleUpPeriodSeconds": (SCALED, 60),
    "autoscaling.scaleDownWindowSeconds": (SCALED, 600),
    "autoscaling.wakeQuery": ({**SCALED, "autoscaling__minReplicas": 0,
                               "autoscaling__wakeQuery": "sum(a{namespace=\"team-a\"})"},
                              "sum(b{namespace=\"team-a\"})"),
    "routing.enabled": ({"routing__replicas": 1}, False),
    "routing.policy": ({"routing__enabled": True}, "round_robin"),
    "routing.replicas": ({"routing__enabled": True}, 2),
}
# spec.autoscaling is rendered with the operator setting autoscaler keda (scale to zero needs it).
MIRRORS = ("registry.example/*",)  # the admin allows the mirror spec.engine.image is tried with
SHM_ROOT = "/run/kvoffload-shm"  # the admin's tmpfs root for spec.offload.server PerNode
KEDA = Settings(autoscaler="keda", prometheus_address="http://prometheus.monitoring.svc:9090", allowed_images=MIRRORS,
                shared_memory_root=SHM_ROOT)


def base(backend: str, **patch) -> dict:
    return spec(**{"offload__backend": backend, **PAIR, **(NO_DISK if not backends.get(backend).disk_tier else {}),
                   **patch})


def output(s: dict) -> object:
    """What the operator does with spec `s`: the children it applies, the status it writes (nothing observed
    yet) and the node disk cleaner's verdict once the resource is gone; or the ConfigError it refuses it with."""
    try:
        d = pipeline.desired("svc", "team-a", "uid-1", s, KEDA if s.get("autoscaling")
                             else Settings(allowed_images=MIRRORS, shared_memory_root=SHM_ROOT))
    except ConfigError as err:
        return err
    body = {"metadata": {"name": "svc", "namespace": "team-a", "generation": 1}, "spec": s}
    status = conditions.status(body, d, None, conditions.Observed(None, []))
    for c in status["conditions"]:
        c.pop("lastTransitionTime", None)
    # deleted: its pod directory's owner marker names uid-1, and the watch's DELETED event recorded its final policy
    owner = owner_marker.Owner("team-a", "svc", "svc-0", "uid-1")
    cleaner = disk_cleaner.decide(owner, ("team-a", "svc"), {}, {"uid-1": disk_cleaner.policy_of({"spec": s})})
    return d.children, status, cleaner


def test_every_field_is_tried():
    assert set(CASES) == crd.leaf_paths()


def _at(err: ConfigError, path: str) -> bool:
    field = err.field.removeprefix("spec.")
    return path == field or path.startswith(field + ".")


def _tried(backend: str, path: str) -> tuple[object, object]:
    needs, value = CASES[path]
    if path == "offload.disk.storageClassName":  # one of path or storageClassName: the value is the whole disk
        return output(base(backend)), output(base(backend, offload__disk=value))
    return output(base(backend, **needs)), output(base(backend, **{**needs, path.replace(".", "__"): value}))


FIELDS = sorted(p for p, case in CASES.items() if case is not None)


@pytest.mark.parametrize("backend", backends.NAMES)
@pytest.mark.parametrize("path", FIELDS)
def test_field_takes_effect_or_is_refused(backend, path):
    before, after = _tried(backend, path)
    assert not isinstance(before, ConfigError), before
    assert after != before, f"spec.{path} = {CASES[path][1]!r} changes nothing with spec.offload.backend {backend}"
    if isinstance(after, ConfigError) and _at(after, path):
        taken = [b for b in backends.NAMES if not isinstance(_tried(b, path)[1], ConfigError)]
        if taken:  # refused here only: say which backend cannot, and why
            assert backend in after.message, after


@pytest.mark.parametrize("path", FIELDS)
def test_each_value_tried_is_valid_somewhere(path):
    """So that a refusal above is the backend's, not a bad value in CASES."""
    verdicts = [_tried(b, path)[1] for b in backends.NAMES]
    assert any(not isinstance(v, ConfigError) or not _at(v, path) for v in verdicts), verdicts


@pytest.mark.parametrize("backend", backends.NAMES)
def test_network_policy_on_every_backend(backend):
    """The failure the property test found: a NetworkPolicy for the two backends without an LMCache config."""
    d = pipeline.desired("svc", "team-a", "uid-1", base(backend, networkPolicy__servingFrom=["clients"]),
                         Settings(allowed_images=MIRRORS))
    policy = next(c for c in d.children if c["kind"] == "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"kvoffload.io/serve": "svc"}
    assert [r["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] for r in policy["spec"]["ingress"]] == [
        ["clients"], ["monitoring"]]
