"""The README: short, its two set-up commands, every figure it quotes measured in docs/benchmarks.md, and every
`kvoffload` command it shows runs and succeeds (cluster commands: tests/integration/test_readme.py).

Figures. A figure is a number the README's prose quotes with a decimal point or a unit; it must appear, exactly as
written, in docs/benchmarks.md. The rule, applied by `figures`:
- Prose only: fenced code blocks (commands, outputs, YAML; the `kvoffload plan` output is checked against the CLI
  below), inline code spans and link targets are removed first.
- A number is digits with optional thousands commas and an optional decimal part (`1,000`, `0.074`, `32,768`), or a
  range of two joined by an en dash (`22–23 %`); it stands alone (no letter, digit, `.`, `,`, `_`, `-` or `/` right
  before it, so `H200`, `sm_90`, `Llama-3.1`, `Qwen2.5` are names, not figures).
- It is a figure when it has a decimal point or is followed by a unit: after an optional space `s`, `ms`, `µs`, `min`,
  `%`, `KiB`, `MiB`, `GiB`, `TiB`, `KB`, `MB`, `GB`, `TB`, `MB/s`, `GB/s`, `CPU-s`, `tokens`, `passed`; attached,
  `x`, `×` or `-token` (`14.9×`, `3.6x`, `32,768-token`). A unit ends at a non-letter.
- Not figures: integers without a unit (counts such as "five nodes", issue and port numbers, `maxUnavailable: 1`),
  versions and addresses (two or more dots: `0.26.0`, `127.0.0.1`; or a number right after `v`, or after a product
  name in VERSIONED with an optional `≥`: "Python 3.11", "Go ≥ 1.26"), and dates.
- A figure matches docs/benchmarks.md only where it stands alone there too: `0.074 s` is not found in `10.074 s`.
"""

import re
import shlex
import subprocess
import sys

import pytest
import yaml

from kvtest import ROOT
from kvtest.readme import README, commands

CLI = [c for c in commands() if c.startswith("kvoffload ")]
SETUP = ["make demo", "make test"]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
MAX_LINES = 300

UNITS = ("GB/s", "MB/s", "CPU-s", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB", "min", "ms", "µs", "s", "%",
         "tokens", "passed")
ATTACHED = ("×", "x", "-token")
VERSIONED = ("Python", "Go", "Helm", "Kubernetes", "kubectl", "vLLM", "LMCache", "torch", "CUDA", "Debian", "Linux",
             "containerd", "runc", "crun", "podman", "kwok", "etcd", "vllm-router", "prometheus_client")
_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_UNIT = "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True))
_ATTACHED = "|".join(re.escape(u) for u in ATTACHED)
# A number (or an en-dash range), then a unit: spaced or attached; nothing that continues a word, number or version.
FIGURE = re.compile(rf"(?<![\w.,/-])(?:{_NUM})(?:\s?–\s?(?:{_NUM}))?"
                    rf"(?:\s?(?:{_UNIT})(?![A-Za-z])|(?:{_ATTACHED})(?![A-Za-z]))?(?!\.?\d)")
VERSION_BEFORE = re.compile(rf"(?:\b(?:{'|'.join(re.escape(w) for w in VERSIONED)})\s(?:≥\s?)?v?)$")


