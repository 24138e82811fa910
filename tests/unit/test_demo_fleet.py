"""The demo's fleet (tests/cluster/nodes.yaml) holds every example at once, under any placement.

`make demo` applies examples/ together and waits for each to be Ready; kube-scheduler spreads pods,
so a fleet that fits only under a lucky placement fails (a 1-GPU pod on every 8-GPU server left
tp8-llama33-70b nowhere to go). The check is adversarial: for each pod, the other pods try to block
every node it may use; it must still find one.
"""

from __future__ import annotations

import yaml

from kvoffload.api.quantity import to_bytes
from kvoffload.controller import pipeline
from kvoffload.rendering import render
from kvtest import ROOT
from kvtest.fleet import render_nodes
from kvtest.specs import EXAMPLE_SETTINGS, EXAMPLES

RESOURCES = ("cpu", "memory", "nvidia.com/gpu", "ephemeral-storage")


def qty(v: str) -> float:
    v = str(v)
    return int(v[:-1]) / 1000 if v.endswith("m") else float(to_bytes(v, "quantity"))


def demo_pods() -> list[dict]:
    """One entry per pod the examples make: name, requests, nodeSelector (the examples the operator accepts)."""
    pods = []
    for path in EXAMPLES:
        doc = yaml.safe_load(path.read_text())
        if "as-seen-in-the-field" in doc["metadata"]["name"]:
            continue  # refused (ConfigValid=False): no pods
        owner = render.Owner(doc["metadata"]["name"], doc["metadata"]["namespace"])
        d = pipeline.desired(owner.name, owner.namespace, "", doc["spec"], EXAMPLE_SETTINGS)
        sts = next(c for c in d.children if c["kind"] == "StatefulSet")
        spec = sts["spec"]["template"]["spec"]
        req = {r: 0.0 for r in RESOURCES}
        # spec.offload.server PerNode: a replica alone on its node needs room for that node's server beside it.
        server = [render.shared_server_pod(owner, d.spec, d.budget, EXAMPLE_SETTINGS)] if d.spec.offload.shared else []
        for c in [c for p in (spec, *server) for c in p["containers"]]:
            for r, v in c.get("resources", {}).get("requests", {}).items():
                req[r] = req.get(r, 0.0) + qty(v)
        for _ in range(sts["spec"]["replicas"]):
            pods.append({"name": doc["metadata"]["name"], "requests": req, "selector": spec.get("nodeSelector", {}),
                         "tolerations": spec.get("tolerations", [])})
    return pods


def fleet() -> list[dict]:
    return render_nodes(yaml.safe_load((ROOT / "tests" / "cluster" / "nodes.yaml").read_text())["pools"])


def fits(pod: dict, node: dict) -> bool:
    labels = node["metadata"]["labels"]
    if any(labels.get(k) != v for k, v in pod["selector"].items()):
        return False
    if node["spec"].get("taints"):
        return False  # no example tolerates a taint
    cap = node["status"]["allocatable"]
    return all(pod["requests"].get(r, 0) <= qty(cap.get(r, "0")) for r in RESOURCES)


def test_every_example_pod_has_a_node_under_any_placement():
    pods, nodes = demo_pods(), fleet()
    assert any(p["requests"]["nvidia.com/gpu"] == 8 for p in pods), "tp8-llama33-70b is among the examples"
    for i, pod in enumerate(pods):
        mine = [n for n in nodes if fits(pod, n)]
        assert mine, f"{pod['name']} fits no node of the fleet"
        others = [o for j, o in enumerate(pods) if j != i and any(fits(o, n) for n in mine)]
        # A node is lost to `pod` once its free GPUs drop below what `pod` asks: the others can take at
        # most one node each, and no more nodes than their GPUs can fill that far.
        blockable = 0
        for n in mine:
            need = int(qty(n["status"]["allocatable"]["nvidia.com/gpu"])) - int(pod["requests"]["nvidia.com/gpu"]) + 1
            blockable = max(blockable, min(len(others),
                                           int(sum(o["requests"]["nvidia.com/gpu"] for o in others) // need)))
        assert blockable < len(mine), (
            f"{pod['name']}: the other {len(others)} pods can block all {len(mine)} nodes it fits")
        # Memory too: every pod it may share a node with, stacked on one node, leaves room for it.
        for n in mine:
            stacked = sum(o["requests"]["memory"] for o in others if fits(o, n)) + pod["requests"]["memory"]
            assert stacked <= qty(n["status"]["allocatable"]["memory"]), (pod["name"], n["metadata"]["name"])


def test_the_workstation_example_has_the_workstation_to_itself():
    ws = next(p for p in demo_pods() if p["name"] == "workstation-llama31-8b")
    (node,) = [n for n in fleet() if fits(ws, n)]
    assert [p["name"] for p in demo_pods() if fits(p, node)] == ["workstation-llama31-8b"]
