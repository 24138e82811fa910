"""The Argo CD health check (charts/kvoffload-operator/argocd/health.lua) on gopher-lua, the
interpreter Argo CD embeds, in Argo CD's own table form, against fixtures captured from the real
API server (tests/integration/test_gitops.py captures them again and compares their shape)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from kvoffload.cli import generate
from kvtest import gitops as gt


@pytest.fixture
def run_table(gitops_tools):
    def run(script: Path) -> subprocess.CompletedProcess:
        return subprocess.run([gitops_tools["argocd-health"], "-script", str(script), "-tests", str(gt.TABLE)],
                              capture_output=True, text=True, timeout=120)
    return run


def test_table_passes(run_table):
    res = run_table(gt.HEALTH_LUA)
    table = yaml.safe_load(gt.TABLE.read_text())["tests"]
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(table)}/{len(table)} passed" in res.stdout
    statuses = {t["healthStatus"]["status"] for t in table}
    assert statuses == {"Healthy", "Progressing", "Degraded", "Suspended"}
    used = {Path(t["inputPath"]).name for t in table}
    assert used == {p.name for p in (gt.ARGO_DIR / "testdata").glob("*.yaml")}  # every capture is in the table


def test_table_catches_a_wrong_script(tmp_path, run_table):
    wrong = tmp_path / "health.lua"
    wrong.write_text('return {status = "Healthy", message = ""}\n')
    res = run_table(wrong)
    assert res.returncode == 1 and "FAIL testdata/invalid.yaml: got Healthy" in res.stdout


def test_standard_libraries_are_off_as_in_argocd(tmp_path, run_table):
    script = tmp_path / "health.lua"
    script.write_text('local i = string.find("ab", "b")\nreturn {status = "Healthy", message = ""}\n')
    res = run_table(script)
    assert res.returncode == 1 and "string" in res.stdout


def test_argocd_snippets_carry_the_script_verbatim():
    lua = gt.HEALTH_LUA.read_text()
    for path, text in generate.argocd(lua).items():
        doc = yaml.safe_load(text)
        node = doc["data"] if "data" in doc else doc["configs"]["cm"]
        assert node == {generate.ARGOCD_KEY: lua}, path
        assert (gt.ROOT / path).read_text() == text, f"{path} is stale: make generate"
    assert generate.ARGOCD_KEY == "resource.customizations.health.kvoffload.io_KVOffloadServe"
