"""Dockerfiles read without a Docker engine: instructions, ARG defaults, the serving image's path."""

from __future__ import annotations

import re
from pathlib import Path

from .paths import ROOT

OPERATOR = ROOT / "images" / "operator" / "Dockerfile"
SERVING = ROOT / "images" / "serving" / "Dockerfile"
ROUTER = ROOT / "images" / "router" / "Dockerfile"


class Dockerfile:
    """Instructions of a Dockerfile (continuations joined, comments dropped) with ARG defaults resolved."""

    def __init__(self, path: Path, build_args: dict[str, str] | None = None):
        self.path = path
        self.text = path.read_text()
        self.instructions: list[tuple[str, str]] = []
        buf = ""
        for line in self.text.splitlines():
            if not buf and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.rstrip().endswith("\\"):
                buf += line.rstrip()[:-1] + " "
                continue
            buf += line
            op, _, rest = buf.strip().partition(" ")
            self.instructions.append((op.upper(), rest.strip()))
            buf = ""
        self.args: dict[str, str] = dict(build_args or {})  # `--build-arg`s win over the defaults
        for op, rest in self.instructions:
            if op == "ARG" and "=" in rest:
                k, v = rest.split("=", 1)
                self.args.setdefault(k, self.expand(v.strip('"')))  # a default may use earlier ARGs

    def expand(self, text: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: self.args.get(m.group(1) or m.group(2), m.group(0)), text)

    def all(self, op: str) -> list[str]:
        return [self.expand(rest) for o, rest in self.instructions if o == op]

    def labels(self) -> dict[str, str]:
        out = {}
        for rest in self.all("LABEL"):
            for k, v in re.findall(r'([\w.\-]+)="([^"]*)"', rest):
                out[k] = v
        return out


    def build_commands(self) -> dict[str, dict[str, str]]:
        """The `docker build` commands in the header comment: image tag -> its --build-args."""
        text = re.sub(r"\\\n#\s*", " ", "\n".join(line for line in self.text.splitlines() if line.startswith("#")))
        return {m.group(2): dict(re.findall(r"--build-arg (\w+)=(\S+)", m.group(1)))
                for m in re.finditer(r"docker build (.*?)-t (\S+)", text)}


def serving(image: str) -> Dockerfile:
    """The serving Dockerfile as the header's build command for `image` builds it (its --build-args applied)."""
    return Dockerfile(SERVING, Dockerfile(SERVING).build_commands()[image])
