"""The Helm chart (charts/kvoffload-operator), rendered with the real helm binary; no cluster.

What the cluster proves (server dry-run of every ci scenario, install/upgrade/uninstall, Pod
Security admission, the operator under the chart's RBAC) is in tests/integration/test_chart_*.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import kvtest
from kvoffload.api import crd, settings
from kvoffload.api.errors import ConfigError
from kvoffload.api.spec import parse
from kvoffload.cli import generate
from kvoffload.engine import images

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvoffload-operator"
SCENARIOS = ("default", "namespaced", "no-crds", "monitoring", "custom-roots", "leader-election", "janitor")
STANDARD_LABELS = ("helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance",
                   "app.kubernetes.io/version", "app.kubernetes.io/managed-by")
# Free-form string maps: the only objects whose keys the schema cannot list.
STRING_MAPS = {"labels", "annotations", "podAnnotations", "podLabels", "nodeSelector", "routerNodeSelector"}
OBJECT_MAPS = {"imageVersions"}  # operator.config.imageVersions: image -> {vllm, lmcache}
# What the operator calls (kopf watching for cache.py; kube.py, reconcile.py, leader.py), and nothing more.
EXPECTED_RULES = {
    ("kvoffload.io", "kvoffloadserves"): {"list", "watch"},
    ("kvoffload.io", "kvoffloadserves/status"): {"patch"},
    ("", "configmaps"): {"list", "watch", "create", "patch", "delete"},
    ("", "services"): {"list", "watch", "create", "patch", "delete"},
    ("apps", "statefulsets"): {"list", "watch", "create", "patch", "delete"},
    ("policy", "poddisruptionbudgets"): {"list", "watch", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"list", "watch", "create", "patch", "delete"},
    ("autoscaling", "horizontalpodautoscalers"): {"list", "watch", "create", "patch", "delete"},
    # spec.routing: the router's Deployment, its ServiceAccount and the Role (pods list/watch) bound to it.
    ("apps", "deployments"): {"list", "watch", "create", "patch", "delete"},
    ("", "serviceaccounts"): {"list", "watch", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "roles"): {"list", "watch", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"list", "watch", "create", "patch", "delete"},
    ("", "pods"): {"list", "watch"},
    ("", "events"): {"create"},
}


class Helm:
    def __init__(self, binary: Path, home: Path):
        self.binary = binary
        self.env = {**os.environ, "KUBECONFIG": "/dev/null"}
        for key in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
            self.env[key] = str(home / key.lower())

    def __call__(self, *args, check: bool = True) -> subprocess.CompletedProcess:
        cp = subprocess.run([str(self.binary), *map(str, args)], text=True, capture_output=True,
                            env=self.env, timeout=120)
        if check and cp.returncode != 0:
            raise AssertionError(f"helm {' '.join(map(str, args))} -> {cp.returncode}\n{cp.stdout}\n{cp.stderr}")
        return cp

    def render(self, *args, chart: Path = CHART, release: str = "kvo", namespace: str = "kvo-system") -> list[dict]:
        out = self("template", release, chart, "--namespace", namespace, *args).stdout
        return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> Helm:
    binary = kvtest.bin_dir() / "helm"
    if not os.access(binary, os.X_OK):
        msg = f"helm not found at {binary}; build it with tests/cluster/build.sh"
        if os.environ.get("KVO_REQUIRE_CLUSTER"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str) -> dict:
    found = find(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def values_file(scenario: str) -> Path:
    return CHART / "ci" / f"{scenario}-values.yaml"


def operator_config(docs: list[dict]) -> dict:
    cm = [d for d in find(docs, "ConfigMap") if "config.yaml" in d.get("data", {})]
    assert len(cm) == 1, "expected one operator ConfigMap"
    return yaml.safe_load(cm[0]["data"]["config.yaml"])


def camel_settings_keys() -> set[str]:
    return {settings._camel(f.name) for f in dataclasses.fields(settings.Settings)}


# --------------------------------------------------------------------------- files, lint
def test_every_ci_scenario_is_there():
    assert sorted(p.name for p in (CHART / "ci").glob("*-values.yaml")) == \
        sorted(f"{s}-values.yaml" for s in SCENARIOS)


def test_chart_yaml():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "kvoffload-operator"
    assert chart["kubeVersion"] == ">= 1.30.0-0"
    assert str(chart["appVersion"]) == "0.1.0"
    pyproject = (ROOT / "operator" / "pyproject.toml").read_text()
    assert re.search(r'^version = "0\.1\.0"$', pyproject, re.M), "appVersion must be the kvoffload package version"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_helm_lint_strict(helm, scenario):
    cp = helm("lint", "--strict", CHART, "-f", values_file(scenario), check=False)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "[WARNING]" not in cp.stdout and "[ERROR]" not in cp.stdout, cp.stdout


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_renders(helm, scenario):
    args = ["-f", values_file(scenario)]
    if scenario == "monitoring":
        args += ["--api-versions", "monitoring.coreos.com/v1"]
    docs = helm.render(*args)
    kinds = {d["kind"] for d in docs}
    assert {"ServiceAccount", "ConfigMap", "Deployment"} <= kinds
    assert ("CustomResourceDefinition" in kinds) == (scenario != "no-crds")
    assert ("ClusterRole" in kinds) == (scenario != "namespaced")
    assert ("DaemonSet" in kinds) == (scenario == "janitor")
    assert ("PodMonitor" in kinds) == (scenario == "monitoring")


def test_kube_version_below_minimum_refused(helm):
    cp = helm("template", "kvo", CHART, "--kube-version", "1.29.0", check=False)
    assert cp.returncode != 0
    assert "kubeVersion" in cp.stderr and ">= 1.30.0-0" in cp.stderr, cp.stderr


# --------------------------------------------------------------------------- schema
def _walk(node: dict, path: str):
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")


def test_schema_is_closed_at_every_object_level():
    schema = json.loads((CHART / "values.schema.json").read_text())
    checked = 0
    for path, node in _walk(schema, "$"):
        types = node.get("type")
        if types != "object" and not (isinstance(types, list) and "object" in types):
            continue
        key = path.rsplit(".", 1)[-1]
        if path == "$.global":  # Helm's pass-through from a parent chart; this chart reads nothing from it
            continue
        if key in STRING_MAPS:
            assert node.get("additionalProperties") == {"type": "string"}, path
            assert "properties" not in node, path
        elif key in OBJECT_MAPS:  # keys are names (images); each value a closed object
            value = node.get("additionalProperties")
            assert value["type"] == "object" and value["additionalProperties"] is False and value["properties"], path
            assert "properties" not in node, path
        else:
            assert node.get("additionalProperties") is False, f"{path} is not closed (additionalProperties: false)"
            assert node.get("properties"), f"{path} lists no properties"
        checked += 1
    assert checked > 15


def test_schema_covers_every_value_and_nothing_else():
    """values.yaml and the schema list the same keys: no undocumented value, no dead schema entry."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def keys(node: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, sub in (node.get("properties") or {}).items():
            out.add(prefix + k)
            if sub.get("additionalProperties") is False:
                out |= keys(sub, f"{prefix}{k}.")
        return out

    def value_keys(node: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in node.items():
            out.add(prefix + k)
            if isinstance(v, dict) and k not in STRING_MAPS:
                out |= value_keys(v, f"{prefix}{k}.")
        return out

    # allowed, deliberately unset (no CPU limit)
    optional = {"global", "operator.resources.limits.cpu", "janitor.resources.limits.cpu"}
    assert keys(schema) - optional == value_keys(values)


@pytest.mark.parametrize(("args", "named"), [
    (["--set", "operater.replicas=1"], "operater"),                       # top-level typo
    (["--set", "operator.confg.headroomPercent=5"], "confg"),            # nested typo
    (["--set", "operator.config.allowedDiskRoot={/mnt/x}"], "allowedDiskRoot"),  # not a settings key
    (["--set", "crds.keeep=false"], "keeep"),
    (["--set", "monitoring.podMonitor.enable=true"], "enable"),
])
def test_values_typo_refused_naming_it(helm, args, named):
    cp = helm("template", "kvo", CHART, *args, check=False)
    assert cp.returncode != 0, f"{args} was accepted"
    assert "additional properties" in cp.stderr and f"'{named}'" in cp.stderr, cp.stderr


@pytest.mark.parametrize(("args", "path"), [
    (["--set", "operator.replicas=6"], "/operator/replicas"),
    (["--set", "operator.config.headroomPercent=150"], "/operator/config/headroomPercent"),
    (["--set", "operator.config.engineBaseline=lots"], "/operator/config/engineBaseline"),
    (["--set", "operator.config.allowedDiskRoots={relative/path}"], "/operator/config/allowedDiskRoots/0"),
    (["--set", "operator.config.nvmeNodeLabel=no-value"], "/operator/config/nvmeNodeLabel"),
    (["--set", "operator.config.pythonHashSeed=random"], "/operator/config/pythonHashSeed"),
    (["--set", "watchNamespaces={Bad_Name}"], "/watchNamespaces/0"),
    (["--set", "operator.logLevel=LOUD"], "/operator/logLevel"),
])
def test_bad_values_refused_naming_the_field(helm, args, path):
    cp = helm("template", "kvo", CHART, *args, check=False)
    assert cp.returncode != 0, f"{args} was accepted"
    assert f"'{path}'" in cp.stderr, cp.stderr


def test_more_than_one_replica_needs_leader_election(helm):
    cp = helm("template", "kvo", CHART, "--set", "operator.replicas=3", check=False)
    assert cp.returncode != 0 and "operator.leaderElection" in cp.stderr
    assert one(helm.render(), "Deployment")["spec"]["strategy"]["type"] == "Recreate"
    schema = json.loads((CHART / "values.schema.json").read_text())
    replicas = schema["properties"]["operator"]["properties"]["replicas"]
    assert replicas["maximum"] == 5 and "leaderElection" in replicas["description"]


# --------------------------------------------------------------------------- operator config
def test_default_config_is_exactly_the_operators_defaults(helm):
    cfg = operator_config(helm.render())
    assert set(cfg) == camel_settings_keys()
    # The chart adds the release namespace (for the serving pods' NetworkPolicy); the rest are the defaults.
    assert settings.from_dict(cfg) == dataclasses.replace(settings.Settings(), operator_namespace="kvo-system")


def test_config_values_are_the_operators_defaults():
    """values.yaml spells each setting's default (users read and override it there), e.g. serverBaseline; the one
    declaration is api/settings.py. Without helm, so `make check` holds the chart to it."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]["config"]
    defaults = settings.Settings()
    # exporterImage is empty: the chart fills in its own image (test_default_images_agree_with_the_operator).
    assert settings.from_dict({**values, "exporterImage": defaults.exporter_image}) == defaults


def test_config_keys_in_values_and_schema_are_the_settings_keys():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    # operatorNamespace is the release namespace, set by the chart itself, never a value.
    assert set(values["operator"]["config"]) == camel_settings_keys() - {"operatorNamespace"}
    assert (set(schema["properties"]["operator"]["properties"]["config"]["properties"])
            == camel_settings_keys() - {"operatorNamespace"})


def test_custom_roots_scenario_reaches_the_operator(helm):
    cfg = operator_config(helm.render("-f", values_file("custom-roots")))
    s = settings.from_dict(cfg)
    assert s.allowed_disk_roots == ("/mnt/fast-nvme", "/data/kvcache")
    assert s.nvme_selector() == {"node.example.com/local-nvme": "present"}
    assert s.default_image == "registry.example.com/mirror/vllm-lmcache:0.33.0-0.5.6"
    assert s.python_hash_seed == "42" and s.headroom_percent == 15 and s.labels == {"team": "inference"}
    # The mirrored serving image renders for the pair the admin declared, like the image it mirrors.
    minimal = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "engine": {"maxModelLen": 8192},
               "offload": {"cpu": {"size": "8Gi"}}}
    engine = parse(minimal, s).engine
    assert (engine.image, engine.vllm_version, engine.lmcache_version) == (s.default_image, "0.33.0", "0.5.6")
    with pytest.raises(ConfigError) as err:
        parse(minimal, dataclasses.replace(s, image_versions={}))
    assert err.value.field == "spec.engine.vllmVersion" and "imageVersions" in err.value.message


@pytest.mark.parametrize("bad", [{"img": {"lmcache": "0.5.3"}}, {"img": {"vllm": "0.26.0", "torch": "2.11.0"}},
                                 {"img": "0.26.0"}, {"img": {"vllm": 26}}])
def test_image_versions_are_checked_with_the_key_named(bad):
    with pytest.raises(ConfigError) as err:
        settings.from_dict({"imageVersions": bad})
    assert err.value.field == "operator config imageVersions['img']"


def test_exporter_image_follows_the_operator_repository_at_the_app_version_unless_set(helm):
    # Not image.tag: a new operator image alone must roll no serving pod (tests/integration/test_real_node.py).
    cfg = operator_config(helm.render("--set", "image.repository=registry.local/kvo", "--set", "image.tag=9.9.9"))
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert cfg["exporterImage"] == f"registry.local/kvo:{app_version}"
    cfg = operator_config(helm.render("--set", "operator.config.exporterImage=other/exporter:1"))
    assert cfg["exporterImage"] == "other/exporter:1"


def test_router_placement_values_reach_the_operator(helm):
    cfg = operator_config(helm.render("--set", "operator.config.routerNodeSelector.pool=cpu",
                                      "--set", "operator.config.routerTolerations[0].key=dedicated",
                                      "--set", "operator.config.routerTolerations[0].operator=Exists"))
    s = settings.from_dict(cfg)
    assert (s.router_node_selector == {"pool": "cpu"}
            and s.router_tolerations == ({"key": "dedicated", "operator": "Exists"},))
    cp = helm("template", "kvo", CHART, "--set", "operator.config.routerTolerations[0].operator=In", check=False)
    assert cp.returncode != 0 and "'/operator/config/routerTolerations/0/operator'" in cp.stderr, cp.stderr


def test_integer_hash_seed_is_rendered_as_a_string(helm):
    cfg = operator_config(helm.render("--set", "operator.config.pythonHashSeed=1234"))
    assert cfg["pythonHashSeed"] == "1234"


def test_config_change_rolls_the_operator_pod(helm):
    a = one(helm.render(), "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    b = one(helm.render("--set", "operator.config.headroomPercent=20"), "Deployment")
    assert b["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != a


# --------------------------------------------------------------------------- names, labels
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_standard_labels_everywhere(helm, scenario):
    docs = helm.render("-f", values_file(scenario), "--api-versions", "monitoring.coreos.com/v1")
    for d in docs:
        if d["kind"] == "CustomResourceDefinition":
            continue  # generated from kvoffload.api.crd, labelled there
        labels = d["metadata"]["labels"]
        for key in STANDARD_LABELS:
            assert labels.get(key), f"{d['kind']}/{d['metadata']['name']} lacks {key}"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/instance"] == "kvo"
        assert labels["helm.sh/chart"] == "kvoffload-operator-0.1.0"
        assert labels["app.kubernetes.io/version"] == "0.1.0"


def test_selector_uses_only_name_and_instance(helm):
    dep = one(helm.render(), "Deployment")
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "kvoffload-operator", "app.kubernetes.io/instance": "kvo"}
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_fullname(helm):
    assert one(helm.render(release="kvo"), "Deployment")["metadata"]["name"] == "kvo-kvoffload-operator"
    # A release name that already holds the chart name is not repeated.
    assert one(helm.render(release="kvoffload-operator"), "Deployment")["metadata"]["name"] == "kvoffload-operator"
    assert one(helm.render("--set", "fullnameOverride=kvo"), "Deployment")["metadata"]["name"] == "kvo"


def test_fullname_truncated_to_63(helm):
    release = "r" * 30 + "-" + "s" * 22  # 53: Helm's longest release name
    docs = helm.render(release=release)
    dep = one(docs, "Deployment")
    name = dep["metadata"]["name"]
    assert len(name) == 63 or len(name) == 62 and not name.endswith("-"), name
    assert not name.endswith("-")
    for d in docs:
        n = d["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", n), n
        if d["kind"] in ("Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
            assert len(n) <= 63, n


# --------------------------------------------------------------------------- deployment
def test_operator_deployment(helm):
    docs = helm.render()
    dep = one(docs, "Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}, "two standalone operators must never run at once"
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["runAsNonRoot"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]
    probe = c["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    port = {p["name"]: p["containerPort"] for p in c["ports"]}[probe["port"]]
    assert port == 8080
    assert "readinessProbe" not in c  # kopf's endpoint is a liveness probe only
    args = c["args"]
    assert args[0] == "run" and "--all-namespaces" in args
    assert "--liveness=http://0.0.0.0:8080/healthz" in args
    assert "--log-level=INFO" in args
    (cfg_arg,) = [a for a in args if a.startswith("--operator-config=")]
    cfg_path = Path(cfg_arg.split("=", 1)[1])
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["config"]["mountPath"] == str(cfg_path.parent) and mounts["config"]["readOnly"]
    cm_name = volumes["config"]["configMap"]["name"]
    assert cfg_path.name in find(docs, "ConfigMap", cm_name)[0]["data"]
    assert mounts["tmp"]["mountPath"] == "/tmp" and "emptyDir" in volumes["tmp"]
    assert c["image"] == "ghcr.io/kvoffload/kvoffload:0.1.0"


def test_operator_cli_accepts_the_rendered_arguments(helm):
    """The Deployment's args parse with the real `kvoffload` CLI (no flag the operator lacks)."""
    from kvoffload.cli import main as cli

    for scenario in ("default", "namespaced"):
        (c,) = one(helm.render("-f", values_file(scenario)), "Deployment")["spec"]["template"]["spec"]["containers"]
        args = cli.build_parser().parse_args(c["args"])
        assert args.command == "run"
        assert args.operator_config == "/etc/kvoffload/config.yaml"
        assert args.liveness == "http://0.0.0.0:8080/healthz"
        if scenario == "namespaced":
            assert args.namespace == ["team-a", "team-b"] and not args.all_namespaces
        else:
            assert args.all_namespaces and not args.namespace


def test_scheduling_values(helm):
    dep = one(helm.render("--set", "operator.nodeSelector.role=control",
                          "--set", "operator.tolerations[0].key=dedicated",
                          "--set", "operator.tolerations[0].operator=Exists",
                          "--set", "operator.priorityClassName=system-cluster-critical",
                          "--set", "imagePullSecrets[0].name=regcred",
                          "--set", "operator.podAnnotations.a=b"), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"role": "control"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert dep["spec"]["template"]["metadata"]["annotations"]["a"] == "b"


def test_keda_autoscaler_adds_scaledobjects_only(helm):
    """operator.config.autoscaler keda: the operator also applies, watches and prunes ScaledObjects."""
    docs = helm.render("--set", "operator.config.autoscaler=keda",
                       "--set", "operator.config.prometheusAddress=http://prometheus.monitoring.svc:9090")
    keda_verbs = {"list", "watch", "create", "patch", "delete"}
    assert _rules(one(docs, "ClusterRole")) == {**EXPECTED_RULES, ("keda.sh", "scaledobjects"): keda_verbs}
    config_map = next(c for c in find(docs, "ConfigMap") if "config.yaml" in c.get("data", {}))
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert (config["autoscaler"], config["prometheusAddress"]) == ("keda", "http://prometheus.monitoring.svc:9090")
    # auto (the default) may pick KEDA only with a Prometheus for its triggers: the grant follows.
    assert ("keda.sh", "scaledobjects") not in _rules(one(helm.render(), "ClusterRole"))
    auto = helm.render("--set", "operator.config.prometheusAddress=http://prometheus.monitoring.svc:9090")
    assert ("keda.sh", "scaledobjects") in _rules(one(auto, "ClusterRole"))
    cp = helm("template", "kvo", CHART, "--set", "operator.config.autoscaler=argo", check=False)
    assert cp.returncode != 0 and "autoscaler" in cp.stderr


def test_existing_service_account(helm):
    docs = helm.render("--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops")
    assert not find(docs, "ServiceAccount")
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    assert one(docs, "ClusterRoleBinding")["subjects"] == [{"kind": "ServiceAccount", "name": "ops",
                                                            "namespace": "kvo-system"}]
    cp = helm("template", "kvo", CHART, "--set", "serviceAccount.create=false", check=False)
    assert cp.returncode != 0 and "serviceAccount.name" in cp.stderr


# --------------------------------------------------------------------------- RBAC
def _rules(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
            assert all("*" not in x for x in rule[field]), f"wildcard in {field}: {rule}"
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_cluster_rbac_is_exactly_what_the_operator_calls(helm):
    docs = helm.render()
    role = one(docs, "ClusterRole")
    rules = _rules(role)
    assert not any(r == "secrets" or r.startswith("secrets/") for _, r in rules)
    assert rules == EXPECTED_RULES
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    sa = one(docs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]
    assert not find(docs, "Role") and not find(docs, "RoleBinding")


def test_namespaced_mode_has_a_role_per_namespace_and_no_cluster_role(helm):
    docs = helm.render("-f", values_file("namespaced"))
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    roles = find(docs, "Role")
    bindings = find(docs, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    sa = one(docs, "ServiceAccount")["metadata"]
    for role in roles:
        assert _rules(role) == EXPECTED_RULES
    for b in bindings:
        assert b["roleRef"]["kind"] == "Role"
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": "kvo-system"}]


def test_rbac_can_be_left_to_the_admin(helm):
    docs = helm.render("--set", "rbac.create=false")
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]


# --------------------------------------------------------------------------- CRDs
def test_chart_crd_is_the_generated_one():
    path = CHART / "templates" / "crds" / f"{crd.PLURAL}.yaml"
    assert path.read_text() == generate.chart(), "stale: run `python -m kvoffload.cli.generate`"


def test_crds_enabled_and_kept_by_default(helm):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["crds"] == {"enabled": True, "keep": True}
    c = one(helm.render(), "CustomResourceDefinition")
    assert c["metadata"]["name"] == f"{crd.PLURAL}.{crd.GROUP}"
    assert c["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert c == {**crd.crd(), "metadata": {**crd.crd()["metadata"],
                                           "annotations": {"helm.sh/resource-policy": "keep"}}}


def test_crds_keep_off_and_crds_off(helm):
    c = one(helm.render("--set", "crds.keep=false"), "CustomResourceDefinition")
    assert not (c["metadata"].get("annotations") or {})
    assert not find(helm.render("--set", "crds.enabled=false"), "CustomResourceDefinition")


# --------------------------------------------------------------------------- monitoring
def test_monitors_need_the_prometheus_operator_api(helm):
    both_off = helm.render("--set", "monitoring.podMonitor.enabled=true")
    assert not find(both_off, "PodMonitor"), "rendered a PodMonitor for a cluster without monitoring.coreos.com/v1"
    assert not find(helm.render("--api-versions", "monitoring.coreos.com/v1"), "PodMonitor"), "rendered while disabled"


def test_pod_monitor_selects_serving_pods(helm):
    docs = helm.render("-f", values_file("monitoring"), "--api-versions", "monitoring.coreos.com/v1")
    (pm,) = find(docs, "PodMonitor", "kvo-kvoffload-operator-serving")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert pm["spec"]["selector"] == {"matchExpressions": [{"key": "kvoffload.io/serve", "operator": "Exists"}]}
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    ports = [e["port"] for e in pm["spec"]["podMetricsEndpoints"]]
    assert ports == ["metrics", "http"]
    assert all(e["interval"] == "15s" for e in pm["spec"]["podMetricsEndpoints"])
    assert not find(docs, "ServiceMonitor")
    # In namespaced mode it looks only where the operator works.
    (pm,) = find(helm.render("-f", values_file("monitoring"), "-f", values_file("namespaced"),
                             "--api-versions", "monitoring.coreos.com/v1"), "PodMonitor",
                 "kvo-kvoffload-operator-serving")
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_the_operator_serves_its_own_metrics_and_a_pod_monitor_scrapes_them(helm):
    docs = helm.render("--set", "janitor.enabled=true", "--set", "monitoring.serviceMonitor.enabled=true",
                       "--api-versions", "monitoring.coreos.com/v1")
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--metrics-listen=$(POD_IP):9402" in c["args"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    assert {"name": "metrics", "containerPort": 9402, "protocol": "TCP"} in c["ports"]
    (pm,) = find(docs, "PodMonitor", "kvo-kvoffload-operator-operator")  # in ServiceMonitor mode too: no Service
    selected = pm["spec"]["selector"]["matchLabels"]
    for pod in (one(docs, "Deployment"), one(docs, "DaemonSet")):  # the operator's and the janitor's pods
        labels = pod["spec"]["template"]["metadata"]["labels"]
        assert selected.items() <= labels.items(), pod["kind"]
        assert any(p["name"] == "metrics" for p in pod["spec"]["template"]["spec"]["containers"][0]["ports"])
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["kvo-system"]}  # the release namespace
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    (c,) = one(helm.render("--set", "operator.metricsPort=0"), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert (not any(a.startswith("--metrics-listen") for a in c["args"])
            and [p["name"] for p in c["ports"]] == ["health"])


def test_pod_monitor_port_names_match_the_operators_pods():
    from kvoffload.rendering import render

    source = Path(render.__file__).read_text()
    assert '"name": "metrics"' in source and '"name": "http"' in source
    assert render.OWNER_LABEL == "kvoffload.io/serve"


def test_service_monitor_drops_headless_services(helm):
    docs = helm.render("--set", "monitoring.serviceMonitor.enabled=true", "--set",
                       "monitoring.serviceMonitor.scrapeEngine=false",
                       "--api-versions", "monitoring.coreos.com/v1")
    sm = one(docs, "ServiceMonitor")
    assert sm["spec"]["selector"] == {"matchExpressions": [{"key": "kvoffload.io/serve", "operator": "Exists"}]}
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == "metrics"
    assert ({"sourceLabels": ["__meta_kubernetes_service_name"], "regex": ".+-pods", "action": "drop"}
            in ep["relabelings"])
    from kvoffload.rendering import render
    assert render.names("x")["headless"] == "x-pods", "the headless Service name changed: fix the relabeling"


def test_both_monitors_refused(helm):
    cp = helm("template", "kvo", CHART, "--set", "monitoring.podMonitor.enabled=true",
              "--set", "monitoring.serviceMonitor.enabled=true", check=False)
    assert cp.returncode != 0 and "scraped twice" in cp.stderr


# --------------------------------------------------------------------------- dashboard
def _dashboards(docs: list[dict]) -> list[dict]:
    return [d for d in find(docs, "ConfigMap") if (d["metadata"].get("labels") or {}).get("grafana_dashboard") == "1"]


def test_dashboard_configmap(helm):
    dash = CHART / "dashboards" / "kvoffload-tiers.json"
    if not dash.exists():
        pytest.skip("dashboards/kvoffload-tiers.json not written yet")
    (cm,) = _dashboards(helm.render("--set", "grafana.dashboard.namespace=monitoring",
                                    "--set", "grafana.dashboard.labels.grafana_folder=kvoffload"))
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_folder"] == "kvoffload"
    assert json.loads(cm["data"]["kvoffload-tiers.json"]) == json.loads(dash.read_text())
    assert not _dashboards(helm.render("--set", "grafana.dashboard.enabled=false"))


def test_dashboard_file_absent_is_tolerated(helm, tmp_path):
    chart = tmp_path / "kvoffload-operator"
    shutil.copytree(CHART, chart)
    shutil.rmtree(chart / "dashboards", ignore_errors=True)
    docs = helm.render(chart=chart)
    assert not _dashboards(docs)
    assert one(docs, "Deployment")


# --------------------------------------------------------------------------- NOTES
def notes(helm: Helm, *args) -> str:
    out = helm("install", "kvo", CHART, "--namespace", "kvo-system", "--dry-run=client", *args).stdout
    return out[out.index("NOTES:"):]


def notes_example(text: str) -> dict:
    m = re.search(r"^kubectl apply -n (\S+) -f - <<'EOF'\n(.*?)^EOF$", text, re.M | re.S)
    assert m, text
    doc = yaml.safe_load(m.group(2))
    doc["metadata"]["namespace"] = m.group(1)
    return doc


def test_notes_tell_how_to_create_and_check_a_first_serve(helm):
    text = notes(helm)
    example = notes_example(text)
    name = example["metadata"]["name"]
    assert example["apiVersion"] == f"{crd.GROUP}/{crd.VERSION}" and example["kind"] == crd.KIND
    assert "kubectl get kvs" in text
    assert f"kubectl wait --for=condition=Ready kvs/{name}" in text
    assert "kvs" in crd.crd()["spec"]["names"]["shortNames"]


def test_notes_follow_the_values(helm):
    text = notes(helm, "-f", values_file("namespaced"), "-f", values_file("no-crds"))
    assert "team-a, team-b" in text
    assert notes_example(text)["metadata"]["namespace"] == "team-a"
    assert "crds.enabled=false" in text
    text = notes(helm, "--set", "monitoring.podMonitor.enabled=true")
    assert "does not serve monitoring.coreos.com/v1" in text


def test_notes_example_is_a_valid_serve():
    """The example parses with the CRD's own schema rules that matter here (no cluster needed)."""
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    text = (CHART / "templates" / "NOTES.txt").read_text()
    m = re.search(r"^kubectl apply .*?<<'EOF'\n(.*?)^EOF$", text, re.M | re.S)
    spec = yaml.safe_load(m.group(1))["spec"]
    for key in spec:
        assert key in schema["properties"], f"NOTES example uses unknown field spec.{key}"
    for key in schema.get("required", []):
        assert key in spec, f"NOTES example lacks required spec.{key}"


def test_default_images_agree_with_the_operator():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    defaults = settings.Settings()
    assert values["operator"]["config"]["defaultImage"] == defaults.default_image
    assert chart["annotations"]["kvoffload.io/default-serving-image"] == defaults.default_image
    assert defaults.default_image in images.KNOWN_IMAGES
    # The operator image (repository:appVersion) is the exporter image the operator defaults to.
    assert f"{values['image']['repository']}:{chart['appVersion']}" == defaults.exporter_image


def test_leader_election_for_several_replicas(helm):
    docs = helm.render("--set", "operator.replicas=2", "--set", "operator.leaderElection=true")
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-election" in args and "--leader-election-namespace=kvo-system" in args
    (role,) = [r for r in find(docs, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    assert role["metadata"]["namespace"] == "kvo-system"
    assert _rules(role) == {("coordination.k8s.io", "leases"): {"get", "create", "update"}}
    assert one(docs, "ClusterRole")  # the reconcile rules are unchanged



# --------------------------------------------------------------------------- several replicas, janitor
def test_several_replicas_get_a_pdb_and_anti_affinity(helm):
    assert not find(helm.render(), "PodDisruptionBudget")
    assert "affinity" not in one(helm.render(), "Deployment")["spec"]["template"]["spec"]
    docs = helm.render("-f", values_file("leader-election"))
    pdb = one(docs, "PodDisruptionBudget")
    pod = one(docs, "Deployment")["spec"]["template"]
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": {
        "app.kubernetes.io/name": "kvoffload-operator", "app.kubernetes.io/instance": "kvo"}}}
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    labels = pod["metadata"]["labels"]
    assert all(labels[k] == v for k, v in term["podAffinityTerm"]["labelSelector"]["matchLabels"].items())
    assert all(labels[k] == v for k, v in pdb["spec"]["selector"]["matchLabels"].items())


def _janitor(docs: list[dict]) -> dict:
    return one(docs, "DaemonSet")


def test_janitor_is_opt_in(helm):
    docs = helm.render()
    assert not find(docs, "DaemonSet")
    assert [r["metadata"]["name"] for r in find(docs, "ClusterRole")] == ["kvo-kvoffload-operator"]


def test_janitor_least_privilege(helm):
    docs = helm.render("-f", values_file("janitor"))
    ds = _janitor(docs)
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    # API: get/list/watch KVOffloadServes, through its own ServiceAccount and ClusterRole.
    role = [r for r in find(docs, "ClusterRole") if r["metadata"]["name"].endswith("-janitor")]
    assert len(role) == 1 and _rules(role[0]) == {("kvoffload.io", "kvoffloadserves"): {"get", "list", "watch"}}
    (binding,) = [b for b in find(docs, "ClusterRoleBinding") if b["metadata"]["name"].endswith("-janitor")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": "kvo-system"}]
    assert pod["serviceAccountName"] != one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    # Node: exactly the allowed roots (which must exist: Directory) and its own state directory outside them;
    # root with DAC_OVERRIDE only.
    host = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in pod["volumes"] if "hostPath" in v}
    assert host == {"/mnt/nvme": "Directory", "/var/lib/kvoffload": "Directory",
                    "/var/lib/kvoffload-janitor": "DirectoryOrCreate"}
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}
    assert (sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            and sc["privileged"] is False)
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["nodeSelector"] == {"kvoffload.io/nvme": "true"}
    # The loop, dry-run and metrics on the pod IP.
    args = c["args"]
    assert args[:2] == ["clean-disk", "--in-cluster"] and "--dry-run" in args
    assert {"--root=/host/mnt/nvme", "--root=/host/var/lib/kvoffload"} <= set(args)
    assert "--state=/var/lib/kvoffload-janitor/state.json" in args
    assert "--metrics-listen=$(POD_IP):9401" in args and "--interval=600" in args
    assert c["ports"] == [{"name": "metrics", "containerPort": 9401, "protocol": "TCP"}]


