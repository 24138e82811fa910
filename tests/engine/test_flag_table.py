"""The operator's vLLM flag table is vLLM's own: regenerated from the pinned vLLM's `vllm serve` parser,
it equals the checked-in data file (`make engine-tables` rewrites it)."""

from __future__ import annotations

import json

import engine_venv

from kvoffload.engine import flags


def test_the_flag_table_is_current(tmp_path):
    venv = engine_venv.require()
    pair = engine_venv.PAIR
    path = flags.DATA / f"vllm-{pair.vllm}-flags.json"
    fresh = engine_venv.run(venv, "table")
    assert fresh == json.loads(path.read_text()), f"{path.name} is stale: run `make engine-tables`"
    assert fresh["vllm"] == pair.vllm and fresh["allow_abbrev"] is True
    # What vLLM 0.26.0's parser really has: the aliases the issue found, and none of the removed flags.
    table = flags.table(pair.vllm)
    assert table.options["-tp"].dest == "tensor_parallel_size" and table.options["-pp"].dest == "pipeline_parallel_size"
    assert "--swap-space" not in table.options and "--disable-log-requests" not in table.options
    assert not table.options["--enable-prefix-caching"].takes_value
