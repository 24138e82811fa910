"""The Helm chart against the real local control plane (tests/cluster).

- every ci/*-values.yaml scenario: `helm template`, each document applied as a server-side dry run
  with strict field validation;
- a real `helm install`, `helm upgrade` with a CRD change, `helm uninstall` keeping the CRD and
  a user's KVOffloadServe (crds.keep);
- the operator pod is admitted in a namespace enforcing Pod Security "restricted";
- the example in NOTES.txt is accepted by the API server.

The cluster is shared with other tests: everything namespaced lives in the `namespace` fixture
(or namespaces made here and deleted after), cluster-scoped objects carry a unique release name,
and the install/upgrade/uninstall test renames the CRD's API group in a copy of the chart so it
never touches the kvoffloadserves.kvoffload.io CRD that other tests use.
"""
from __future__ import annotations

import contextlib
import copy
import json
import re
import shutil
import uuid
from pathlib import Path

import pytest
import yaml

from kvoffload.api import crd
from kvoffload.cli import generate
from kvtest import ApiError

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvoffload-operator"
SCENARIOS = ("default", "namespaced", "no-crds", "monitoring", "custom-roots", "leader-election", "janitor")
EXAMPLE = ROOT / "examples" / "cpu-tier-qwen25-7b.yaml"


def uid() -> str:
    return uuid.uuid4().hex[:6]


def docs_of(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def dry_run_strict(client, docs: list[dict], namespace: str | None = None) -> list[dict]:
    """Each document applied as a server-side dry run with strict field validation (dryRun=All,
    fieldValidation=Strict: what `kubectl apply --dry-run=server --validate=strict` asks of the API
    server). An unknown field raises ApiError; nothing is stored."""
    return [client.apply(d, namespace, dry_run=True, field_validation="Strict") for d in docs]


def make_namespace(cluster, name: str, labels: dict[str, str] | None = None) -> str:
    return cluster.client.namespace(name, labels={"kvoffload.io/test": "true", **(labels or {})})


def delete_namespace(cluster, name: str) -> None:
    cluster.client.delete("namespace", name, missing_ok=True)


# Stand-ins for the Prometheus Operator's PodMonitor/ServiceMonitor CRDs: structural schemas with
# the real field names (prometheus-operator's monitoring.coreos.com_{pod,service}monitors.yaml) for
# every field the chart sets, so a server-side dry run with strict field validation catches a
# misspelt field. Created only where the cluster has none, and deleted afterwards.
def _relabel():
    return {"type": "object", "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string"}}, "separator": {"type": "string"},
        "targetLabel": {"type": "string"}, "regex": {"type": "string"}, "modulus": {"type": "integer"},
        "replacement": {"type": "string"}, "action": {"type": "string"}}}


def _endpoint():
    return {"type": "object", "properties": {
        "port": {"type": "string"}, "path": {"type": "string"}, "interval": {"type": "string"},
        "scrapeTimeout": {"type": "string"}, "relabelings": {"type": "array", "items": _relabel()}}}


def _selector():
    return {"type": "object", "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {"type": "object", "properties": {
            "key": {"type": "string"}, "operator": {"type": "string"},
            "values": {"type": "array", "items": {"type": "string"}}}}}}}


