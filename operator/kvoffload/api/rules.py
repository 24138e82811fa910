"""Validation rules declared once: each yields its CEL rule for the CRD (api/crd.py puts it on the schema
node it belongs to) and its Python check for the parser (api/spec.py), with one message.

The Python check reads the same object the CEL rule sees, the spec as written (CEL's `has()` is
"set in the object"), so the API server and the operator refuse exactly the same specs; the parser runs
the checks after every field is type-checked. A rule with `explain` also gives the API server a
messageExpression that renders the same text (naming the offending value), so both say the same thing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import managed
from .errors import ConfigError
from .quantity import to_bytes


def get(obj: Any, path: str) -> Any:
    """The value at a dotted path of a spec as written, or None when any part is unset."""
    for part in path.split("."):
        if not isinstance(obj, dict) or obj.get(part) is None:
            return None
        obj = obj[part]
    return obj


@dataclass(frozen=True)
class Rule:
    at: str  # the spec path whose schema node carries the CEL rule: "spec", "spec.offload", "spec.engine.env"
    cel: str  # the CEL rule over `self`, the value at `at`
    message: str  # the API server's message, and the parser's when there is no explain
    holds: Callable[[Any], bool]  # the same rule in Python, over the value at `at` (as written)
    field: str = ""  # CEL fieldPath, relative to `at` (".disk"): the field the error names
    message_expression: str = ""  # CEL messageExpression; renders what `explain` returns
    explain: Callable[[Any], str] | None = None

    @property
    def path(self) -> str:
        return self.at + self.field

    def cel_dict(self) -> dict[str, str]:
        out = {"rule": self.cel, "message": self.message}
        if self.message_expression:
            out["messageExpression"] = self.message_expression
        if self.field:
            out["fieldPath"] = self.field
        return out

    def check(self, spec: dict[str, Any]) -> None:
        value = spec if self.at == "spec" else get(spec, self.at.removeprefix("spec."))
        if value is not None and not self.holds(value):
            raise ConfigError(self.path, self.explain(value) if self.explain else self.message)


def cel_str(text: str) -> str:
    """A CEL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _cel_list(items: list[str]) -> str:
    return "[" + ", ".join(cel_str(i) for i in items) + "]"


# --- spec.engine.env: variables the operator manages (api/managed.py), refused by name with the reason. The API
# server's messageExpression and the parser say the same: "A is managed by the operator: why A. why B." (A: the first
# refused variable; then the reason of every group hit). CEL's cost estimator refuses joining or concatenating the
# filtered names, and indexing a literal map of reasons, so each reason is a literal chosen by membership and the
# text is put together by format().
_GROUPS: dict[str, list[str]] = {}
for _name, _why in managed.ENV.items():
    _GROUPS.setdefault(_why, []).append(_name)
_ENV_INDEX = "{" + ", ".join(f"{cel_str(n)}: true" for n in managed.ENV) + "}"
_IS_MANAGED = f"(e.name in {_ENV_INDEX} || e.name.startsWith({cel_str(managed.ENV_PREFIX)}))"


def _managed_names(env: list[Any]) -> list[str]:
    return [e["name"] for e in env if isinstance(e, dict) and isinstance(e.get("name"), str)
            and managed.env_why(e["name"])]


def _explain_env(env: list[Any]) -> str:
    names = _managed_names(env)
    whys = [why for why, group in _GROUPS.items() if any(n in group for n in names)]
    whys += [managed.ENV_PREFIX_WHY] if any(n.startswith(managed.ENV_PREFIX) for n in names) else []
    return f"{names[0]} is managed by the operator:" + "".join(f" {why}." for why in whys)


_CEL_WHYS = [f"(self.exists(e, e.name in {_cel_list(group)}) ? {cel_str(' ' + why + '.')} : '')"
             for why, group in _GROUPS.items()]
_CEL_WHYS.append(f"(self.exists(e, e.name.startsWith({cel_str(managed.ENV_PREFIX)})) ? "
                 f"{cel_str(' ' + managed.ENV_PREFIX_WHY + '.')} : '')")
