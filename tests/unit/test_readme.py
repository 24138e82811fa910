"""Every `kvoffload` command in the README runs and succeeds (cluster commands: tests/integration/test_readme.py)."""

import shlex
import subprocess
import sys

import pytest

from kvtest import ROOT
from kvtest.readme import README, commands

CLI = [c for c in commands() if c.startswith("kvoffload ")]


def test_readme_has_exactly_the_two_setup_commands():
    setup = README.read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    assert commands(setup) == ["make demo", "make test"]


def test_every_readme_command_is_run_somewhere():
    others = [c for c in commands() if not c.startswith(("kvoffload ", "kubectl ", "helm ", "make "))]
    assert not others, f"README commands no test runs: {others}"
    assert CLI


@pytest.mark.parametrize("command", CLI)
def test_cli_commands_from_the_readme(command):
    allowed_failure = command.endswith("|| true")
    argv = shlex.split(command.removesuffix("|| true"))
    res = subprocess.run([sys.executable, "-m", "kvoffload.cli", *argv[1:]], cwd=ROOT, capture_output=True, text=True)
    if allowed_failure:  # the README shows a refusal: it must fail, cleanly, naming the field
        assert res.returncode == 2 and "spec.resources.gpuMemory" in res.stderr and "Traceback" not in res.stderr
    else:
        assert res.returncode == 0, res.stderr
        assert res.stdout


def test_readme_plan_output_is_what_the_cli_prints():
    plan = next(c for c in CLI if c.startswith("kvoffload plan"))
    res = subprocess.run([sys.executable, "-m", "kvoffload.cli", *shlex.split(plan)[1:]], cwd=ROOT, capture_output=True, text=True)
    shown = README.read_text().split(plan, 1)[1].split("```\n", 2)[1]
    for line in shown.strip().splitlines():
        assert line in res.stdout, line