def _monitor_crd(kind: str, plural: str, spec_props: dict) -> dict:
    spec = {"type": "object", "properties": {
        "selector": _selector(), "jobLabel": {"type": "string"},
        "namespaceSelector": {"type": "object", "properties": {
            "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
        **spec_props}}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.monitoring.coreos.com", "labels": {"kvoffload.io/test": "stand-in"}},
            "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "properties": {"spec": spec}}}}]}}


MONITOR_CRDS = [
    _monitor_crd("PodMonitor", "podmonitors", {
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "podMetricsEndpoints": {"type": "array", "items": _endpoint()}}),
    _monitor_crd("ServiceMonitor", "servicemonitors", {
        "targetLabels": {"type": "array", "items": {"type": "string"}},
        "endpoints": {"type": "array", "items": _endpoint()}}),
]


@pytest.fixture(scope="module")
def monitoring_api(cluster):
    created = []
    client = cluster.client
    for c in MONITOR_CRDS:
        name = c["metadata"]["name"]
        try:
            client.create(c)
            created.append(name)
        except ApiError as exc:
            if exc.reason != "AlreadyExists":  # a real Prometheus Operator's (or another test's) stays
                raise
        client.established(name, timeout=60)
    try:
        yield
    finally:
        for name in created:
            client.delete("crd", name, missing_ok=True)


# --------------------------------------------------------------------------- ci scenarios
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ci_scenario_server_dry_run(cluster, namespace, scenario, request):
    args = ["-f", CHART / "ci" / f"{scenario}-values.yaml"]
    extra: list[str] = []
    if scenario == "namespaced":
        # The scenario's namespaces, made unique for a shared cluster (Roles need them to exist).
        extra = [make_namespace(cluster, f"{namespace[:50]}-b")]
        args += ["--set", f"watchNamespaces={{{namespace},{extra[0]}}}"]
    if scenario == "monitoring":
        request.getfixturevalue("monitoring_api")
        args += ["--api-versions", "monitoring.coreos.com/v1"]
    try:
        release = f"kvo-{uid()}"
        rendered = cluster.helm("template", release, CHART, "--namespace", namespace, *args).stdout
        docs = docs_of(rendered)
        kinds = {d["kind"] for d in docs}
        assert ("PodMonitor" in kinds) == (scenario == "monitoring")
        assert ("Role" in kinds) == (scenario in ("namespaced", "leader-election", "janitor"))
        assert ("DaemonSet" in kinds) == (scenario == "janitor")
        try:
            applied = dry_run_strict(cluster.client, docs)
        except ApiError as exc:
            raise AssertionError(f"server refused the {scenario} scenario: {exc}") from None
        assert ([(a["kind"], a["metadata"]["name"]) for a in applied]
                == [(d["kind"], d["metadata"]["name"]) for d in docs])
        # Control: validation is strict (a misspelt field is refused, not silently dropped).
        bad = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
        bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
        with pytest.raises(ApiError, match="imagePullPolicyy"):
            dry_run_strict(cluster.client, [bad])
        # Dry run: nothing of it exists afterwards.
        assert cluster.client.exists("clusterrole", f"{release}-kvoffload-operator") is False
    finally:
        for ns in extra:
            delete_namespace(cluster, ns)


def test_notes_example_is_accepted_by_the_api_server(cluster, namespace, crd_installed):
    out = cluster.helm("install", "kvo", CHART, "--namespace", namespace, "--dry-run=client").stdout
    m = re.search(r"^kubectl apply -n \S+ -f - <<'EOF'\n(.*?)^EOF$", out, re.M | re.S)
    assert m, out
    docs = docs_of(m.group(1))
    assert docs, m.group(1)
    try:
        dry_run_strict(cluster.client, docs, namespace)
    except ApiError as exc:
        raise AssertionError(f"server refused the NOTES.txt example: {exc}") from None


# --------------------------------------------------------------------------- install / upgrade / uninstall
def isolated_chart(tmp_path: Path, monkeypatch, group: str, extra_column: dict | None = None,
                   description: str | None = None) -> Path:
    """A copy of the chart whose CRD (written by the real generator) serves `group` instead of kvoffload.io."""
    chart = tmp_path / "kvoffload-operator"
    if not chart.exists():
        shutil.copytree(CHART, chart)
    real = crd.crd

    def patched():
        c = real()
        c["metadata"]["name"] = f"{crd.PLURAL}.{group}"
        c["spec"]["group"] = group
        c["spec"]["names"].pop("shortNames", None)  # `kvs` and the `all` category stay the real CRD's
        c["spec"]["names"].pop("categories", None)
        version = c["spec"]["versions"][0]
        if extra_column:
            version["additionalPrinterColumns"].insert(-1, extra_column)
        if description:
            version["schema"]["openAPIV3Schema"]["description"] = description
        return c

    with monkeypatch.context() as m:
        m.setattr(crd, "crd", patched)
        text = generate.chart()
    (chart / generate.CHART_FILE.relative_to("charts/kvoffload-operator")).write_text(text)
    return chart


def test_install_upgrade_uninstall(cluster, namespace, tmp_path, monkeypatch):
    group = f"t{uid()}.kvoffload.io"
    crd_name = f"{crd.PLURAL}.{group}"
    release = f"kvo-{uid()}"
    fullname = f"{release}-kvoffload-operator"
    chart = isolated_chart(tmp_path, monkeypatch, group)
    serve = yaml.safe_load(EXAMPLE.read_text())
    serve["apiVersion"] = f"{group}/{crd.VERSION}"
    serve["metadata"]["namespace"] = namespace
    client = cluster.client
    try:
        # -- install (Helm 4: server-side apply; --wait: the Deployment becomes Available on kwok)
        cluster.helm("install", release, chart, "--namespace", namespace, "--wait", "--timeout", "180s")
        client.established(crd_name, timeout=60)
        live = client.get("crd", crd_name)
        assert live["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert live["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
        dep = client.get("deployment", fullname, namespace)  # the API always returns managedFields
        assert dep["status"].get("availableReplicas") == 1
        assert any(f.get("manager") == "helm" and f.get("operation") == "Apply"
                   for f in dep["metadata"]["managedFields"]), "Helm 4 applies server-side"
        assert client.get("clusterrole", fullname)["rules"]
        crb = client.get("clusterrolebinding", fullname)
        assert crb["subjects"] == [{"kind": "ServiceAccount", "name": fullname, "namespace": namespace}]
        client.apply(serve)  # a user's KVOffloadServe

        # -- upgrade: a CRD change (new printer column, new description) and a settings change
        column = {"name": "Upgraded", "type": "string", "jsonPath": ".spec.model.name"}
        chart = isolated_chart(tmp_path, monkeypatch, group, extra_column=column,
                               description="Changed by the chart upgrade test.")
        cluster.helm("upgrade", release, chart, "--namespace", namespace, "--wait", "--timeout", "180s",
                     "--set", "operator.config.headroomPercent=20")
        live = client.get("crd", crd_name)
        version = live["spec"]["versions"][0]
        assert column in version["additionalPrinterColumns"]
        assert version["schema"]["openAPIV3Schema"]["description"] == "Changed by the chart upgrade test."
        # kubectl under test: the printer columns a user sees
        table = cluster.kubectl("get", f"{crd.PLURAL}.{group}", "-n", namespace).stdout
        assert "UPGRADED" in table.splitlines()[0] and "Qwen/Qwen2.5-7B-Instruct" in table, table
        cm = client.get("configmap", f"{fullname}-config", namespace)
        assert yaml.safe_load(cm["data"]["config.yaml"])["headroomPercent"] == 20
        history = json.loads(cluster.helm("history", release, "--namespace", namespace, "-o", "json").stdout)
        assert [h["revision"] for h in history] == [1, 2] and history[-1]["status"] == "deployed"

        # -- uninstall: the release's objects go, the CRD and the user's KVOffloadServe stay
        cluster.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")
        assert client.exists("deployment", fullname, namespace) is False
        assert client.exists("clusterrole", fullname) is False
        assert client.exists("serviceaccount", fullname, namespace) is False
        assert client.get("crd", crd_name)["spec"]["group"] == group
        kept = client.get(f"{crd.PLURAL}.{group}", serve["metadata"]["name"], namespace)
        assert kept["spec"]["model"]["name"] == "Qwen/Qwen2.5-7B-Instruct"
    finally:
        cluster.helm("uninstall", release, "--namespace", namespace, check=False)
        with contextlib.suppress(KeyError, ApiError):  # KeyError: the CRD was never served
            for obj in client.list(f"{crd.PLURAL}.{group}", namespace):
                client.delete(f"{crd.PLURAL}.{group}", obj["metadata"]["name"], namespace, missing_ok=True)
        client.delete("crd", crd_name, missing_ok=True)


# --------------------------------------------------------------------------- Pod Security
def test_operator_pod_admitted_under_restricted_pod_security(cluster, namespace):
    client = cluster.client
    client.label("namespace", namespace, {"pod-security.kubernetes.io/enforce": "restricted",
                                          "pod-security.kubernetes.io/enforce-version": "latest"})
    # Control: this namespace really enforces "restricted" (a plain pod is refused). The pod is the
    # one `kubectl run plain --image=busybox:1.36 --restart=Never` would create.
    plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "labels": {"run": "plain"}},
             "spec": {"containers": [{"name": "plain", "image": "busybox:1.36"}], "restartPolicy": "Never"}}
    with pytest.raises(ApiError) as refused:
        client.create(plain, namespace, dry_run=True)
    assert "violates PodSecurity" in refused.value.message, refused.value

    release = f"kvo-{uid()}"
    try:
        cp = cluster.helm("install", release, CHART, "--namespace", namespace, "--set", "crds.enabled=false")
        assert "PodSecurity" not in cp.stdout + cp.stderr, cp.stderr

        def outcome():
            """(refusals, pods): refusals show as FailedCreate events / a ReplicaFailure condition."""
            labels = {"app.kubernetes.io/instance": release}
            refusals = [e["message"] for e in client.list("events", namespace) if e.get("reason") == "FailedCreate"]
            for r in client.list("replicasets", namespace, labels=labels):
                refusals += [c["message"] for c in r["status"].get("conditions", []) if c["type"] == "ReplicaFailure"]
            pods = client.list("pods", namespace, labels=labels)
            return (refusals, pods) if refusals or pods else None

        refusals, pods = cluster.wait_until(outcome, timeout=60, message="the operator's ReplicaSet to create its pod")
        assert not refusals, "Pod Security refused the operator pod: " + "; ".join(refusals)
        assert len(pods) == 1
        # The admitted pod is the chart's, with its restricted security context.
        (c,) = pods[0]["spec"]["containers"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert pods[0]["spec"]["securityContext"]["runAsNonRoot"] is True
    finally:
        cluster.helm("uninstall", release, "--namespace", namespace, check=False)