ENV = Rule(
    at="spec.engine.env",
    cel=f"self.all(e, !{_IS_MANAGED})",
    message="env may not set a variable the operator manages ("
    + "; ".join(f"{', '.join(g)}: {w}" for w, g in _GROUPS.items())
            + "; " + managed.ENV_PREFIX_WHY + ")",
    holds=lambda env: not _managed_names(env),
    message_expression=(f"'%s is managed by the operator:%s'.format([self.filter(e, {_IS_MANAGED})[0].name, "
                        + " + ".join(_CEL_WHYS) + "])"),
    explain=_explain_env,
)

# --- spec.metrics.port: the exporter may not listen where another container of the pod does; one rule per port.
def _port_rule(port: int, who: str) -> Rule:
    return Rule(at="spec.metrics.port", cel=f"self != {port}",
                message=f"{port} is {who}: pick another port for the exporter",
                holds=lambda value: value != port)


METRICS_PORTS = tuple(_port_rule(port, who) for port, who in managed.PORTS.items())

# --- cross-field rules
KV_HEADS = Rule(
    at="spec.model.architecture",
    cel="!has(self.kvHeads) || !has(self.attentionHeads) || self.attentionHeads % self.kvHeads == 0",
    field=".kvHeads", message="kvHeads must divide attentionHeads",
    holds=lambda a: get(a, "kvHeads") is None or get(a, "attentionHeads") is None
    or a["attentionHeads"] % a["kvHeads"] == 0,
)
DISK_PATH_NORMALIZED = Rule(
    at="spec.offload.disk.path",
    cel="!self.matches('(^|/)[.][.]?(/|$)') && !self.contains('//')",
    message="path must be absolute and normalized: no '.', '..' or '//' segments",
    holds=lambda p: not isinstance(p, str) or (re.search(r"(^|/)[.][.]?(/|$)", p) is None and "//" not in p),
)
DISK_ONE_OF = Rule(
    at="spec.offload.disk",
    cel="has(self.path) != has(self.storageClassName)",
    message="set exactly one of spec.offload.disk.path (hostPath) or "
            "spec.offload.disk.storageClassName (ephemeral volume)",
    holds=lambda d: (get(d, "path") is None) != (get(d, "storageClassName") is None),
)
# spec.offload.server: where backend lmcache-server's LMCache server runs (the first is the default; api/crd.py).
SERVER_PLACEMENTS = ("Sidecar", "PerNode")
SIDECAR, SHARED = SERVER_PLACEMENTS
SHARED_DISK_ON_NODE = Rule(
    at="spec.offload",
    cel=f"!has(self.server) || self.server != '{SHARED}' || !has(self.disk) || !has(self.disk.storageClassName)",
    field=".server",
    message=f"spec.offload.server {SHARED} keeps its L2 on the node (spec.offload.disk.path, a hostPath) or has none: "
            f"a storageClassName volume belongs to one pod; with spec.offload.disk.storageClassName the allowed value "
            f"is {SIDECAR}",
    holds=lambda o: get(o, "server") != SHARED or get(o, "disk.storageClassName") is None,
)
NODE_SELECTORS = Rule(
    at="spec",
    cel="!has(self.offload.disk) || !has(self.offload.disk.nodeSelector) || !has(self.scheduling) "
        "|| !has(self.scheduling.nodeSelector) "
        "|| self.offload.disk.nodeSelector.all(k, !(k in self.scheduling.nodeSelector) "
        "|| self.scheduling.nodeSelector[k] == self.offload.disk.nodeSelector[k])",
    field=".offload.disk.nodeSelector",
    message="spec.offload.disk.nodeSelector and spec.scheduling.nodeSelector disagree on a label",
    holds=lambda s: all((get(s, "scheduling.nodeSelector") or {}).get(k, v) == v
                        for k, v in (get(s, "offload.disk.nodeSelector") or {}).items()),
)


def _memory_holds(s: dict[str, Any]) -> bool:
    # The parser has checked both quantities by now.
    memory, cpu = get(s, "resources.memory"), get(s, "offload.cpu.size")
    return memory is None or cpu is None or to_bytes(memory,
                                                     "spec.resources.memory") >= to_bytes(cpu, "spec.offload.cpu.size")


