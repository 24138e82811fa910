"""Each validation rule is declared once (kvoffload.api.rules) and gives the CRD's CEL rule and the parser's check with
one message; what the operator decides in the pod (api/managed.py) the spec may not override."""

from __future__ import annotations

import pytest

from kvoffload.api import crd, managed, rules
from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings
from kvoffload.api.spec import parse
from kvoffload.controller import pipeline
from kvtest.specs import spec

S = Settings()
BACKENDS = crd.schema_at("offload.backend")["enum"]


def _for(backend: str, **patch):
    return spec(offload__backend=backend, **({"offload__disk": None} if backend == "vllm-native" else {}), **patch)


def _pod(s: dict) -> dict:
    d = pipeline.desired("svc", "ns", "uid", s, S)
    return next(c for c in d.children if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]


def test_every_rule_sits_on_its_schema_node():
    for rule in rules.RULES:
        node = crd.spec_schema() if rule.at == "spec" else crd.schema_at(rule.at.removeprefix("spec."))
        assert rule.cel_dict() in node["x-kubernetes-validations"], rule.at


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"])
def test_env_may_not_change_which_gpus_the_container_sees(name):
    with pytest.raises(ConfigError) as err:
        parse(spec(engine__env=[{"name": name, "value": "all"}]), S)
    assert err.value.field == "spec.engine.env"
    assert err.value.message == (
        f"{name} is managed by the operator: the operator decides which GPUs the container sees: the device "
        "plugin hands it the spec.resources.gpuResourceName GPUs it requested (spec.engine.tensorParallelSize), and "
        "this variable would show it others or hide its own.")
    assert rules.ENV.message_expression  # the API server names it too (proven in tests/integration/test_bad_input.py)
    assert "which GPUs the container sees" in err.value.message


