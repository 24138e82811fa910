"""render: golden files for the examples, and invariants every rendering must keep."""

import ast
import json
import os
import subprocess
import sys

import pytest
import yaml

from kvoffload.api.errors import ConfigError
from kvoffload.api.quantity import to_bytes
from kvoffload.api.settings import Settings
from kvoffload.backends import lmcache
from kvoffload.cli.render import dump_all
from kvoffload.controller import pipeline
from kvoffload.engine import images
from kvoffload.engine import versions as engine_versions
from kvoffload.rendering import render
from kvtest import ROOT
from kvtest.specs import EXAMPLE_SETTINGS, EXAMPLES, spec

GOLDEN = ROOT / "tests" / "golden"


def render_example(path):
    doc = yaml.safe_load(path.read_text())
    meta = doc["metadata"]
    try:
        return dump_all(pipeline.desired(meta["name"], meta["namespace"], "", doc["spec"], EXAMPLE_SETTINGS).children)
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
    assert env["PYTHONHASHSEED"] == "0" and env["LMCACHE_CONFIG_FILE"] == lmcache.CONFIG_FILE
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
    inits = [c["name"] for c in pod["initContainers"]]
    assert inits == (["prepare-disk-tier"] if disk else []) + ["report-engine-versions"]
    if disk:
        host = next(v for v in pod["volumes"] if v["name"] == "kv-disk")["hostPath"]
        # The volume is exactly the admin's root; all the tenant chose is a subPath kubelet checks per component.
        assert host == {"path": "/mnt/nvme", "type": "Directory"}
        mount = next(m for m in vllm["volumeMounts"] if m["name"] == "kv-disk")
        assert mount["subPathExpr"] == "lmcache/$(POD_NAMESPACE)/svc/$(POD_NAME)"
        assert pod["nodeSelector"] == {"kvoffload.io/nvme": "true"}
        prepare = pod["initContainers"][0]
        assert prepare["image"] == Settings().kvoffload_image != vllm["image"]  # never the tenant's image as root
        assert prepare["command"] == ["kvoffload"] and prepare["args"][0] == "prepare-disk-tier"
        assert prepare["volumeMounts"] == [{"name": "kv-disk", "mountPath": render.DISK_PARENT_DIR,
                                            "subPathExpr": "lmcache/$(POD_NAMESPACE)/svc"}]
    else:
        assert "nodeSelector" not in pod
    versions = pod["initContainers"][-1]
    assert versions["image"] == vllm["image"]  # the serving image reports what it holds
    assert versions["securityContext"]["readOnlyRootFilesystem"]
    assert exporter["args"][exporter["args"].index("--engine-versions-file") + 1] == engine_versions.VERSIONS_FILE


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
    assert [c["name"] for c in pod_of(children)["initContainers"]] == ["prepare-disk-tier"]  # no versions reader
    assert "engine-info" not in [v["name"] for v in pod_of(children)["volumes"]]
    assert [p["name"] for p in kinds(children)[("Service", "svc")]["spec"]["ports"]] == ["http"]


def test_user_args_and_env_are_appended_not_overriding():
    s = spec(engine__extraArgs=["--enable-chunked-prefill"],
             engine__env=[{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}])
    vllm = pod_of(pipeline.desired("svc", "ns", "u", s, Settings()).children)["containers"][0]
    assert vllm["args"][-1] == "--enable-chunked-prefill"
    assert vllm["env"][-1] == {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}


def test_long_names_are_refused():
    with pytest.raises(ConfigError, match="metadata.name"):
        render.check_name("x" * 53)
    with pytest.raises(ConfigError, match="metadata.name"):
        pipeline.desired("x" * 53, "ns", "u", spec(), Settings())


# --- the vLLM container's prelude: the multiprocess dir is emptied at every start -------------------

