"""The tests read as specs: they build specs and list children through kvtest (tests/support), and no test module
imports another test module (shared builders live in kvtest, shared fixtures in a conftest)."""

from __future__ import annotations

import ast

from kvoffload.rendering import render
from kvtest import ROOT
from kvtest import specs as kvspecs


def _imports(path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append("." * node.level + (node.module or ""))
    return out


def test_no_test_module_imports_another():
    files = [p for p in (ROOT / "tests").rglob("*.py") if "support" not in p.parts and "fixtures" not in p.parts]
    test_modules = {p.stem for p in files if p.stem.startswith("test_")} | {"helpers"}
    bad = [(str(p.relative_to(ROOT)), m) for p in files for m in _imports(p)
           if m.lstrip(".").split(".")[-1] in test_modules
           or m.lstrip(".").split(".")[0] in ("unit", "integration", "engine")]
    assert not bad, bad


def test_the_children_lister_reads_the_renderers_own_kinds():
    assert kvspecs.CHILD_KINDS == tuple(kind for _, kind in render.CHILD_KINDS)
    assert kvspecs.child_resources() == ("configmaps", "services", "serviceaccounts", "roles", "rolebindings",
                                         "statefulsets",
                                         "deployments", "poddisruptionbudgets", "networkpolicies",
                                         "horizontalpodautoscalers")
    kinds = {c["kind"] for c in kvspecs.rendered(kvspecs.spec(networkPolicy={"servingFrom": ["apps"]}, autoscaling={
        "maxReplicas": 4, "targets": {"waitingRequestsPerReplica": 4}}, routing={}))}
    assert kinds == set(kvspecs.CHILD_KINDS)