MEMORY_HOLDS_CPU_TIER = Rule(
    at="spec",
    cel="!has(self.resources) || !has(self.resources.memory) || !isQuantity(self.resources.memory) "
        "|| !isQuantity(self.offload.cpu.size) "
        "|| !quantity(self.resources.memory).isLessThan(quantity(self.offload.cpu.size))",
    field=".resources.memory",
    message="must hold at least the CPU tier (spec.offload.cpu.size): pinned memory is allocated in full",
    holds=_memory_holds,
)

# --- spec.autoscaling
_TARGETS = ("waitingRequestsPerReplica", "kvCacheUsagePercent", "queueTimeP90Milliseconds")
RECOMPUTE_REMOVED_WHY = (
    "the share of prompt tokens recomputed measures the cache, not the load: it does not fall as replicas are "
    "added (each new replica starts with empty tiers and sees the same prompts), so an autoscaler on it only grows. "
    "Use queueTimeP90Milliseconds or waitingRequestsPerReplica; the share stays the exporter's "
    "kvoffload_prompt_tokens_total{origin=\"compute\"} (the Grafana dashboard plots it)")
# Listed before AUTOSCALING_TARGETS: a spec whose only target was this one hears why first. A stored object that
# still has it stays updatable while its targets are unchanged (the API server ratchets unchanged fields' rules).
AUTOSCALING_RECOMPUTE_REMOVED = Rule(
    at="spec.autoscaling.targets",
    cel="!has(self.promptRecomputePercent)",
    field=".promptRecomputePercent",
    message="spec.autoscaling.targets.promptRecomputePercent is no longer a target: " + RECOMPUTE_REMOVED_WHY,
    holds=lambda t: get(t, "promptRecomputePercent") is None,
)
AUTOSCALING_TARGETS = Rule(
    at="spec.autoscaling.targets",
    cel=" || ".join(f"has(self.{t})" for t in _TARGETS),
    message="spec.autoscaling.targets needs at least one of " + ", ".join(_TARGETS),
    holds=lambda t: any(get(t, n) is not None for n in _TARGETS),
)
AUTOSCALING_MIN_MAX = Rule(
    at="spec.autoscaling",
    cel="!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
    field=".minReplicas", message="spec.autoscaling.minReplicas must be at most maxReplicas",
    holds=lambda a: get(a, "minReplicas") is None or get(a, "maxReplicas") is None
    or a["minReplicas"] <= a["maxReplicas"],
)
AUTOSCALING_WAKE = Rule(
    at="spec.autoscaling",
    cel="(has(self.minReplicas) && self.minReplicas == 0) == has(self.wakeQuery)",
    field=".wakeQuery",
    message="spec.autoscaling.wakeQuery is required with minReplicas 0 (scale to zero) and only then: "
            "with no replica running, nothing else says when to start one",
    holds=lambda a: (get(a, "minReplicas") == 0) == (get(a, "wakeQuery") is not None),
)
# What a backend cannot honour is declared by the backend (backends/, Backend.refuses; crd.backend_refusals).
RULES: tuple[Rule, ...] = (ENV, *METRICS_PORTS, KV_HEADS, DISK_PATH_NORMALIZED, DISK_ONE_OF, SHARED_DISK_ON_NODE,
                           NODE_SELECTORS,
                           MEMORY_HOLDS_CPU_TIER,
                           AUTOSCALING_RECOMPUTE_REMOVED, AUTOSCALING_TARGETS, AUTOSCALING_MIN_MAX, AUTOSCALING_WAKE)


def at(path: str) -> list[dict[str, str]]:
    """The CEL rules of the schema node at `path` (e.g. "spec.offload"), for the CRD."""
    return [r.cel_dict() for r in RULES if r.at == path]


def check(spec: dict[str, Any]) -> None:
    """Every rule over a spec as written; the first that fails raises its ConfigError."""
    for rule in RULES:
        rule.check(spec)
