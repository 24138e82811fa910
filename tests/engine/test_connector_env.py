"""The environment the operator renders for the pinned pair's connector (engine/images.CONNECTOR_ENV) is
real: the pinned vLLM reads each variable and its value means what the table says, and the LMCache code
path that the V2 runner's quirk hits is there (docs/compatibility.md)."""

from __future__ import annotations

import json
import subprocess

import engine_venv

from kvoffload.engine import images

PROBE = """
import json, os, sys
wanted = json.loads(sys.argv[1])
os.environ.update(wanted)
import vllm.envs as envs
print(json.dumps({name: [name in envs.environment_variables, getattr(envs, name)] for name in wanted}))
"""


def test_vllm_reads_the_rendered_connector_env():
    venv = engine_venv.require()
    pair = images.EnginePair(engine_venv.PAIR.vllm, engine_venv.PAIR.lmcache)
    env = images.connector_env(pair)
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}  # the known pair's quirk (H200 run)
    out = subprocess.run([engine_venv.python(venv), "-c", PROBE, json.dumps(env)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    # Known to vLLM (vllm/envs.py), and "0" parses to False: the V1 model runner.
    assert seen == {"VLLM_USE_V2_MODEL_RUNNER": [True, False]}


def test_lmcache_skips_loads_without_attention_metadata():
    """The quirk's other half, in the pinned LMCache's source: start_load_kv returns early when vLLM passes
    no attention metadata (what vLLM 0.26.0's V2 runner does with one token left to compute)."""
    venv = engine_venv.require()
    adapter = engine_venv.site_packages(venv) / "lmcache" / "integration" / "vllm" / "vllm_v1_adapter.py"
    text = adapter.read_text()
    assert "if attn_metadata is None:" in text and "In connector.start_load_kv, but the attn_metadata is None" in text
