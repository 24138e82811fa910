"""render: golden files for the examples, and invariants every rendering must keep."""

import os

import pytest
import yaml

from kvoffload.api.errors import ConfigError
from kvoffload.api.quantity import to_bytes
from kvoffload.api.settings import Settings
from kvoffload.cli.render import dump_all
from kvoffload.controller import pipeline
from kvoffload.rendering import render

from .helpers import EXAMPLES, ROOT, spec

GOLDEN = ROOT / "tests" / "golden"


def render_example(path):
    doc = yaml.safe_load(path.read_text())
    meta = doc["metadata"]
    try:
        return dump_all(pipeline.desired(meta["name"], meta["namespace"], "", doc["spec"], Settings()).children)
    except ConfigError as exc:
        return f"# error\n{exc}\n"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_golden(path):
    got = render_example(path)
    golden = GOLDEN / path.name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(got)
    assert golden.exists(), "run UPDATE_GOLDEN=1 pytest tests/unit/test_render.py"
    assert got == golden.read_text()


def kinds(children):
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def pod_of(children):
    return next(c for c in children if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]


def test_deterministic():
    a = pipeline.desired("a", "ns", "u", spec(), Settings()).children
    b = pipeline.desired("a", "ns", "u", spec(), Settings()).children
    assert a == b and dump_all(a) == dump_all(b)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("disk", [True, False])
def test_pod_invariants(tp, disk):
    s = spec(engine__tensorParallelSize=tp)
    if not disk:
        del s["offload"]["disk"]
    d = pipeline.desired("svc", "team-a", "uid-1", s, Settings())
    pod = pod_of(d.children)
    vllm, exporter = pod["containers"]
    res = vllm["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"]  # pinned memory: request = limit
    assert to_bytes(res["limits"]["memory"], "x") == d.budget.memory_limit >= to_bytes("40Gi", "x")
    assert res["limits"]["nvidia.com/gpu"] == str(tp)
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["PYTHONHASHSEED"] == "0" and env["LMCACHE_CONFIG_FILE"] == render.CONFIG_FILE
    assert env["PROMETHEUS_MULTIPROC_DIR"] == render.MULTIPROC_DIR
    assert any(m["mountPath"] == render.MULTIPROC_DIR for m in exporter["volumeMounts"])
    args = vllm["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == str(tp)
    assert '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}' == args[args.index("--kv-transfer-config") + 1]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert shm["medium"] == "Memory" and to_bytes(shm["sizeLimit"], "x") == d.budget.shm
    for c in pod["containers"] + pod.get("initContainers", []):
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["privileged"] is False
    assert exporter["securityContext"]["runAsNonRoot"] and exporter["securityContext"]["readOnlyRootFilesystem"]
    assert ("initContainers" in pod) == disk
    if disk:
        host = next(v for v in pod["volumes"] if v["name"] == "kv-disk")["hostPath"]
        assert host["path"] == "/mnt/nvme/lmcache"
        mount = next(m for m in vllm["volumeMounts"] if m["name"] == "kv-disk")
        assert mount["subPathExpr"] == "$(POD_NAMESPACE)/svc/$(POD_NAME)"
        assert pod["nodeSelector"] == {"kvoffload.io/nvme": "true"}
        assert "find" in pod["initContainers"][0]["command"][-1]
    else:
        assert "nodeSelector" not in pod


def test_children_are_owned_and_labelled():
    children = pipeline.desired("svc", "team-a", "uid-1", spec(), Settings()).children
    assert [c["kind"] for c in children] == ["ConfigMap", "Service", "Service", "StatefulSet", "PodDisruptionBudget"]
    for c in children:
        assert c["metadata"]["labels"][render.OWNER_LABEL] == "svc"
        (ref,) = c["metadata"]["ownerReferences"]
        assert ref["uid"] == "uid-1" and ref["controller"] is True and ref["kind"] == "KVOffloadServe"
    headless = kinds(children)[("Service", "svc-pods")]
    assert headless["spec"]["clusterIP"] == "None"


def test_config_change_rolls_the_pods():
    a = pod_of_annotations(spec())
    b = pod_of_annotations(spec(offload__cpu__size="50Gi"))
    assert a != b


def pod_of_annotations(s):
    children = pipeline.desired("svc", "ns", "u", s, Settings()).children
    return next(c for c in children if c["kind"] == "StatefulSet")["spec"]["template"]["metadata"]["annotations"]


def test_ephemeral_volume_instead_of_hostpath():
    s = spec(offload__disk__path=None, offload__disk__storageClassName="local-nvme")
    pod = pod_of(pipeline.desired("svc", "ns", "u", s, Settings()).children)
    vol = next(v for v in pod["volumes"] if v["name"] == "kv-disk")
    assert "hostPath" not in vol
    claim = vol["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "local-nvme" and claim["resources"]["requests"]["storage"] == "200Gi"
    assert not any(v.get("hostPath") for v in pod["volumes"])


def test_metrics_off_drops_the_sidecar_and_port():
    children = pipeline.desired("svc", "ns", "u", spec(metrics={"enabled": False}), Settings()).children
    assert [c["name"] for c in pod_of(children)["containers"]] == ["vllm"]
    assert [p["name"] for p in kinds(children)[("Service", "svc")]["spec"]["ports"]] == ["http"]


def test_user_args_and_env_are_appended_not_overriding():
    s = spec(engine__extraArgs=["--enable-chunked-prefill"], engine__env=[{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}])
    vllm = pod_of(pipeline.desired("svc", "ns", "u", s, Settings()).children)["containers"][0]
    assert vllm["args"][-1] == "--enable-chunked-prefill"
    assert vllm["env"][-1] == {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}


def test_long_names_are_refused():
    with pytest.raises(ConfigError, match="metadata.name"):
        render.check_name("x" * 53)
    with pytest.raises(ConfigError, match="metadata.name"):
        pipeline.desired("x" * 53, "ns", "u", spec(), Settings())
