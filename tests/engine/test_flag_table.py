"""The operator's vLLM flag tables are vLLM's own: regenerated from each offered vLLM's `vllm serve` parser
(in that pair's engine venv), each equals its checked-in data file (`make engine-tables` rewrites them)."""

from __future__ import annotations

import json

import engine_venv
import pytest

from kvoffload.engine import flags

# What each vLLM's parser really has, beyond "the table is current": the aliases the issue found, the
# flags that are gone, a switch that takes no value.
REMOVED = {"0.26.0": ("--swap-space", "--disable-log-requests"),
           "0.33.0": ("--swap-space", "--max-num-partial-prefills")}


@pytest.mark.parametrize("pair", engine_venv.PAIRS, ids=lambda p: f"vllm-{p.vllm}")
def test_the_flag_table_is_current(pair):
    venv = engine_venv.require(pair.vllm, pair.lmcache)
    path = flags.DATA / f"vllm-{pair.vllm}-flags.json"
    fresh = engine_venv.run(venv, "table")
    assert fresh == json.loads(path.read_text()), f"{path.name} is stale: run `make engine-tables`"
    assert fresh["vllm"] == pair.vllm and fresh["allow_abbrev"] is True
    table = flags.table(pair.vllm)
    assert table.options["-tp"].dest == "tensor_parallel_size" and table.options["-pp"].dest == "pipeline_parallel_size"
    for removed in REMOVED[pair.vllm]:
        assert removed not in table.options
    assert not table.options["--enable-prefix-caching"].takes_value


def test_every_offered_vllm_has_a_table():
    assert {p.vllm for p in engine_venv.PAIRS} <= set(flags.supported_versions())
