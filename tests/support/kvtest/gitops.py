"""GitOps test tools (tests/gitops/build.sh builds them, cached under ~/.cache/kvoffload): Argo CD's
Lua health runner, the kstatus checker and Flux's controllers (kvtest.flux runs those); and the
captured-fixture helpers of the Argo CD table."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from . import background
from .paths import ROOT

HERE = ROOT / "tests" / "gitops"
HEALTH_LUA = ROOT / "charts/kvoffload-operator/argocd/health.lua"
ARGO_DIR = HERE / "argocd/kvoffload.io/KVOffloadServe"  # Argo CD's resource_customizations/<group>/<kind> form
TABLE = ARGO_DIR / "health_test.yaml"
PLACEHOLDER_NS = "demo"
PLACEHOLDER_TIME = "2026-01-01T00:00:00Z"


@functools.lru_cache(maxsize=1)
def tools() -> dict[str, str]:
    """name -> path of each built tool; skips (fails under KVO_REQUIRE_CLUSTER) without Go."""
    if shutil.which("go") is None:
        if os.environ.get("KVO_REQUIRE_CLUSTER"):
            pytest.fail("go is needed to build the GitOps test tools (tests/gitops/build.sh)", pytrace=False)
        pytest.skip("go not found: tests/gitops/build.sh cannot build the GitOps test tools")
    background.wait("flux")  # tests/gitops/flux/build.sh, which build.sh runs last, started by `make test`
    out = subprocess.run([str(HERE / "build.sh")], check=True, capture_output=True, text=True, timeout=1800).stdout
    return dict(line.split("=", 1) for line in out.split())


def lua_health(objs: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Argo CD's verdict (status, message) for each object, by health.lua on gopher-lua."""
    data = json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})
    out = subprocess.run([tools()["argocd-health"], "-script", str(HEALTH_LUA), "-"], input=data, text=True,
                         capture_output=True, check=True, timeout=60).stdout
    return [json.loads(line) for line in out.splitlines()]


def normalize(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    """A live object as a checked-in fixture: no uid/resourceVersion/managedFields, fixed namespace and times."""
    meta = obj["metadata"]
    keep = {"name": meta["name"], "namespace": PLACEHOLDER_NS, "generation": meta["generation"]}
    for key in ("deletionTimestamp", "finalizers"):
        if key in meta:
            keep[key] = PLACEHOLDER_TIME if key == "deletionTimestamp" else meta[key]
    out = {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": keep, "spec": obj.get("spec")}
    if "status" in obj:
        out["status"] = obj["status"]
    text = json.dumps(out).replace(f".{namespace}.", f".{PLACEHOLDER_NS}.")
    text = text.replace(f"/{namespace}/", f"/{PLACEHOLDER_NS}/")
    out = json.loads(text)
    for c in (out.get("status") or {}).get("conditions") or []:
        c["lastTransitionTime"] = PLACEHOLDER_TIME
    return out


def shape(node: Any, generation: int | None = None) -> Any:
    """What must not drift between captures: keys, types, and each condition's type/status/reason and
    whether it is about the object's current generation (messages, numbers and node names may)."""
    if isinstance(node, dict):
        if "metadata" in node and "generation" in node.get("metadata", {}):
            generation = node["metadata"]["generation"]
        return {k: (sorted((c["type"], c["status"], c["reason"], c.get("observedGeneration") == generation) for c in v)
                    if k == "conditions" else shape(v, generation)) for k, v in sorted(node.items())}
    if isinstance(node, list):
        return [shape(node[0], generation)] if node else []
    if isinstance(node, bool):
        return "bool"
    if isinstance(node, (int, float)):
        return "number"
    return type(node).__name__


def read_fixture(name: str) -> dict[str, Any]:
    return yaml.safe_load((ARGO_DIR / "testdata" / f"{name}.yaml").read_text())


def write_fixture(name: str, obj: dict[str, Any]) -> None:
    path = ARGO_DIR / "testdata" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    head = ("# Captured from the real API server by tests/integration/test_gitops.py "
            "(KVO_CAPTURE_GITOPS_FIXTURES=1); do not edit by hand.\n")
    path.write_text(head + yaml.safe_dump(obj, sort_keys=False, width=120))


def kstatus_file(obj: dict[str, Any]) -> dict[str, Any]:
    """kstatus' verdict (status, message, conditions) for one object, computed offline (kstatus-check -file)."""
    out = subprocess.run([tools()["kstatus-check"], "-file", "-"], input=json.dumps(obj), text=True,
                         capture_output=True, check=True, timeout=60).stdout
    return json.loads(out)