def prose(text: str) -> str:
    """The README without what the figure rule does not read: code blocks, inline code, link targets, comments."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)\s]*\)", "]", text)


def figures(text: str) -> list[str]:
    """Every figure of `text`'s prose, as written (the rule is in the module's docstring)."""
    text = prose(text)
    out = []
    for m in FIGURE.finditer(text):
        fig = m.group(0)
        if fig[-1].isdigit() and "." not in fig:
            continue  # an integer without a unit: a count, a port, an issue number
        if VERSION_BEFORE.search(text[: m.start()]):
            continue  # "Python 3.11", "Go ≥ 1.26"
        out.append(fig)
    return out


def measured(figure: str, text: str) -> bool:
    """`figure` stands alone somewhere in `text` (not inside a longer number or word)."""
    return re.search(rf"(?<![\w.,]){re.escape(figure)}(?![A-Za-z0-9]|\.\d)", text) is not None


def test_readme_is_under_300_lines():
    n = len(README.read_text().splitlines())
    assert n < MAX_LINES, f"README.md has {n} lines: move detail into docs/"


def test_every_figure_the_readme_quotes_is_in_the_benchmarks():
    quoted = figures(README.read_text())
    assert len(quoted) >= 20, quoted  # the rule still reads the README's figures
    bench = BENCHMARKS.read_text()
    missing = [f for f in quoted if not measured(f, bench)]
    assert not missing, f"README figures that docs/benchmarks.md does not give, as written: {missing}"


@pytest.mark.parametrize(("text", "expected"), [
    ("reload 0.074 s against **1.096 s**, 14.9× faster", ["0.074 s", "1.096 s", "14.9×"]),
    ("22–23 % to spare, 3.6x fewer, a 32,768-token prompt, 441 passed",
     ["22–23 %", "3.6x", "32,768-token", "441 passed"]),
    ("ratio 1.41 at 1,000 resources on 2 cores, port 8000, issue 37", ["1.41"]),
    ("vLLM 0.26.0 + LMCache 0.5.3 on 127.0.0.1, Python 3.11, Go ≥ 1.26, helm v4.3", []),
    ("Llama-3.1-8B, Qwen2.5-7B on an H200 (sm_90), RTX 4090, 30 seconds", []),
    ("`0.5 s` in code, [a 9.9 s run](docs/x.md#a-7.7-s)\n```\n1.5 GiB\n```\n", ["9.9 s"]),  # link text is prose
])
def test_the_figure_rule(text, expected):
    assert figures(text) == expected


def test_a_figure_is_found_only_where_it_stands_alone():
    assert measured("0.074 s", "TTFT **0.074 s** (recompute)")
    assert not measured("0.074 s", "took 10.074 s")
    assert not measured("1.4", "ratio 1.41")
    assert not measured("5 s", "after 5 sec")


def test_readme_has_exactly_the_two_setup_commands():
    text = README.read_text()
    setup = text.split("\n## Set up\n", 1)[1].split("\n## ", 1)[0]
    assert commands(setup) == SETUP
    assert [c for c in commands() if c.startswith("make ")] == SETUP
    # No other make target, as a command or named in the prose.
    assert sorted(set(re.findall(r"`make ([\w-]+)", text))) == ["demo", "test"]


def test_readme_shows_an_example_as_it_is():
    """The quick start's YAML is examples/cpu-tier-qwen25-7b.yaml, which the quick start applies."""
    (shown,) = [d for d in map(yaml.safe_load, re.findall(r"```yaml\n(.*?)```", README.read_text(), flags=re.S))
                if d.get("kind") == "KVOffloadServe"]
    assert f"kubectl apply -f examples/{shown['metadata']['name']}.yaml" in commands()
    assert shown == yaml.safe_load((ROOT / "examples" / f"{shown['metadata']['name']}.yaml").read_text())


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    markdown = re.sub(r"```.*?```", "", markdown, flags=re.S)
    headings = re.findall(r"^#+ (.*)$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_links_point_at_files_and_headings_that_exist():
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]*))?\)", README.read_text())
    assert links
    missing = [f for f, _ in links if not f.startswith("http") and not (ROOT / f).exists()]
    assert not missing, missing
    broken = [f"{f}#{a}" for f, a in links if a and a not in anchors((ROOT / f).read_text())]
    assert not broken, broken
    linked = {f for f, _ in links if f.startswith("docs/")}
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} <= linked, "a docs page the README does not list"


def test_every_readme_command_is_run_somewhere():
    # docker: the image build lines, run by tests/images/test_image_builds.py (with podman).
    others = [c for c in commands() if not c.startswith(("kvoffload ", "kubectl ", "helm ", "make ", "docker "))]
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
    res = subprocess.run([sys.executable, "-m", "kvoffload.cli", *shlex.split(plan)[1:]], cwd=ROOT, capture_output=True,
                         text=True)
    # The first fenced block after the console block that shows the command.
    after = README.read_text().split("$ kvoffload plan ", 1)[1].split("\n```\n", 1)[1]
    shown = re.match(r"\s*```\n(.*?)```", after, flags=re.S)
    assert shown and shown.group(1).strip(), "no output shown after `kvoffload plan`"
    for line in shown.group(1).strip().splitlines():
        assert line in res.stdout, line