FAKE_VLLM = """#!{python}
import json, os, sys
d = os.environ["PROMETHEUS_MULTIPROC_DIR"]
with open(os.environ["RECORD"], "w") as f:
    json.dump({{"argv": sys.argv[1:], "left": sorted(os.listdir(d)), "pid": os.getpid()}}, f)
open(os.path.join(d, "counter_%d.db" % os.getpid()), "w").write("written by this run")
sys.exit(7)
"""


def _start_vllm_container(container, fake_bin, multiproc, record):
    """Run the rendered command + args as the kubelet would, with a fake `vllm` first on PATH."""
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
           "RECORD": str(record)}
    proc = subprocess.Popen([*container["command"], *container["args"]], env=env)
    assert proc.wait(30) == 7  # vLLM's exit status, unchanged: the shell exec'd it
    return proc.pid, json.loads(record.read_text())


@pytest.mark.parametrize("path", [p for p in EXAMPLES if "field" not in p.name], ids=lambda p: p.name)
def test_vllm_prelude_empties_the_multiproc_dir_at_every_start(path, tmp_path):
    doc = yaml.safe_load(path.read_text())
    s = doc["spec"]
    s.setdefault("engine", {})["extraArgs"] = ["--override-generation-config", '{"temperature": 0.5}',
                                               "--chat-template=a b"]
    children = pipeline.desired(doc["metadata"]["name"], "ns", "", s, EXAMPLE_SETTINGS).children
    container = pod_of(children)["containers"][0]
    assert container["command"][:3] == ["/bin/sh", "-c", render.VLLM_PRELUDE]
    argv = render.vllm_argv(container)
    assert argv[:3] == ["vllm", "serve", s["model"]["name"]] and argv[-3:] == s["engine"]["extraArgs"]

    fake_bin, multiproc = tmp_path / "bin", tmp_path / "multiproc"
    fake_bin.mkdir()
    (fake_bin / "vllm").write_text(FAKE_VLLM.format(python=sys.executable))
    (fake_bin / "vllm").chmod(0o755)
    multiproc.mkdir()
    # What a crashed vLLM leaves: its files, a hidden file, a directory with files.
    for name in ("counter_41.db", "gauge_livemostrecent_41.db", ".hidden"):
        (multiproc / name).write_text("stale")
    (multiproc / "sub").mkdir()
    (multiproc / "sub" / "histogram_41.db").write_text("stale")

    pid, seen = _start_vllm_container(container, fake_bin, multiproc, tmp_path / "record.json")
    assert seen["left"] == []  # emptied before vLLM started
    assert seen["argv"] == argv[1:]  # exactly the rendered arguments, quotes and spaces included
    assert seen["pid"] == pid  # exec: vLLM is the container's main process and gets its signals
    assert multiproc.is_dir()  # the mount point itself stays

    # The container restarts (the pod does not): this run's file is gone too.
    assert os.listdir(multiproc) == [f"counter_{pid}.db"]
    _, seen = _start_vllm_container(container, fake_bin, multiproc, tmp_path / "record.json")
    assert seen["left"] == []


# --- the versions init container --------------------------------------------------------------

