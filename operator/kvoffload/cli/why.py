"""`kubectl kvs why NAME`: a KVOffloadServe's state in plain words.

`explain` is pure: it reads the resource, its StatefulSet, its pods and recent events (as the API
returns them) and says what is going on, what Helm --wait / Flux make of it, and what to do next.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..api import pod_status
from ..api.quantity import format_bytes
from ..engine import router as engine_router
from ..rendering import shared_cache

HINTS = {  # Ready/Stalled reason -> what a person does next
    "InvalidSpec": "Fix the field named above and apply again; nothing "
                   "was created or changed while the spec is refused.",
    "ApplyRefused": "The API server refused a child (quota, admission policy, the operator's RBAC): fix the cause "
                    "named above; the operator retries by itself.",
    "NameConflict": "An object of that name belongs to someone else: rename this resource or remove that object; the "
                    "operator retries by itself and never takes it over.",
    "Unschedulable": "No node can take the pod: add nodes with that capacity, or lower spec.offload.cpu.size / "
                     "spec.resources (see `kubectl kvs plan`).",
    "PodsFailing": "Look at the pod: `kubectl describe pod` and `kubectl logs` (image, engine arguments, GPU memory).",
    "RollingOut": "The StatefulSet is replacing pods with the new spec; wait, or watch `kubectl get pods -w`.",
    "ReplicasNotReady": "Pods are starting (model download and load can take minutes); watch `kubectl get pods -w`.",
    "RouterNotReady": "The replicas are ready, the router in front of them (spec.routing) is not: `kubectl describe "
                      "deployment NAME-router`; its /readiness answers 503 until it has discovered a healthy serving "
                      "pod (its Role must let it list and watch pods).",
}


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type", ""): c for c in (obj.get("status") or {}).get("conditions") or []}


def kstatus(obj: dict[str, Any]) -> tuple[str, str]:
    """What kstatus (Helm v4 --wait, Flux) computes for this object, by its generic rules."""
    meta, st = obj["metadata"], obj.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "Terminating", "being deleted"
    if "observedGeneration" in st and st["observedGeneration"] != meta.get("generation"):
        return "InProgress", (f"generation {meta.get('generation')} not yet rolled out "
                              f"(status is at {st['observedGeneration']})")
    conds = _conditions(obj)
    if conds.get("Reconciling", {}).get("status") == "True":
        return "InProgress", conds["Reconciling"].get("reason", "")
    if conds.get("Stalled", {}).get("status") == "True":
        return "Failed", conds["Stalled"].get("reason", "")
    if conds.get("Ready", {}).get("status") in ("False", "Unknown"):
        return "InProgress", conds["Ready"].get("reason", "")
    return "Current", "ready" if conds.get("Ready", {}).get("status") == "True" else "no conditions"


def verdict(obj: dict[str, Any]) -> list[str]:
    meta, st = obj["metadata"], obj.get("status") or {}
    conds, gen = _conditions(obj), meta.get("generation")
    if meta.get("deletionTimestamp"):
        held = ", ".join(meta.get("finalizers") or []) or "nothing"
        return [f"Being deleted (since {meta['deletionTimestamp']}); finalizers holding it: {held}."]
    if not conds:
        return ["No status from the operator yet. Is the kvoffload operator running, and does it watch this namespace?"]
    ready, stalled = conds.get("Ready", {}), conds.get("Stalled", {})
    if ready.get("observedGeneration") not in (None, gen):
        return [f"The operator has not looked at generation {gen} yet (the conditions below are about generation "
                f"{ready.get('observedGeneration')}). Is the operator running?"]
    if stalled.get("status") == "True" or conds.get("ConfigValid", {}).get("status") == "False":
        c = stalled if stalled.get("status") == "True" else conds["ConfigValid"]
        return ["Refused: the operator cannot act on this spec.", f"  {c.get('message', '')}",
                HINTS.get(c.get("reason", ""), HINTS["InvalidSpec"])]
    if ready.get("status") == "True" and st.get("observedGeneration") == gen:
        return [f"Ready: {ready.get('message', '')}."]
    reason = ready.get("reason", "")
    lines = [f"Not ready yet ({reason}): {ready.get('message', '')}."]
    if reason in HINTS:
        lines.append(HINTS[reason])
    return lines


def _ago(stamp: str | None, now: datetime) -> str:
    if not stamp:
        return ""
    try:
        then = datetime.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=now.tzinfo)
    except ValueError:
        return stamp
    s = max(0, int((now - then).total_seconds()))
    return f"{s}s ago" if s < 120 else f"{s // 60}m ago" if s < 7200 else f"{s // 3600}h ago"


def _budget(st: dict[str, Any]) -> list[str]:
    b = st.get("budget") or {}
    if not b:
        return ["  (not computed: the spec has not been accepted yet)"]
    tiers = [f"{t['name']} {t['tokens']:,} tokens ({format_bytes(t['bytes'])}, {t['sequences']} full-context sequences)"
             for t in b.get("tiers", [])]
    mem = b.get("memory") or {}
    out = ["  KV cache per replica: " + "; ".join(tiers)]
    out.append(f"  Pod memory request = limit: {format_bytes(mem.get('limit', 0))}; /dev/shm "
               f"{format_bytes(b.get('shm', 0))}")
    out += [f"  warning: {w}" for w in b.get("warnings", [])]
    return out


def _children(sts: dict[str, Any] | None, pods: list[dict[str, Any]]) -> list[str]:
    if sts is None:
        return ["  No StatefulSet (none is created while the spec is refused)."]
    s = sts.get("status") or {}
    want = (sts.get("spec") or {}).get("replicas", 0)
    out = [f"  StatefulSet {sts['metadata']['name']}: {s.get('readyReplicas', 0)}/{want} ready, "
           f"{s.get('updatedReplicas', 0)} on the newest revision"]
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        ps = pod.get("status") or {}
        where = (pod.get("spec") or {}).get("nodeName") or "no node"
        why = ""
        if (scheduled := pod_status.condition(pod, "PodScheduled")) and scheduled.get("status") == "False":
            why = f" — unschedulable: {scheduled.get('message', '')}"
        for cs in ps.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting")
            if waiting:
                why = f" — {cs.get('name')} waiting: {waiting.get('reason', '')}"
        out.append(f"  pod {pod['metadata']['name']}: {ps.get('phase', 'Unknown')} on {where}, "
                   f"{'ready' if pod_status.ready(pod) else 'not ready'}{why}")
    return out


def _autoscaling(obj: dict[str, Any]) -> list[str]:
    a, st = (obj.get("spec") or {}).get("autoscaling"), (obj.get("status") or {}).get("autoscaling") or {}
    if not a:
        return []
    lines = ["", "Autoscaling:",
             f"  {a.get('minReplicas', 1)} to {a['maxReplicas']} replicas by {st.get('autoscaler', 'its autoscaler')}; "
             f"it owns spec.replicas (now {(obj.get('spec') or {}).get('replicas')}): leave it out of manifests"]
    if st:
        lines.append(f"  {st.get('reason', '')}: {st.get('message', '')}")
    return lines


def _routing(obj: dict[str, Any]) -> list[str]:
    r = (obj.get("status") or {}).get("routing")
    if not r:
        return []
    figures = ", ".join(f"{tier} {credit:g}" for tier, credit in sorted((r.get("credits") or {}).items()))
    lines = ["", "Routing:", f"  vllm-router {r.get('deployment', '')}: policy {r.get('policy', '')}, "
                             f"{r.get('readyReplicas', 0)} router pod(s) ready"]
    if "maxTreeSize" in r:
        lines.append(f"  cache_aware remembers {r['maxTreeSize'] // engine_router.TREE_CHARS_PER_TOKEN:,} tokens of "
                     f"prompts per replica (--max-tree-size {r['maxTreeSize']}: "
                     f"{engine_router.TREE_CHARS_PER_TOKEN} characters per token)")
    if "workers" in r:
        lines.append(f"  kv_aware indexes the KV events ({', '.join(r.get('eventTiers') or [])} tiers) of the "
                     f"{r['workers']} serving pod(s) it was started with; the router rolls when the Ready pods change")
    if r.get("unseenTiers"):
        lines.append(f"  tiers worth a hit whose KV events the engines do not publish: {', '.join(r['unseenTiers'])} "
                     "(kv_aware cannot credit their hits; cache_aware's tree budget counts them)")
    lines.append(f"  a hit's credit per offload tier (1 - reload/recompute; 0: slower than recompute): {figures}")
    return lines


def _shared(obj: dict[str, Any], servers: list[dict[str, Any]], pods: list[dict[str, Any]]) -> list[str]:
    """spec.offload.server PerNode: the node servers (their Deployments as read), what each holds, and what a prefix
    there is worth."""
    if ((obj.get("spec") or {}).get("offload") or {}).get("server") != "PerNode":
        return []
    st = obj.get("status") or {}
    tiers = {t["name"]: t for t in (st.get("budget") or {}).get("tiers", []) if t.get("bytes")}
    sizes = "; ".join(f"{label} {format_bytes(tiers[name]['bytes'])} ({tiers[name]['tokens']:,} tokens)"
                      for name, label in (("cpu", "L1 (memory)"), ("disk", "L2 (the node's disk)")) if name in tiers)
    lines = ["", "Shared cache (spec.offload.server PerNode):",
             f"  one LMCache server per node that runs replicas, shared by this resource's replicas there: "
             f"{sizes or 'no tier sized yet'}, once per node",
             "  a prefix in a node's server is a hit for every replica on that node, whichever replica computed it; "
             "a replica on another node recomputes it"]
    by_node: dict[str, list[str]] = {}
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        if node and not p["metadata"].get("deletionTimestamp"):
            by_node.setdefault(node, []).append(p["metadata"]["name"])
    seen = set()
    for d in sorted(servers, key=lambda d: (d["metadata"].get("annotations") or {}).get(shared_cache.NODE_ANNOTATION,
                                                                                         "")):
        notes = d["metadata"].get("annotations") or {}
        node = notes.get(shared_cache.NODE_ANNOTATION, "?")
        seen.add(node)
        ready = ((d.get("status") or {}).get("readyReplicas") or 0) >= 1
        replicas = ", ".join(sorted(by_node.get(node, []))) or "none"
        idle = (f"; no replica since {notes[shared_cache.IDLE_ANNOTATION]}, kept for the grace period (a replica "
                "scheduled there finds it warm)" if notes.get(shared_cache.IDLE_ANNOTATION) else "")
        lines.append(f"  node {node}: server {d['metadata']['name']} {'ready' if ready else 'NOT ready'}; "
                     f"replicas there: {replicas}{idle}")
    missing = sorted(set(by_node) - seen)
    if missing:
        lines.append(f"  nodes with replicas and no server yet: {', '.join(missing)} (the operator creates one once a "
                     "replica is bound; the replica's vLLM waits for it)")
    if not servers and not missing:
        lines.append("  no server: no replica is bound to a node yet")
    return lines


def _events(events: list[dict[str, Any]], now: datetime, limit: int = 10) -> list[str]:
    def stamp(e: dict[str, Any]) -> str:
        return e.get("lastTimestamp") or e.get("eventTime") or e.get("firstTimestamp") or ""
    recent = sorted(events, key=stamp)[-limit:]
    if not recent:
        return ["  none (events expire after an hour)"]
    return [f"  {_ago(stamp(e), now):>8}  {e.get('type', ''):7}  {e.get('reason', '')}: "
            f"{(e.get('involvedObject') or {}).get('kind', '')} {(e.get('involvedObject') or {}).get('name', '')}: "
            f"{e.get('message', '')}" for e in recent]


def explain(obj: dict[str, Any], sts: dict[str, Any] | None, pods: list[dict[str, Any]],
            events: list[dict[str, Any]], now: datetime, servers: list[dict[str, Any]] | None = None) -> str:
    """`servers`: the resource's shared server Deployments (PerNode), as read."""
    meta, st = obj["metadata"], obj.get("status") or {}
    ks, why = kstatus(obj)
    lines = [f"KVOffloadServe {meta['name']} in namespace {meta['namespace']} "
             f"(generation {meta.get('generation')})", ""]
    lines += verdict(obj)
    lines += [f"Helm --wait / Flux (kstatus) read: {ks} ({why}).", "", "Conditions:"]
    for c in (st.get("conditions") or []):
        lines.append(f"  {c.get('type', ''):14} {c.get('status', ''):8} {c.get('reason', ''):20} "
                     f"{c.get('message', '')} (since {_ago(c.get('lastTransitionTime'), now)})")
    if not st.get("conditions"):
        lines.append("  none")
    lines += ["", "Budget:"] + _budget(st)
    if st.get("endpoint"):
        lines.append(f"  Endpoint: {st['endpoint']}")
    lines += _autoscaling(obj)
    lines += _routing(obj)
    lines += _shared(obj, servers or [], pods)
    lines += ["", "Children:"] + _children(sts, pods)
    lines += ["", "Recent events:"] + _events(events, now)
    return "\n".join(lines) + "\n"
