"""No serving pod phones home: for each offered pair and each backend, every container that runs vLLM or
LMCache code gets an environment under which that pinned engine's own checks (vLLM's
usage_lib.is_usage_stats_enabled, LMCache's usage_telemetry.is_usage_tracking_enabled, and
huggingface_hub's telemetry switch; vLLM 0.26.0 + LMCache 0.5.3 and vLLM 0.33.0 + LMCache 0.5.6) say
"off" (engine/images.TELEMETRY_OFF_ENV, docs/security.md). Each check runs the engine venv's python in
a subprocess with exactly the container's rendered env; with the opt-out removed the same checks say
"on", so these tests can fail. Skipped without the engine venv, unless KVO_REQUIRE_ENGINE=1 (make test)."""

from __future__ import annotations

import functools
import json
import subprocess
import tempfile
from pathlib import Path

import engine_venv
import pytest

from kvoffload.api.settings import Settings
from kvoffload.controller import pipeline
from kvoffload.engine import images
from kvoffload.rendering import render
from kvtest.fidelity import for_image
from kvtest.specs import spec

BACKENDS = {"lmcache": {}, "lmcache-server": {}, "vllm-native": {"offload__disk": None}}
# The containers that run vLLM or LMCache code, per backend (the others run sh, a stdlib script or kvoffload).
ENGINE_CONTAINERS = {"lmcache": ["vllm"], "lmcache-server": ["lmcache-server", "vllm"], "vllm-native": ["vllm"]}
PROBE = """
import json, os, sys
from huggingface_hub import constants as hf
from lmcache.usage_telemetry.identity import is_usage_tracking_enabled
from vllm.usage import usage_lib
import vllm.envs as envs
json.dump({"vllm": usage_lib.is_usage_stats_enabled(), "lmcache": is_usage_tracking_enabled(),
           "huggingface_hub": not hf.HF_HUB_DISABLE_TELEMETRY,
           "vllm_do_not_track_file": os.path.exists(usage_lib._USAGE_STATS_DO_NOT_TRACK_PATH),
           "vllm_known": sorted(n for n in os.environ if n in envs.environment_variables)}, open(sys.argv[1], "w"))
"""
ON = {"vllm": True, "lmcache": True, "huggingface_hub": True}
OFF = {"vllm": False, "lmcache": False, "huggingface_hub": False}


def program(container: dict) -> str:
    """What the container finally execs (past a shell prelude)."""
    return render.exec_argv(container)[0]


def containers(backend: str, image: str = images.DEFAULT_IMAGE, **patch) -> dict[str, dict]:
    s = for_image(spec(offload__backend=backend, **BACKENDS[backend], **patch), image)
    d = pipeline.desired("svc", "team-a", "", s, Settings())
    pod = next(c for c in d.children if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]}