@pytest.mark.parametrize("name", ["HOME", "TMPDIR", "HF_HOME", "XDG_CACHE_HOME", "TRANSFORMERS_CACHE", "HF_HUB_CACHE",
                                  "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                                  "FLASHINFER_WORKSPACE_BASE"])
def test_env_may_not_move_weights_caches_or_temporary_files(name):
    with pytest.raises(ConfigError) as err:
        parse(spec(engine__env=[{"name": name, "value": "/elsewhere"}]), S)
    assert err.value.field == "spec.engine.env" and name in err.value.message
    assert "ephemeral-storage request" in err.value.message


def test_every_refused_variable_is_named_with_its_reason():
    env = [{"name": "A", "value": "1"}, {"name": "HOME", "value": "/x"}, {"name": "LMCACHE_CHUNK_SIZE", "value": "8"}]
    with pytest.raises(ConfigError) as err:
        parse(spec(engine__env=env), S)
    # Written out, not rebuilt from managed.ENV: a reason dropped or reworded in the table must fail here.
    assert err.value.message == (
        "HOME is managed by the operator: the operator decides where the engine's weights, caches and temporary files "
        "go: on the pod's volumes, sized and counted in its ephemeral-storage request (status.budget.weights), as the "
        "root file system is read-only. LMCACHE_* configure LMCache, which the operator renders from spec.offload "
        "(put engine settings there).")


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_the_pod_sets_the_spec_may_not(backend):
    """Every variable the operator renders into the vllm container, where spec.engine.env lands (but the token it copies
    from the Secret the spec names), is refused there, on every backend."""
    pod = _pod(_for(backend, model__hfTokenSecret={"name": "hf"}))
    rendered = {e["name"] for c in pod["containers"] if c["name"] == "vllm" for e in c["env"]}
    assert rendered - {"HF_TOKEN"} and all(managed.env_why(n) for n in rendered - {"HF_TOKEN"}), \
        sorted(n for n in rendered if not managed.env_why(n))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_pods_own_ports_are_the_managed_ones(backend):
    pod = _pod(_for(backend))
    ports = {p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    ports -= {crd.default_at("metrics.port")}
    args = [c.get("args", []) for c in pod["containers"] + pod.get("initContainers", [])]
    listens = {int(a[i + 1]) for a in args for i, flag in enumerate(a[:-1]) if flag in ("--port", "--http-port")}
    assert ports | listens <= set(managed.PORTS) and ports | listens


# Written out (not read from managed.PORTS, the table the parser reads), and every managed port is in this list.
PORT_OWNERS = {
    8000: "the vllm container's port (vLLM's OpenAI API and /metrics)",
    5555: "the lmcache-server container's ZMQ port (vLLM's LMCacheMPConnector talks to it)",
    8081: "the lmcache-server container's HTTP port (/healthcheck, /status)",
}


def test_the_managed_ports_are_the_hand_listed_ones():
    assert set(managed.PORTS) == set(PORT_OWNERS)


@pytest.mark.parametrize("port", sorted(PORT_OWNERS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_metrics_port_may_not_collide(backend, port):
    with pytest.raises(ConfigError) as err:
        parse(_for(backend, metrics={"port": port}), S)
    assert err.value.field == "spec.metrics.port"
    assert err.value.message == f"{port} is {PORT_OWNERS[port]}: pick another port for the exporter"


def test_a_free_metrics_port_is_taken():
    assert parse(spec(metrics={"port": 9500}), S).metrics_port == 9500


@pytest.mark.parametrize("rule, patch", [
    (rules.KV_HEADS, {"model__architecture": {"attentionHeads": 32, "kvHeads": 3}}),
    (rules.DISK_ONE_OF, {"offload__disk__storageClassName": "nvme"}),
    (rules.NODE_SELECTORS, {"offload__disk__nodeSelector": {"a": "1"}, "scheduling": {"nodeSelector": {"a": "2"}}}),
    (rules.MEMORY_HOLDS_CPU_TIER, {"resources__memory": "8Gi"}),
])
def test_cross_field_rules_refuse_with_the_crds_message(rule, patch):
    with pytest.raises(ConfigError) as err:
        parse(spec(**patch), S)
    assert (err.value.field, err.value.message) == (rule.path, rule.message)


# The tests above build their expected messages from the tables the parser reads (managed.ENV, managed.PORTS,
# rules.*.message), so a wrong or empty entry there would pass them. The key refusals, written out by hand:
LITERAL_REFUSALS = [
    ({"engine__env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "all"}]}, "spec.engine.env",
     "CUDA_VISIBLE_DEVICES is managed by the operator: the operator decides which GPUs the container sees: the device "
     "plugin hands it the spec.resources.gpuResourceName GPUs it requested (spec.engine.tensorParallelSize), and this "
     "variable would show it others or hide its own."),
    ({"engine__env": [{"name": "A", "value": "1"}, {"name": "HOME", "value": "/x"},
                      {"name": "LMCACHE_CHUNK_SIZE", "value": "8"}]}, "spec.engine.env",
     "HOME is managed by the operator: the operator decides where the engine's weights, caches and temporary files go: "
     "on the pod's volumes, sized and counted in its ephemeral-storage request (status.budget.weights), as the root "
     "file system is read-only. LMCACHE_* configure LMCache, which the operator renders from spec.offload (put engine "
     "settings there)."),
    ({"metrics": {"port": 8000}}, "spec.metrics.port",
     "8000 is the vllm container's port (vLLM's OpenAI API and /metrics): pick another port for the exporter"),
    ({"metrics": {"port": 5555}}, "spec.metrics.port",
     "5555 is the lmcache-server container's ZMQ port (vLLM's LMCacheMPConnector talks to it): pick another port for "
     "the exporter"),
    ({"model__architecture": {"attentionHeads": 32, "kvHeads": 3}}, "spec.model.architecture.kvHeads",
     "kvHeads must divide attentionHeads"),
    ({"resources__memory": "8Gi"}, "spec.resources.memory",
     "must hold at least the CPU tier (spec.offload.cpu.size): pinned memory is allocated in full"),
    ({"offload__disk__storageClassName": "nvme"}, "spec.offload.disk",
     "set exactly one of spec.offload.disk.path (hostPath) or spec.offload.disk.storageClassName (ephemeral volume)"),
]


@pytest.mark.parametrize("patch, field, message", LITERAL_REFUSALS, ids=[field for _, field, _ in LITERAL_REFUSALS])
def test_key_refusals_read_as_written(patch, field, message):
    with pytest.raises(ConfigError) as err:
        parse(spec(**patch), S)
    assert (err.value.field, err.value.message) == (field, message)


def test_extra_args_may_not_move_the_weights():
    """--download-dir would put the weights beside the volume sized for them: refused like HF_HOME."""
    with pytest.raises(ConfigError) as err:
        parse(spec(engine__extraArgs=["--download-dir", "/tmp/w"]), S)
    assert err.value.field == "spec.engine.extraArgs" and "--download-dir" in err.value.message
    assert "--download-dir" in crd.REFUSED_FLAGS