def test_janitor_cli_accepts_the_rendered_arguments(helm):
    from kvoffload.cli import clean_disk
    from kvoffload.cli import main as cli_main

    (c,) = _janitor(helm.render("-f", values_file("janitor")))["spec"]["template"]["spec"]["containers"]
    args = cli_main.build_parser("clean-disk").parse_args(c["args"])
    assert args.in_cluster and args.dry_run and args.interval == 600 and args.min_age == 600
    assert args.root == ["/host/mnt/nvme", "/host/var/lib/kvoffload"]
    clean_disk.check_state_outside(args.state, args.root)  # the CLI's own check agrees


@pytest.mark.parametrize("path", ["/mnt/nvme", "/mnt/nvme/janitor", "/var/lib", "/var/lib/kvoffload/state"])
def test_janitor_refuses_a_state_path_a_tenant_could_reach(helm, path):
    cp = helm("template", "kvo", CHART, "--set", "janitor.enabled=true", "--set", f"janitor.statePath={path}",
              check=False)
    assert cp.returncode != 0 and "janitor.statePath" in cp.stderr, cp.stderr


def test_janitor_paths_are_gone_the_roots_are_the_one_setting(helm):
    cp = helm("template", "kvo", CHART, "--set", "janitor.enabled=true", "--set", "janitor.paths={/mnt/nvme/x}",
              check=False)
    assert cp.returncode != 0 and "paths" in cp.stderr, cp.stderr  # the schema refuses the removed key
    cp = helm("template", "kvo", CHART, "--set", "janitor.enabled=true", "--set",
              "operator.config.allowedDiskRoots=null",
              check=False)
    assert cp.returncode != 0 and "allowedDiskRoots" in cp.stderr, cp.stderr


def test_janitor_follows_the_nvme_label_and_the_roots(helm):
    ds = _janitor(helm.render("-f", values_file("janitor"), "-f", values_file("custom-roots")))
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"node.example.com/local-nvme": "present"}
    assert {a for a in pod["containers"][0]["args"] if a.startswith("--root")} == {"--root=/host/mnt/fast-nvme",
                                                                                  "--root=/host/data/kvcache"}