def container_env(container: dict) -> dict[str, str]:
    """The container's env as the process sees it: fieldRefs get stand-in values (the pod's name and namespace)."""
    out = {}
    for var in container.get("env", []):
        if "value" in var:
            out[var["name"]] = var["value"]
        else:
            fields = {"metadata.name": "svc-0", "metadata.namespace": "team-a"}
            out[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def probe(venv: Path, env: dict[str, str]) -> dict:
    return dict(_probe(venv, tuple(sorted(env.items()))))


# identical envs (the vllm container of lmcache-server and vllm-native) run once: each run imports torch
@functools.cache
def _probe(venv: Path, items: tuple[tuple[str, str], ...]) -> dict:
    env = dict(items)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cp = subprocess.run([engine_venv.python(venv), "-c", PROBE, str(out)], env=env, cwd=tmp, capture_output=True,
                            text=True, timeout=600)
        assert cp.returncode == 0 and out.is_file(), f"{env}\n{cp.stdout[-3000:]}\n{cp.stderr[-3000:]}"
        seen = json.loads(out.read_text())
    assert not seen.pop("vllm_do_not_track_file"), "a do_not_track file on this machine would hide vLLM's default"
    return seen


@pytest.fixture(scope="module", params=list(images.serving_images()))
def image(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def venv(image) -> Path:
    pair = images.KNOWN_IMAGES[image]
    return engine_venv.require(pair.vllm, pair.lmcache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_engine_container_has_telemetry_off(venv, image, backend):
    pod = containers(backend, image)
    engine = sorted(name for name, c in pod.items() if program(c) in ("vllm", "lmcache"))
    assert engine == ENGINE_CONTAINERS[backend]
    for name in engine:
        env = container_env(pod[name])
        assert {k: env.get(k) for k in images.TELEMETRY_OFF_ENV} == images.TELEMETRY_OFF_ENV, name
        seen = probe(venv, env)
        assert {k: seen[k] for k in OFF} == OFF, (backend, name, seen)
        # The control: the same env without the opt-out, and the same engine phones home.
        control = probe(venv, {k: v for k, v in env.items() if k not in images.TELEMETRY_OFF_ENV})
        assert {k: control[k] for k in ON} == ON, (backend, name, control)
        # VLLM_* variables the operator renders are known to vLLM (an unknown one would do nothing).
        assert set(seen["vllm_known"]) >= {k for k in env if k.startswith("VLLM_")}, seen["vllm_known"]


@pytest.mark.parametrize("name, turns_off", [
    # DO_NOT_TRACK alone: read by LMCache, huggingface_hub and (while VLLM_DO_NOT_TRACK is unset) vLLM.
    ("DO_NOT_TRACK", {"vllm": False, "lmcache": False, "huggingface_hub": False}),
    # VLLM_NO_USAGE_STATS alone: vLLM's own switch, and only vLLM's.
    ("VLLM_NO_USAGE_STATS", {"vllm": False, "lmcache": True, "huggingface_hub": True}),
])
def test_each_rendered_variable_is_read_by_the_engine(venv, name, turns_off):
    """Each variable does what the table says on its own: none is a typo that silently does nothing."""
    assert name in images.TELEMETRY_OFF_ENV
    seen = probe(venv, {name: images.TELEMETRY_OFF_ENV[name]})
    assert {k: seen[k] for k in turns_off} == turns_off, seen


def test_variables_a_user_may_set_do_not_turn_telemetry_back_on(venv, image):
    """spec.engine.env may set VLLM_DO_NOT_TRACK (it shadows DO_NOT_TRACK in vLLM) and huggingface_hub's own
    switches, but not the managed ones: as rendered, with those set to "on", everything stays off."""
    user = [{"name": "VLLM_DO_NOT_TRACK", "value": "0"}, {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "0"},
            {"name": "DISABLE_TELEMETRY", "value": "0"}]
    env = container_env(containers("lmcache", image, engine__env=user)["vllm"])
    assert env["VLLM_DO_NOT_TRACK"] == "0"
    seen = probe(venv, env)
    assert {k: seen[k] for k in OFF} == OFF, seen
    # Without VLLM_NO_USAGE_STATS, VLLM_DO_NOT_TRACK=0 would have undone DO_NOT_TRACK for vLLM: why both are set.
    assert probe(venv, {k: v for k, v in env.items() if k != "VLLM_NO_USAGE_STATS"})["vllm"] is True


def test_other_lmcache_versions_read_do_not_track(venv):
    """LMCache 0.5.4 and 0.5.6 (the wheels `make engine-metadata` fetched, tests/engine/compatibility.py) read
    DO_NOT_TRACK too: their own is_usage_tracking_enabled, loaded by file in the pinned venv."""
    wheels = sorted((engine_venv.CACHE / "wheels").glob("lmcache-*/lmcache/usage_telemetry/identity.py"))
    if not wheels:
        pytest.skip("no unpacked LMCache wheels: make engine-metadata")
    script = ("import importlib.util as u, json, sys\n"
              "out = {}\n"
              "for i, path in enumerate(sys.argv[1:]):\n"
              "    spec = u.spec_from_file_location(f'identity{i}', path); m = u.module_from_spec(spec)\n"
              "    sys.modules[spec.name] = m  # its dataclass looks itself up there\n"
              "    spec.loader.exec_module(m)\n"
              "    out[path] = m.is_usage_tracking_enabled()\n"
              "print(json.dumps(out))\n")
    for env, expected in ((images.TELEMETRY_OFF_ENV, False), ({}, True)):
        cp = subprocess.run([engine_venv.python(venv), "-c", script, *map(str, wheels)], env=env, capture_output=True,
                            text=True, timeout=600, check=True)
        assert set(json.loads(cp.stdout.strip().splitlines()[-1]).values()) == {expected}, cp.stdout
