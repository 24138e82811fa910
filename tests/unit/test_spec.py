"""parse: defaults, and every bad input ends in a ConfigError naming the field."""

import pytest

from kvoffload.api import crd
from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings
from kvoffload.api.spec import check_disk_path, parse
from kvtest.specs import spec

S = Settings(allowed_images=("example.com/*", "x:1", "lmcache/vllm-openai:v0.5.4"))  # images the admin allows


def test_defaults_come_from_the_crd():
    s = parse(spec(), S)
    assert s.replicas == crd.default_at("replicas") == 1
    assert s.engine.gpu_memory_utilization == 0.9
    assert s.engine.tensor_parallel_size == 1
    assert s.offload.chunk_size == 256
    assert s.offload.eviction_policy == "LRU"
    assert s.offload.disk.reclaim_policy == "Delete"
    assert s.offload.disk.node_selector == {"kvoffload.io/nvme": "true"}
    assert (s.engine.image == S.default_image
            and (s.engine.vllm_version, s.engine.lmcache_version) == ("0.33.0", "0.5.6"))
    assert s.metrics_enabled and s.metrics_port == 9400


@pytest.mark.parametrize("patch, field", [
    ({"model__name": "bad name!"}, "spec.model.name"),
    ({"model__kvDtype": "int4"}, "spec.model.kvDtype"),
    ({"engine__maxModelLen": None}, "spec.engine.maxModelLen"),
    ({"engine__maxModelLen": "long"}, "spec.engine.maxModelLen"),
    ({"engine__gpuMemoryUtilization": 0}, "spec.engine.gpuMemoryUtilization"),
    ({"engine__gpuMemoryUtilization": 1.5}, "spec.engine.gpuMemoryUtilization"),
    ({"engine__tensorParallelSize": 0}, "spec.engine.tensorParallelSize"),
    ({"engine__dtype": "fp4"}, "spec.engine.dtype"),
    ({"engine__extraArgs": ["--max-model-len=9"]}, "spec.engine.extraArgs"),
    ({"engine__extraArgs": ["--kv-transfer-config", "{}"]}, "spec.engine.extraArgs"),
    ({"engine__env": [{"name": "LMCACHE_CHUNK_SIZE", "value": "1"}]}, "spec.engine.env"),
    ({"engine__env": [{"name": "PYTHONHASHSEED", "value": "1"}]}, "spec.engine.env"),
    ({"engine__image": "example.com/custom:1"}, "spec.engine.vllmVersion"),
    ({"engine__image": "example.com/custom:1", "engine__vllmVersion": "0.27.1"}, "spec.engine.lmcacheVersion"),
    ({"engine__image": "x:1", "engine__vllmVersion": "0.5.0", "engine__lmcacheVersion": "0.5.6"},
     "spec.engine.vllmVersion"),
    # LMCache's own image installs an unpinned vLLM: the spec must say which.
    ({"engine__image": "lmcache/vllm-openai:v0.5.4"}, "spec.engine.vllmVersion"),
    # No flag table for this vLLM: extra arguments cannot be checked, so they are refused.
    ({"engine__image": "lmcache/vllm-openai:v0.5.4", "engine__vllmVersion": "0.29.0",
      "engine__extraArgs": ["--enforce-eager"]},
     "spec.engine.extraArgs"),
    ({"engine__env": [{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"}]}, "spec.engine.env"),
    ({"offload__chunkSize": 0}, "spec.offload.chunkSize"),
    ({"offload__chunkSize": 100000}, "spec.offload.chunkSize"),
    ({"offload__cpu__size": None}, "spec.offload.cpu.size"),
    ({"offload__cpu__size": "-1Gi"}, "spec.offload.cpu.size"),
    ({"offload__cpu__size": "forty"}, "spec.offload.cpu.size"),
    ({"offload__cpu__size": "0"}, "spec.offload.cpu.size"),
    ({"offload__cpu__evictionPolicy": "RANDOM"}, "spec.offload.cpu.evictionPolicy"),
    ({"offload__disk__size": None}, "spec.offload.disk.size"),
    ({"offload__disk__size": "1.5.5Gi"}, "spec.offload.disk.size"),
    ({"offload__disk__path": None}, "spec.offload.disk"),
    ({"offload__disk__storageClassName": "nvme"}, "spec.offload.disk"),
    ({"offload__disk__reclaimPolicy": "Recycle"}, "spec.offload.disk.reclaimPolicy"),
    ({"offload__disk__path": "relative/dir"}, "spec.offload.disk.path"),
    ({"offload__disk__path": "/mnt/nvme/../../etc"}, "spec.offload.disk.path"),
    ({"offload__disk__path": "/mnt/nvme"}, "spec.offload.disk.path"),
    ({"offload__disk__path": "/etc/kv"}, "spec.offload.disk.path"),
    ({"offload__disk__path": "/mnt/nvmeX/kv"}, "spec.offload.disk.path"),
    ({"resources__memory": "1Gi"}, "spec.resources.memory"),
    ({"resources__cpu": "lots"}, "spec.resources.cpu"),
    ({"resources__headroomPercent": 500}, "spec.resources.headroomPercent"),
    ({"replicas": -1}, "spec.replicas"),
    ({"replicas": True}, "spec.replicas"),
    ({"metrics__port": 80}, "spec.metrics.port"),
    ({"scheduling__tolerations": "all"}, "spec.scheduling.tolerations"),
    ({"scheduling__nodeSelector": {"kvoffload.io/nvme": "false"}}, "spec.scheduling.nodeSelector"),
])
def test_bad_input_names_the_field(patch, field):
    with pytest.raises(ConfigError) as err:
        parse(spec(**patch), S)
    assert err.value.field == field, err.value


@pytest.mark.parametrize("image", [None, "lmcache/vllm-openai:v0.5.4"])
def test_model_runner_env_is_managed_on_every_pair(image):
    """The operator picks vLLM's model runner for the pair (vLLM 0.26.0's V2 runner skips LMCache's loads):
    a user value is refused on every pair, with the reason."""
    patch = {"engine__env": [{"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "1"}]}
    if image:
        patch.update(engine__image=image, engine__vllmVersion="0.27.1")
    with pytest.raises(ConfigError) as err:
        parse(spec(**patch), S)
    assert err.value.field == "spec.engine.env"
    assert "VLLM_USE_V2_MODEL_RUNNER is managed by the operator" in str(err.value)
    assert "V2 runner skips LMCache's KV loads" in str(err.value)
    assert "VLLM_USE_V2_MODEL_RUNNER" in crd.MANAGED_ENV


@pytest.mark.parametrize("name, value", [("DO_NOT_TRACK", "0"), ("VLLM_NO_USAGE_STATS", "0"), ("DO_NOT_TRACK", "1"),
                                         ("LMCACHE_TRACK_USAGE", "true")])
@pytest.mark.parametrize("backend", ["lmcache", "lmcache-server", "vllm-native"])
def test_telemetry_env_is_managed(name, value, backend):
    """The operator turns vLLM's and LMCache's usage telemetry off and it cannot be turned back on: the variables
    are refused (even a value that agrees), naming the field and the reason."""
    patch = {"engine__env": [{"name": name, "value": value}], "offload__backend": backend}
    if backend == "vllm-native":
        patch["offload__disk"] = None
    with pytest.raises(ConfigError) as err:
        parse(spec(**patch), S)
    assert err.value.field == "spec.engine.env"
    assert f"{name} is managed by the operator" in str(err.value)
    (rule,) = crd.schema_at("engine.env")["x-kubernetes-validations"]  # the API server refuses it first
    if name.startswith(crd.MANAGED_ENV_PREFIX):
        assert f"startsWith('{crd.MANAGED_ENV_PREFIX}')" in rule["rule"]
    else:
        assert "usage telemetry off" in str(err.value) and "docs/security.md" in str(err.value)
        assert f"'{name}'" in rule["rule"]
        assert ("DO_NOT_TRACK, VLLM_NO_USAGE_STATS: the operator turns vLLM's and LMCache's usage telemetry off"
                in rule["message"])


def test_vllms_own_do_not_track_stays_free():
    """VLLM_DO_NOT_TRACK and huggingface_hub's switches are not managed: VLLM_NO_USAGE_STATS=1 keeps vLLM's off
    whatever they say (tests/engine/test_telemetry.py runs that)."""
    env = [{"name": "VLLM_DO_NOT_TRACK", "value": "0"}, {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "0"}]
    assert parse(spec(engine__env=env), S).engine.env == tuple(env)


@pytest.mark.parametrize("path, ok", [
    ("/mnt/nvme/lmcache", True),
    ("/mnt/nvme/a/b/c", True),
    ("/var/lib/kvoffload/x", True),
    ("/mnt/nvme/lmcache/", True),
    ("/mnt/nvme", False),
    ("/mnt/nvme/", False),
    ("/mnt", False),
    ("/", False),
    ("mnt/nvme/x", False),
    ("/mnt/nvme/./x", False),
    ("/mnt/nvme/x/..", False),
    ("/mnt/nvme//x", False),
    ("/mnt/nvme2/x", False),
])
def test_disk_path_must_sit_strictly_below_an_allowed_root(path, ok):
    if ok:
        assert check_disk_path(path, S.allowed_disk_roots)[0] == path.rstrip("/")
    else:
        with pytest.raises(ConfigError, match="spec.offload.disk.path"):
            check_disk_path(path, S.allowed_disk_roots)


def test_the_volume_is_the_longest_allowed_root_and_the_rest_is_the_tenants():
    roots = ("/mnt/nvme", "/mnt/nvme/fast", "/var/lib/kvoffload")
    assert check_disk_path("/mnt/nvme/fast/kv/a", roots) == ("/mnt/nvme/fast/kv/a", "/mnt/nvme/fast")
    assert check_disk_path("/mnt/nvme/fastx/kv", roots) == ("/mnt/nvme/fastx/kv", "/mnt/nvme")
    disk = parse(spec(offload__disk={"path": "/mnt/nvme/lmcache/team", "size": "1Gi"}), S).offload.disk
    assert disk is not None and (disk.root, disk.below_root) == ("/mnt/nvme", "lmcache/team")


def test_no_allowed_roots_means_no_hostpath():
    with pytest.raises(ConfigError, match="no hostPath roots"):
        check_disk_path("/mnt/nvme/x", ())


def test_storage_class_is_the_hostpath_free_alternative():
    s = parse(spec(offload__disk__path=None, offload__disk__storageClassName="local-nvme"), S)
    assert s.offload.disk.storage_class == "local-nvme" and s.offload.disk.path is None
    assert s.offload.disk.node_selector == {}


@pytest.mark.parametrize("path", ["engine.maxModelLen", "engine.maxNumSeqs", "engine.tensorParallelSize",
                                  "offload.chunkSize", "replicas", "metrics.port"])
def test_integer_bounds_are_the_crd_schemas(path):
    # The bounds come from the schema here too: a test that retyped them would agree with a parser that did.
    node = crd.schema_at(path)
    lo, hi = node.get("minimum", 0), node["maximum"]
    section, _, leaf = path.rpartition(".")
    key = f"{section}__{leaf}" if section else leaf
    for bad in (lo - 1, hi + 1):
        with pytest.raises(ConfigError) as exc:
            parse(spec(**{key: bad}), S)
        assert exc.value.field == f"spec.{path}" and f"[{lo}, {hi}]" in str(exc.value)


def _too_long(path):
    return "a" * (crd.schema_at(path)["maxLength"] + 1)


def _past(path):
    return {f"k{i}": "v" for i in range(crd.schema_at(path)["maxProperties"] + 1)}


@pytest.mark.parametrize("key, bad, says", [
    # Each bad value is one past a bound read from the schema, as the parser reads it.
    ("model__name", lambda: _too_long("model.name"), "must be a Hugging Face id"),
    ("scheduling__nodeSelector", lambda: _past("scheduling.nodeSelector"),
     f"at most {crd.schema_at('scheduling.nodeSelector')['maxProperties']} entries"),
    ("scheduling__nodeSelector",
     lambda: {"k": "v" * (crd.schema_at("scheduling.nodeSelector")["additionalProperties"]["maxLength"] + 1)},
     "is not a Kubernetes label"),
    ("scheduling__nodeSelector", lambda: {"a" * (crd.LABEL_KEY_MAX + 1): "v"}, "is not a Kubernetes label"),
    ("engine__extraArgs", lambda: ["--x=" + "a" * crd.schema_at("engine.extraArgs")["items"]["maxLength"]],
     "must be a string of at most"),
    ("engine__env",
     lambda: [{"name": "A" * (crd.schema_at("engine.env")["items"]["properties"]["name"]["maxLength"] + 1)}],
     "every entry needs a name"),
    ("engine__gpuMemoryUtilization", lambda: crd.schema_at("engine.gpuMemoryUtilization")["maximum"] + 0.01,
     "must be a number in (0, 1]"),
    ("engine__gpuMemoryUtilization", lambda: crd.schema_at("engine.gpuMemoryUtilization")["minimum"],
     "must be a number in (0, 1]"),
    ("offload__cpu__size", lambda: "1" * (crd.MAX_QUANTITY_LENGTH + 1), "is not a Kubernetes quantity"),
])
def test_other_bounds_are_the_crd_schemas(key, bad, says):
    with pytest.raises(ConfigError) as exc:
        parse(spec(**{key: bad()}), S)
    assert exc.value.field == "spec." + key.replace("__", ".") and says in exc.value.message, exc.value


def test_namespace_names_take_the_schemas_length():
    path = "networkPolicy.metricsFrom"
    with pytest.raises(ConfigError) as exc:
        parse(spec(networkPolicy__metricsFrom=["a" * (crd.schema_at(path)["items"]["maxLength"] + 1)]), S)
    assert exc.value.field == f"spec.{path}" and "is not a namespace name" in exc.value.message


def test_the_headroom_setting_takes_the_fields_bounds():
    hi = crd.schema_at("resources.headroomPercent")["maximum"]
    with pytest.raises(ConfigError) as exc:
        parse(spec(), Settings(allowed_images=S.allowed_images, headroom_percent=hi + 1))
    assert exc.value.field == "operator setting headroomPercent" and f"[0, {hi}]" in exc.value.message


@pytest.mark.parametrize("key, bad, message", [
    ("replicas", -1, "-1 must be an integer in [0, 1000]"),
    ("engine__tensorParallelSize", 65, "65 must be an integer in [1, 64]"),
    ("metrics__port", 80, "80 must be an integer in [1024, 65535]"),
])
def test_integer_bounds_read_as_written(key, bad, message):
    """The test above reads its bounds from the schema the parser reads: these few are written out, so a schema
    whose bounds went wrong (or vanished) fails here."""
    with pytest.raises(ConfigError) as exc:
        parse(spec(**{key: bad}), S)
    assert exc.value.message == message


def test_plan_input_concurrency_defaults_to_the_crds():
    from kvoffload.planning.sizing import PlanInput

    assert PlanInput.__dataclass_fields__["concurrency"].default == crd.default_at("engine.maxNumSeqs") == 256
