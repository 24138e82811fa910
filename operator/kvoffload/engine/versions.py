"""What the serving pod really runs: the versions file, from the image to the operator.

An init container of the serving image runs REPORT_SCRIPT (stdlib only: importlib.metadata), which
writes {"vllm": "0.26.0", "lmcache": "0.5.3", "torch": "2.11.0+cu130"} (null for a package the
image lacks) to VERSIONS_FILE on a small emptyDir. The exporter reads it with `parse` and serves
`kvoffload_engine_info{vllm,lmcache,torch} 1`; the operator's probe reads that and compares it with
the pair it rendered for (`matches`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

PACKAGES = ("vllm", "lmcache", "torch")
ENGINE_DIR = "/var/run/kvoffload/engine"
VERSIONS_FILE = f"{ENGINE_DIR}/versions.json"
NOT_INSTALLED = "none"  # label value for a package the image lacks ("" would mean "no label")

# Run as `python3 -c REPORT_SCRIPT <file>`. Written through a temporary name so that a reader never
# sees half a file; never fails for a missing package (that is what it reports).
REPORT_SCRIPT = """\
import importlib.metadata as m, json, os, sys
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
found = {name: version(name) for name in ("vllm", "lmcache", "torch")}
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(found, f)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
print("kvoffload: engine versions", json.dumps(found))
"""

_MAX_LEN = 64  # a version string longer than this is not one


@dataclass(frozen=True)
class EngineVersions:
    vllm: str
    lmcache: str
    torch: str

    def labels(self) -> dict[str, str]:
        return {"vllm": self.vllm, "lmcache": self.lmcache, "torch": self.torch}


def parse(text: str) -> EngineVersions:
    """The versions file -> EngineVersions (NOT_INSTALLED for null). ValueError says what is wrong."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    found: dict[str, str] = {}
    for name in PACKAGES:
        value = doc.get(name, None)
        if value is None:
            found[name] = NOT_INSTALLED
        elif isinstance(value, str) and 0 < len(value) <= _MAX_LEN and value.isprintable():
            found[name] = value
        else:
            raise ValueError(f"{name}: {value!r} is not a version string")
    return EngineVersions(**found)


def public(version: str) -> str:
    """The public part of a PEP 440 version: 2.11.0+cu130 -> 2.11.0 (local builds of one release)."""
    return version.split("+", 1)[0]


def matches(rendered: str, running: str) -> bool:
    return running != NOT_INSTALLED and public(running) == public(rendered)
