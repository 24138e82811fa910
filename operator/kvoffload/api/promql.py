"""PromQL a tenant writes (spec.autoscaling.wakeQuery) runs against the admin's Prometheus, and KEDA shows its value
in the tenant's ScaledObject status: it may read only its own namespace's series.

The query is parsed with promql-parser (the Rust parser of GreptimeDB, bound to Python), not matched with regular
expressions: every vector selector in it, inside ranges, subqueries and function calls too, must carry the equality
matcher namespace="<the resource's namespace>". A regex or negative matcher on namespace, or an `or` inside braces,
could widen the selection, so they are refused. A query the parser does not take is refused too: what cannot be read
cannot be checked.
"""

from __future__ import annotations

import promql_parser

from .errors import ConfigError

# What Prometheus' Kubernetes service discovery and the chart's monitors label series with.
NAMESPACE_LABEL = "namespace"


def selectors(query: str, field: str) -> list[promql_parser.VectorSelector]:
    """Every vector selector of `query`, or a ConfigError naming `field` when the query does not parse."""
    try:
        expr = promql_parser.parse(query)
    except (ValueError, TypeError) as exc:
        raise ConfigError(field, f"is not valid PromQL: {exc}") from None
    found: list[promql_parser.VectorSelector] = []
    promql_parser.walk(expr,
                       lambda node: found.append(node) if isinstance(node, promql_parser.VectorSelector) else None)
    return found


def check_scoped(query: str, namespace: str, field: str) -> None:
    """Refuse `query` unless every series it selects is in `namespace` (the condition in the module docstring)."""
    for sel in selectors(query, field):
        text = sel.prettify() if hasattr(sel, "prettify") else str(sel)
        if sel.matchers.or_matchers:
            raise ConfigError(field, f"selector {text} uses `or` between matchers: write one selector per alternative, "
                                     f'each with {NAMESPACE_LABEL}="{namespace}"')
        on_namespace = [m for m in sel.matchers.matchers if m.name == NAMESPACE_LABEL]
        if not any(m.op == promql_parser.MatchOp.Equal and m.value == namespace for m in on_namespace) or \
                any(m.op != promql_parser.MatchOp.Equal for m in on_namespace):
            raise ConfigError(field, f'selector {text} must select {NAMESPACE_LABEL}="{namespace}" (exactly, this '
                                     "resource's namespace): the admin's Prometheus holds every namespace's series")
