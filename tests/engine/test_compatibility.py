"""docs/compatibility.md is what the checks behind each row give now (tests/engine/compatibility.py)."""

from __future__ import annotations

import compatibility
import engine_venv


def test_the_compatibility_matrix_is_current():
    engine_venv.require()
    text = compatibility.render()
    assert compatibility.DOC.read_text() == text, "docs/compatibility.md is stale: run .venv/bin/python tests/engine/compatibility.py"
    # What the checks found, as the reference run said: 0.5.4's extension does not load on vLLM 0.26.0's torch.
    row = next(line for line in text.splitlines() if line.startswith("| — | 0.26.0 | 0.5.4 |"))
    assert "no: lmcache.cuda_ops against torch 2.11.0: undefined symbol" in row
