"""What LMCache's own fs_native L2 does with the files an earlier server wrote (issue 35; docs/disk-tier.md): built from
the --l2-adapter JSON the operator renders for backend lmcache-server, in the engine venv of each pair the operator
offers (its C++ FS connector, on this CPU host). A second adapter over the same directory, as a restarted server
is, finds the chunk by its file name and loads its bytes, but counts none of it: the reason the disk-tier init
step keeps such files only up to a share of the budget.

Skipped without the engine venv, unless KVO_REQUIRE_ENGINE=1 (make test) makes that a failure.
"""

from __future__ import annotations

import json
import os
import subprocess

import engine_venv
import pytest

from kvoffload.api.settings import Settings
from kvoffload.controller import pipeline
from kvtest.specs import spec

SCRIPT = engine_venv.HERE / "l2_restart_check.py"


def rendered_adapter() -> dict:
    d = pipeline.desired("svc", "ns", "uid-1", spec(offload__backend="lmcache-server", offload__disk__size="1Gi"),
                         Settings())
    sts = next(c for c in d.children if c["kind"] == "StatefulSet")
    (server,) = [c for c in sts["spec"]["template"]["spec"]["initContainers"] if c["name"] == "lmcache-server"]
    return json.loads(server["args"][server["args"].index("--l2-adapter") + 1])


def run(venv, adapter: dict, base, phase: str) -> dict:
    cp = subprocess.run([engine_venv.python(venv), str(SCRIPT), json.dumps(adapter), str(base), phase],
                        capture_output=True, text=True, timeout=300,
                        env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"})
    assert cp.returncode == 0, cp.stderr[-3000:]
    return json.loads(cp.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pair", engine_venv.PAIRS, ids=lambda p: f"{p.vllm}-{p.lmcache}")
def test_a_restarted_servers_fs_native_l2_reads_the_kept_chunk_but_does_not_count_it(pair, tmp_path):
    venv = engine_venv.require(pair.vllm, pair.lmcache)
    adapter = rendered_adapter()
    assert adapter["type"] == "fs_native" and adapter["eviction"]["eviction_policy"] == "LRU"
    base = tmp_path / "kvcache"
    base.mkdir()
    stored = run(venv, adapter, base, "store")
    assert stored["stored"] and stored["usage_bytes"] > 0, stored  # what it stored itself, it counts
    (chunk,) = stored["files"]
    assert chunk.endswith(".data") and chunk.startswith("meta-llama-SEP-Llama-3.1-8B-Instruct@"), chunk
    again = run(venv, adapter, base, "reload")  # a new process: as after a server restart
    assert (again["found"], again["loaded"], again["bytes_match"]) == (1, 1, True), again
    assert again["usage_bytes"] == 0, again  # read, but never counted: it would never be evicted either
    assert again["files"] == [chunk]
