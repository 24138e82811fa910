"""The commands the README shows (`$ ` lines in console blocks), so tests can run every one."""

from __future__ import annotations

import re

from .paths import ROOT

README = ROOT / "README.md"


def commands(text: str | None = None) -> list[str]:
    """Each `$ ` line of every console block, as one string; a line ending in a backslash continues the command on the
    next line (as the shell reads it), so long commands wrap in the README and still run as written."""
    text = README.read_text() if text is None else text
    out = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        block = re.sub(r"[ \t]*\\\n[ \t]*", " ", block)
        out += [line[2:].strip() for line in block.splitlines() if line.startswith("$ ")]
    return out
