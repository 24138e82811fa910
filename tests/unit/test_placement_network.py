"""Spread of replicas over nodes, and the optional NetworkPolicy."""

from __future__ import annotations

import dataclasses

import pytest

from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings
from kvoffload.rendering import render
from kvtest.specs import rendered, spec

children = rendered


def pod_of(s: dict) -> dict:
    return next(c for c in children(s) if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]


def test_replicas_spread_softly_over_nodes_by_default():
    (c,) = pod_of(spec(replicas=3))["topologySpreadConstraints"]
    assert c == {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
                 "labelSelector": {"matchLabels": {render.OWNER_LABEL: "svc"}}}


def test_spread_is_overridable_and_can_be_turned_off():
    zone = {"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {render.OWNER_LABEL: "svc"}}}
    assert pod_of(spec(scheduling__topologySpreadConstraints=[zone]))["topologySpreadConstraints"] == [zone]
    assert "topologySpreadConstraints" not in pod_of(spec(scheduling__topologySpreadConstraints=[]))


@pytest.mark.parametrize("bad", ["zone", [1], [{}] * 9])
def test_bad_spread_is_refused_naming_the_field(bad):
    with pytest.raises(ConfigError) as exc:
        children(spec(scheduling__topologySpreadConstraints=bad))
    assert "spec.scheduling.topologySpreadConstraints" in str(exc.value)


def test_no_network_policy_unless_asked():
    assert "NetworkPolicy" not in {c["kind"] for c in children(spec())}


def _policy(s: dict, settings: Settings = Settings()) -> dict:
    (np,) = [c for c in children(s, settings) if c["kind"] == "NetworkPolicy"]
    return np


def _rules(np: dict) -> dict[int, list[str]]:
    return {r["ports"][0]["port"]: r["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"]
            for r in np["spec"]["ingress"]}


def test_network_policy_allows_named_namespaces_only():
    np = _policy(spec(networkPolicy={"servingFrom": ["gateway", "apps"]}))
    assert np["metadata"]["name"] == "svc" and np["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert np["spec"]["podSelector"] == {"matchLabels": {render.OWNER_LABEL: "svc"}}
    assert np["spec"]["policyTypes"] == ["Ingress"]
    # Serving port: the named namespaces; metrics port: the default monitoring namespace.
    assert _rules(np) == {render.HTTP_PORT: ["apps", "gateway"], 9400: ["monitoring"]}
    for r in np["spec"]["ingress"]:
        assert r["from"][0]["namespaceSelector"]["matchExpressions"][0]["key"] == "kubernetes.io/metadata.name"


def test_operator_namespace_reaches_the_metrics_port_for_its_probe():
    settings = dataclasses.replace(Settings(), operator_namespace="kvoffload-system")
    np = _policy(spec(networkPolicy={"servingFrom": [], "metricsFrom": ["prom"]}), settings)
    assert _rules(np) == {9400: ["kvoffload-system", "prom"]}
    np = _policy(spec(networkPolicy={"metricsFrom": []}), dataclasses.replace(settings, probe_exporters=False))
    assert np["spec"]["ingress"] == []  # nothing reaches the pods


def test_network_policy_without_exporter_has_no_metrics_rule():
    np = _policy(spec(networkPolicy={"servingFrom": ["gateway"]}, metrics__enabled=False))
    assert _rules(np) == {render.HTTP_PORT: ["gateway"]}


@pytest.mark.parametrize("bad", [["Bad_NS"], ["a", "a"], "gateway"])
def test_bad_namespaces_are_refused_naming_the_field(bad):
    with pytest.raises(ConfigError) as exc:
        children(spec(networkPolicy={"servingFrom": bad}))
    assert "spec.networkPolicy.servingFrom" in str(exc.value)
