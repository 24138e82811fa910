"""docs/compatibility.md is what the checks behind each row give now (tests/engine/compatibility.py)."""

from __future__ import annotations

import compatibility
import engine_venv

from kvoffload.engine import images


def test_the_compatibility_matrix_is_current():
    for pair in engine_venv.PAIRS:
        engine_venv.require(pair.vllm, pair.lmcache)
    text = compatibility.render()
    assert compatibility.DOC.read_text() == text, (
        "docs/compatibility.md is stale: run .venv/bin/python tests/engine/compatibility.py")
    lines = text.splitlines()
    # What the checks found, as the reference run said: 0.5.4's extension does not load on vLLM 0.26.0's torch.
    row = next(line for line in lines if line.startswith("| — | 0.26.0 | 0.5.4 |"))
    assert "no: lmcache.cuda_ops against torch 2.11.0: undefined symbol" in row
    # LMCache 0.5.6's PyPI wheel does not load on vLLM 0.33.0's torch 2.14.0 (the finding)...
    row = next(line for line in lines if line.startswith("| — | 0.33.0 | 0.5.6 |"))
    assert ("no: lmcache.cuda_ops against torch 2.14.0: undefined symbol" in row
            and "c10_cuda_check_implementation" in row)
    # ... and compiled from source against that torch it does, and the whole row is checked: the default's row.
    row = next(line for line in lines
               if line.startswith(f"| `{images.DEFAULT_IMAGE}` (default) | 0.33.0 | 0.5.6 (built from source) |"))
    assert "yes: lmcache.cuda_ops loads against torch 2.14.0" in row
    # ... and what ran on an H200 (GPU_RUNS: the evidence, docs/benchmarks.md), and what did not, the row says.
    assert "| yes, every backend: NVIDIA H200" in row, row
    assert "lmcache-server with --shm-name 0.170 s" in row, row
    # No offered pair has a row that says "not checked".
    for image in images.serving_images():
        row = next(line for line in lines if line.startswith(f"| `{image}`"))
        assert "not checked" not in row, row