def test_versions_script_reports_what_the_environment_holds(tmp_path):
    """REPORT_SCRIPT, run as the init container runs it, in this venv (which holds none of vLLM,
    LMCache and torch since the fidelity tests moved to the engine venv: each reads as not installed)."""
    from importlib import metadata

    def installed(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    init = pod_of(pipeline.desired("svc", "ns", "u", spec(), Settings()).children)["initContainers"][-1]
    out = tmp_path / "versions.json"
    command = [sys.executable if c == "python3" else c for c in init["command"][:-1]] + [str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    doc = json.loads(out.read_text())
    assert doc == {name: installed(name) for name in engine_versions.PACKAGES}
    assert "kvoffload: engine versions" in done.stdout
    found = engine_versions.parse(out.read_text())
    assert found.lmcache == (doc["lmcache"] or engine_versions.NOT_INSTALLED)
    assert found.vllm == (doc["vllm"] or engine_versions.NOT_INSTALLED)
    assert not (tmp_path / "versions.json.tmp").exists()


@pytest.mark.parametrize("engine, expected", [
    ({}, "0"),  # the default image: vLLM 0.26.0 + LMCache 0.5.3, whose V2 runner skips LMCache's loads
    ({"image": "ghcr.io/kvoffload/vllm-lmcache:0.33.0-0.5.6"}, "0"),  # 0.33.0's V2 runner too (from its source)
    ({"image": "lmcache/vllm-openai:v0.5.4", "vllmVersion": "0.27.1"}, None),  # no known quirk: nothing rendered
])
def test_connector_env_follows_the_engine_pair(engine, expected):
    s = spec()
    s["engine"].update(engine)
    d = pipeline.desired("svc", "ns", "u", s, Settings())
    vllm = pod_of(d.children)["containers"][0]
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env.get("VLLM_USE_V2_MODEL_RUNNER") == expected
    pair = images.EnginePair(d.spec.engine.vllm_version, d.spec.engine.lmcache_version)
    assert images.connector_env(pair) == ({"VLLM_USE_V2_MODEL_RUNNER": expected} if expected else {})


@pytest.mark.parametrize("backend", ["lmcache-server", "vllm-native"])
def test_connector_env_only_for_the_in_process_connector(backend):
    # LMCacheMPConnector and vLLM's OffloadingConnector do not have LMCacheConnectorV1's V2-runner early return.
    s = spec()
    s["offload"]["backend"] = backend
    if backend == "vllm-native":
        s["offload"].pop("disk", None)
    vllm = pod_of(pipeline.desired("svc", "ns", "u", s, Settings()).children)["containers"][0]
    assert "VLLM_USE_V2_MODEL_RUNNER" not in {e["name"] for e in vllm["env"]}


def _program(container):
    """What a container finally execs (past a shell prelude)."""
    return render.exec_argv(container)[0]


@pytest.mark.parametrize("backend, engine_containers", [
    ("lmcache", ["vllm"]), ("lmcache-server", ["lmcache-server", "vllm"]), ("vllm-native", ["vllm"])])
def test_telemetry_is_off_in_every_container_that_runs_engine_code(backend, engine_containers):
    """vLLM and LMCache phone home unless opted out (engine/images.TELEMETRY_OFF_ENV; the pinned engine's own
    checks under this env: tests/engine/test_telemetry.py). The other containers run no engine code."""
    s = spec(offload__backend=backend, **({"offload__disk": None} if backend == "vllm-native" else {}))
    pod = pod_of(pipeline.desired("svc", "ns", "u", s, Settings()).children)
    every = pod.get("initContainers", []) + pod["containers"]
    assert sorted(c["name"] for c in every if _program(c) in ("vllm", "lmcache")) == engine_containers
    for c in every:
        names = [e["name"] for e in c.get("env", [])]
        set_here = {e["name"]: e.get("value") for e in c.get("env", []) if e["name"] in images.TELEMETRY_OFF_ENV}
        if c["name"] in engine_containers:
            assert set_here == images.TELEMETRY_OFF_ENV and all(names.count(n) == 1 for n in set_here), c["name"]
        else:
            assert _program(c) in ("/bin/sh", "python3", "kvoffload"), c["name"]
            if _program(c) == "python3":  # the versions reader: stdlib only (importlib.metadata), never vllm or lmcache
                assert c["command"][2] == engine_versions.REPORT_SCRIPT
                imports = {a.name for n in ast.walk(ast.parse(c["command"][2])) if isinstance(n, ast.Import)
                           for a in n.names}
                assert imports == {"importlib.metadata", "json", "os", "sys"}


def test_the_operators_own_pods_never_import_the_engine():
    """The chart's pods (operator, janitor) and the exporter run the kvoffload package, which imports neither vLLM
    nor LMCache: no telemetry to turn off there."""
    package = ROOT / "operator" / "kvoffload"
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.relative_to(package)}: {m}" for m in mods if m.split(".")[0] in ("vllm", "lmcache")]
    assert not found
