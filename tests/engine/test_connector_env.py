"""The environment the operator renders for each offered pair's connector (engine/images.CONNECTOR_ENV) is
real: that pair's vLLM reads each variable and its value means what the table says, and the LMCache code
path that the V2 runner's quirk hits is there (docs/compatibility.md)."""

from __future__ import annotations

import json
import subprocess

import engine_venv
import pytest

from kvoffload.engine import images

PROBE = """
import json, os, sys
wanted = json.loads(sys.argv[1])
os.environ.update(wanted)
import vllm.envs as envs
print(json.dumps({name: [name in envs.environment_variables, getattr(envs, name)] for name in wanted}))
"""
PAIRS = pytest.mark.parametrize("pair", engine_venv.PAIRS, ids=lambda p: f"vllm-{p.vllm}-lmcache-{p.lmcache}")


@PAIRS
def test_vllm_reads_the_rendered_connector_env(pair):
    venv = engine_venv.require(pair.vllm, pair.lmcache)
    env = images.connector_env(images.EnginePair(pair.vllm, pair.lmcache))
    # The known pairs' quirk (0.26.0: an H200 run; 0.33.0: from its source, images.py says where).
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    out = subprocess.run([engine_venv.python(venv), "-c", PROBE, json.dumps(env)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    # Known to vLLM (vllm/envs.py), and "0" parses to False: the V1 model runner.
    assert seen == {"VLLM_USE_V2_MODEL_RUNNER": [True, False]}


@PAIRS
def test_lmcache_skips_loads_without_attention_metadata(pair):
    """The quirk's other half, in the pinned LMCache's source: start_load_kv returns early when vLLM passes
    no attention metadata (what vLLM 0.26.0's V2 runner does with one token left to compute)."""
    venv = engine_venv.require(pair.vllm, pair.lmcache)
    adapter = engine_venv.site_packages(venv) / "lmcache" / "integration" / "vllm" / "vllm_v1_adapter.py"
    text = adapter.read_text()
    assert "if attn_metadata is None:" in text and "In connector.start_load_kv, but the attn_metadata is None" in text


@PAIRS
def test_vllms_v2_runner_starts_loads_without_attention_metadata(pair):
    """The quirk's vLLM half, in that vLLM's source: the V2 runner's connector wrapper starts the loads under a
    forward context without attention metadata when none is set (a full CUDA graph step)."""
    venv = engine_venv.require(pair.vllm, pair.lmcache)
    text = (engine_venv.site_packages(venv) / "vllm" / "v1" / "worker" / "gpu" / "kv_connector.py").read_text()
    block = text[text.index("with set_forward_context(None, self.vllm_config):"):][:200]
    assert "self.kv_connector.start_load_kv(get_forward_context()" in block
