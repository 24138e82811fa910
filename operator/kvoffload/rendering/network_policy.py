"""The optional NetworkPolicy of a KVOffloadServe (spec.networkPolicy): only the named namespaces reach
the serving port, only the monitoring namespaces (and the operator's own, for the OffloadActive probe)
reach the exporter's metrics port; nothing else reaches the pods. Egress is not restricted: vLLM
downloads weights from the Hugging Face Hub."""

from __future__ import annotations

from typing import Any

from ..api.settings import Settings
from ..api.spec import Spec

NAMESPACE_NAME = "kubernetes.io/metadata.name"  # set by the API server on every namespace


def _from(namespaces: list[str]) -> list[dict[str, Any]]:
    names = {"key": NAMESPACE_NAME, "operator": "In", "values": namespaces}
    return [{"namespaceSelector": {"matchExpressions": [names]}}]


def network_policy(meta: dict[str, Any], spec: Spec, settings: Settings, selector: dict[str, str],
                   http_port: int, router: dict[str, str] | None = None,
                   router_ports: tuple[int, ...] = ()) -> dict[str, Any] | None:
    """`router`: the labels of this resource's router pods (spec.routing), which must reach the serving port (and
    `router_ports`: the KV-event publisher's, for kv_aware)."""
    policy = spec.network_policy
    if policy is None:
        return None
    ingress: list[dict[str, Any]] = []
    if router:
        ingress.append({"from": [{"podSelector": {"matchLabels": dict(router)}}],
                        "ports": [{"protocol": "TCP", "port": p} for p in (http_port, *router_ports)]})
    if policy.serving_from:
        ingress.append({"from": _from(sorted(policy.serving_from)), "ports": [{"protocol": "TCP", "port": http_port}]})
    metrics_from = set(policy.metrics_from)
    if settings.probe_exporters and settings.operator_namespace:
        metrics_from.add(settings.operator_namespace)
    if spec.metrics_enabled and metrics_from:
        ingress.append({"from": _from(sorted(metrics_from)), "ports": [{"protocol": "TCP", "port": spec.metrics_port}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": {"matchLabels": dict(selector)}, "policyTypes": ["Ingress"], "ingress": ingress}}
