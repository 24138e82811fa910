"""The package's layers (docs/architecture.md): imports only point down."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvoffload
from kvtest import ROOT

PACKAGE = Path(kvoffload.__file__).parent
# What uses the package from outside it and must ask the backends' registry as the package does.
BENCHMARKS = sorted((ROOT / "benchmarks").rglob("*.py"))
# Each folder and the folders it may import from (besides itself).
MAY_IMPORT = {
    "api": {"engine"},
    "engine": {"api"},
    "backends": {"api", "engine"},
    "planning": {"api", "engine", "backends"},
    "rendering": {"api", "engine", "backends", "planning"},
    "controller": {"api", "engine", "backends", "planning", "rendering"},
    # engine/versions: the versions file the init container writes (stdlib only); backends: which sources to
    # read and what proves offloading (they import only light modules at run time: test_exporter_starts_small)
    "exporter": {"api", "engine", "backends"},
    "node": {"api"},
    "cli": {"api", "engine", "backends", "planning", "rendering", "controller", "exporter", "node"},
}


def imported_layers(path: Path) -> set[str]:
    """The kvoffload folders a module imports from (relative or absolute imports, at any depth in the file)."""
    layer = path.parent.name
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                continue  # its own folder
            if node.level == 2:
                target = node.module.split(".")[0] if node.module else None
                names = [target] if target else [a.name for a in node.names]
            elif (node.module or "").startswith("kvoffload."):
                names = [node.module.split(".")[1]]
            else:
                continue
            out |= {n for n in names if n != layer}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("kvoffload.")} - {layer}
    return out


def test_every_module_lives_in_a_layer():
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside the layer folders: {loose}"
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_")} == set(MAY_IMPORT)


def test_imports_only_point_down():
    wrong = {}
    for path in sorted(PACKAGE.glob("*/*.py")):
        bad = imported_layers(path) - MAY_IMPORT[path.parent.name]
        if bad:
            wrong[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert not wrong, f"imports that point up or sideways: {wrong}"


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "planning" / "x.py"
    bad.parent.mkdir()
    bad.write_text("from ..controller import pipeline\nfrom . import sizing\n")
    assert imported_layers(bad) == {"controller"}


def backend_modules_imported(path: Path) -> set[str]:
    """The backend modules (backends/<name>.py, neither the registry nor base.py) a module imports by name."""
    modules = {p.stem for p in (PACKAGE / "backends").glob("*.py")} - {"__init__", "base"}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level == 2 or (node.module or "").startswith("kvoffload.")):
            parts = (node.module or "").split(".")[0 if node.level else 1:]
            if parts[:1] == ["backends"]:
                out |= set(parts[1:2]) | ({a.name for a in node.names} if len(parts) == 1 else set())
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("kvoffload.backends.")}
    return out & modules


def test_only_the_registry_and_the_interface_of_the_backends_are_imported():
    """Outside backends/ a backend is reached through the registry (backends.get) and the interface (backends.base):
    importing one backend's module is knowing that backend by name."""
    wrong = {}
    for path in [p for p in sorted(PACKAGE.glob("*/*.py")) if p.parent.name != "backends"] + BENCHMARKS:
        if found := backend_modules_imported(path):
            wrong[str(path.relative_to(ROOT))] = sorted(found)
    assert not wrong, f"imports of one backend's module: {wrong}"


def test_the_checker_sees_a_backend_module_imported(tmp_path):
    bad = tmp_path / "exporter" / "x.py"
    bad.parent.mkdir()
    bad.write_text("from .. import backends\nfrom ..backends.base import Seen\nfrom ..backends import vllm_native, "
                   "base\nfrom ..backends.lmcache import unloaded_tokens\nimport kvoffload.backends.lmcache_server\n")
    assert backend_modules_imported(bad) == {"lmcache", "vllm_native", "lmcache_server"}


def test_exporter_starts_small():
    """The sidecar (64Mi request) imports the backends' registry, never the kubernetes client or the operator."""
    code = ("import sys, kvoffload.exporter.cli; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'kubernetes', 'kopf'}), "
            "sorted(m for m in sys.modules if m.startswith(('kvoffload.controller', 'kvoffload.planning', "
            "'kvoffload.rendering'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] []"


def test_no_backend_is_compared_by_name_outside_its_module():
    """Everything a backend does differently lives in its module (backends/): elsewhere, the benchmarks included, a
    `backend == "..."` (or `in`, `!=`) would be a second place to change when a backend is added."""
    from kvoffload import backends

    found = []
    for path in [p for p in sorted(PACKAGE.glob("*/*.py")) if p.parent.name != "backends"] + BENCHMARKS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = any(isinstance(s, ast.Constant) and s.value in backends.NAMES for s in sides)
                if named and "backend" in ast.unparse(node):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
