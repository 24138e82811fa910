"""Flux itself, on the real control plane: its source-controller and kustomize-controller (built from
their Go modules by tests/gitops/flux/build.sh) reconcile KVOffloadServes from a git repository served
on 127.0.0.1, beside the operator (kvtest.OperatorProcess). Each test applies
examples/gitops/flux/flux.yaml as written (its own URL and namespace) and judges by Flux's own objects
and conditions:

- Ready only once the KVOffloadServe is Ready, with `wait: true` and with an explicit healthChecks entry;
- an invalid KVOffloadServe fails the Kustomization at once (the operator's Stalled -> kstatus Failed),
  not at its timeout;
- nothing flaps between Flux's server-side apply and the operator's: several Flux reconciles write
  neither the KVOffloadServe nor any of its children;
- a field removed in git leaves the KVOffloadServe and the pods' StatefulSet;
- a KVOffloadServe deleted from git is pruned with its children; the CRD never is;
- a replica count set by `kubectl scale` (the scale subresource an HPA uses too) survives Flux's
  reconciles while git leaves spec.replicas out, and is set back when git names it.
"""

from __future__ import annotations

import copy
import time

import pytest
import yaml

from kvtest import ROOT, OperatorProcess, condition
from kvtest import flux as fx

pytestmark = pytest.mark.cluster

EXAMPLE = ROOT / "examples/gitops/flux"
SERVES = "kvoffload-serves"
BAD_PATH = "/etc/lmcache"  # the API server accepts it; the operator refuses it (outside the allowed roots)
CHILD_KINDS = ("statefulsets", "configmaps", "services", "poddisruptionbudgets", "networkpolicies")


def example_serve(name: str = "qwen") -> dict:
    obj = yaml.safe_load((EXAMPLE / "repo/serves/qwen.yaml").read_text())
    obj["metadata"]["name"] = name
    return obj


@pytest.fixture(scope="module")
def controllers(cluster, tmp_path_factory):
    fx.install_crds(cluster.client)
    ctl = fx.FluxControllers(cluster.env, tmp_path_factory.mktemp("flux"))
    try:
        ctl.wait_ready()
        yield ctl
    finally:
        ctl.stop()
        for name in ctl.procs:
            print(f"--- {name}\n{ctl.output(name)[-3000:]}")


class Setup:
    """One test's git repository, operator and Flux objects, all in its namespace."""

    def __init__(self, cluster, ns: str, git: fx.GitServer) -> None:
        self.cluster, self.client, self.ns, self.git = cluster, cluster.client, ns, git

    def commit(self, serves: dict[str, dict | None], crd: bool = True) -> str:
        files: dict[str, str | None] = {f"serves/{n}.yaml": o and yaml.safe_dump(o) for n, o in serves.items()}
        crd_file = "crds/kvoffload.io_kvoffloadserves.yaml"
        files[crd_file] = (EXAMPLE / "repo" / crd_file).read_text() if crd else None
        if not crd:  # the directory must stay (Flux fails a Kustomization whose path is gone): an empty one
            files["crds/kustomization.yaml"] = ("apiVersion: kustomize.config.k8s.io/v1beta1\n"
                                                "kind: Kustomization\nresources: []\n")
        return self.git.commit({k: v for k, v in files.items() if v is not None or (self.git.work / k).exists()},
                               f"serves: {sorted(serves)}")

    def example(self) -> dict[str, dict]:
        """examples/gitops/flux/flux.yaml as written, with this test's URL and namespace."""
        docs = {}
        for doc in yaml.safe_load_all((EXAMPLE / "flux.yaml").read_text()):
            doc["metadata"]["namespace"] = self.ns
            if doc["kind"] == "GitRepository":
                doc["spec"]["url"] = self.git.url
            if "targetNamespace" in doc["spec"]:
                doc["spec"]["targetNamespace"] = self.ns
            docs[doc["metadata"]["name"]] = doc
        return docs

    def apply(self, docs: dict[str, dict]) -> None:
        for doc in docs.values():
            self.client.apply(doc, self.ns)

    def kustomization(self, name: str = SERVES) -> dict:
        return self.client.get("kustomizations", name, self.ns)

    def wait_kustomization(self, pred, message: str, name: str = SERVES, timeout: float = 180) -> dict:
        return self.cluster.wait_until(lambda: (k := self.client.get_or_none("kustomizations", name, self.ns))
                                       and pred(k) and k, timeout=timeout, message=f"{name}: {message}")

    def wait_applied(self, sha: str, name: str = SERVES, timeout: float = 180) -> dict:
        """Ready at its generation, revision `sha` applied (and, with wait, healthy)."""
        def applied(k):
            return (fx.ready(k).get("status") == "True"
                    and (k.get("status") or {}).get("lastAppliedRevision", "").endswith(sha))
        return self.wait_kustomization(applied, f"Ready at {sha[:8]}", name, timeout)

    def fetch(self, sha: str) -> None:
        """`flux reconcile source git`: source-controller fetches now instead of at its interval."""
        fx.request_reconcile(self.client, "gitrepositories", "kvoffload-config", self.ns)
        self.cluster.wait_until(
            lambda: ((self.client.get("gitrepositories", "kvoffload-config", self.ns).get("status") or {})
                     .get("artifact") or {}).get("revision", "").endswith(sha), timeout=60,
            message=f"artifact {sha[:8]}")

    def reconcile(self, name: str = SERVES) -> dict:
        """`flux reconcile kustomization`: one more apply + health check, awaited."""
        stamp = fx.request_reconcile(self.client, "kustomizations", name, self.ns)
        return self.wait_kustomization(lambda k: k["status"].get("lastHandledReconcileAt") == stamp
                                       and fx.ready(k).get("status") == "True", "reconciled")

    def kvs(self, name: str = "qwen") -> dict | None:
        return self.client.get_or_none("kvs", name, self.ns)

    def wait_kvs_ready(self, name: str = "qwen", timeout: float = 120) -> dict:
        def ok():
            o = self.kvs(name)
            c = condition(o, "Ready")
            return (o and c.get("status") == "True" and c.get("observedGeneration") == o["metadata"]["generation"]
                    and o["status"].get("observedGeneration") == o["metadata"]["generation"] and o)
        return self.cluster.wait_until(ok, timeout=timeout, message=f"{name} Ready")

    def children(self, owner: str = "qwen") -> dict[tuple[str, str], dict]:
        """Every object the KVOffloadServe owns (by ownerReference), by (kind, name)."""
        uid = self.client.get("kvs", owner, self.ns)["metadata"]["uid"]
        return {(kind, o["metadata"]["name"]): o for kind in CHILD_KINDS for o in self.client.list(kind, self.ns)
                if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])}

    def delete_flux_objects(self) -> None:
        """Before the namespace goes: Flux's finalizers need the controllers still running."""
        for kind, name in (("kustomizations", SERVES), ("kustomizations", "kvoffload-crds"),
                           ("gitrepositories", "kvoffload-config")):
            self.client.delete(kind, name, self.ns, missing_ok=True)
        self.cluster.wait_until(lambda: not self.client.list("kustomizations", self.ns)
                                and not self.client.list("gitrepositories", self.ns), timeout=120,
                                message="Flux objects deleted")


@pytest.fixture
def setup(cluster, controllers, namespace, tmp_path):
    git = fx.GitServer(tmp_path / "git")
    operator = OperatorProcess(cluster.env, [namespace])
    s = Setup(cluster, namespace, git)
    try:
        yield s
    finally:
        try:
            s.delete_flux_objects()
        finally:
            operator.stop()
            git.close()
            print(operator.output()[-3000:])


def test_flux_listens_on_loopback_only(controllers):
    listeners = controllers.listeners()
    assert len(listeners) == 3, listeners  # two health endpoints and the artifact server
    assert {addr for addr, _, _ in listeners} == {"127.0.0.1"}, listeners


@pytest.mark.parametrize("check", ["wait", "healthChecks"])
def test_kustomization_ready_only_once_the_kvoffloadserve_is_ready(cluster, setup, check):
    sha = setup.commit({"qwen": example_serve()})
    docs = setup.example()
    if check == "healthChecks":  # Flux checks only what healthChecks names when wait is off
        docs[SERVES]["spec"]["wait"] = False
        docs[SERVES]["spec"]["healthChecks"] = [
            {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe", "name": "qwen", "namespace": setup.ns}]
    # With kube-controller-manager stopped the StatefulSet controller makes no pods: the
    # KVOffloadServe stays not Ready for as long as we look.
    cluster.cluster.stop_component("kube-controller-manager")
    try:
        setup.apply(docs)
        setup.wait_kustomization(lambda k: condition(k, "Healthy").get("status") == "Unknown"
                                 and "Running health checks" in condition(k, "Healthy").get("message", ""),
                                 "running health checks", timeout=120)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            k, kvs = setup.kustomization(), setup.kvs()
            assert condition(kvs, "Ready").get("status") != "True", kvs["status"]
            assert condition(k, "Ready").get("status") == "Unknown", k["status"]
            assert condition(k, "Ready").get("reason") == "Progressing", k["status"]
            time.sleep(1)
    finally:
        cluster.cluster.start_component("kube-controller-manager")
    k = setup.wait_applied(sha)
    kvs = setup.wait_kvs_ready(timeout=10)  # already Ready when Flux says so
    assert condition(k, "Healthy")["status"] == "True", k["status"]
    assert condition(kvs, "Ready")["lastTransitionTime"] <= condition(k, "Ready")["lastTransitionTime"]
    print(f"{check}: Kustomization {condition(k, 'Ready')['message']!r}")


def test_invalid_kvoffloadserve_fails_the_kustomization_at_once(cluster, setup):
    bad = example_serve()
    bad["spec"]["offload"]["disk"]["path"] = BAD_PATH
    sha = setup.commit({"qwen": bad})
    setup.apply(setup.example())
    cluster.wait_until(lambda: setup.kvs() is not None, timeout=120, message="applied by Flux")
    t0 = time.monotonic()
    k = setup.wait_kustomization(lambda k: fx.ready(k).get("reason") == "HealthCheckFailed"
                                 and k["status"].get("lastAttemptedRevision", "").endswith(sha), "HealthCheckFailed")
    took = time.monotonic() - t0
    timeout = setup.example()[SERVES]["spec"]["timeout"]
    message = condition(k, "Ready")["message"]
    print(f"invalid KVOffloadServe: Kustomization failed {took:.1f}s "
          f"after Flux applied it (timeout {timeout}): {message}")
    assert took < 60, f"{took:.0f}s"
    assert fx.ready(k)["status"] == "False" and condition(k, "Healthy")["status"] == "False"
    # Flux names the resource and kstatus' verdict; the operator's message (field and allowed roots)
    # is on the resource it names.
    assert "failed early due to stalled resources" in message, message
    assert f"KVOffloadServe/{setup.ns}/qwen status: 'Failed'" in message, message
    stalled = condition(setup.kvs(), "Stalled")
    assert stalled["status"] == "True" and "spec.offload.disk.path" in stalled["message"], stalled


def test_nothing_flaps_between_flux_and_the_operator(cluster, setup):
    sha = setup.commit({"qwen": example_serve()})
    setup.apply(setup.example())
    setup.wait_applied(sha)
    setup.wait_kvs_ready()

    def writes():
        objs = {("KVOffloadServe", "qwen"): setup.kvs(), **setup.children()}
        return {key: (o["metadata"]["resourceVersion"], o["metadata"].get("generation")) for key, o in objs.items()}

    before = writes()
    assert ("statefulsets", "qwen") in before and ("configmaps", "qwen-lmcache") in before, sorted(before)
    t0 = time.monotonic()
    for _ in range(3):
        setup.reconcile()
    time.sleep(max(0.0, 25 - (time.monotonic() - t0)))  # and past one operator resync (20 s)
    setup.reconcile()
    assert writes() == before
    # Who owns what on the KVOffloadServe: Flux the spec (server-side apply), the operator only its status.
    owners = {(m["manager"], m.get("subresource", "")): m["fieldsV1"] for m in setup.kvs()["metadata"]["managedFields"]}
    spec_owners = {mgr for (mgr, sub), fields in owners.items() if not sub and "f:spec" in fields}
    assert spec_owners == {"kustomize-controller"}, owners.keys()


def test_field_removed_in_git_leaves_the_statefulset(cluster, setup):
    from kvoffload.api.settings import Settings
    from kvoffload.controller import pipeline

    full = example_serve()
    sha = setup.commit({"qwen": full})
    setup.apply(setup.example())
    setup.wait_applied(sha)
    setup.wait_kvs_ready()

    def template():
        return setup.client.get("statefulsets", "qwen", setup.ns)["spec"]["template"]["spec"]

    def vllm_env(pod):
        return {e["name"] for c in pod["containers"] if c["name"] == "vllm" for e in c.get("env") or []}

    pod = template()
    assert pod.get("tolerations") == full["spec"]["scheduling"]["tolerations"]
    assert "VLLM_LOGGING_LEVEL" in vllm_env(pod)
    # the volume is the allowed root /mnt/nvme; the spec's lmcache/ is the start of every mount's subPath
    assert any(v.get("hostPath", {}).get("path") == "/mnt/nvme" for v in pod["volumes"])
    assert all(m["subPathExpr"].startswith("lmcache/$(POD_NAMESPACE)/qwen") for c in pod["containers"]
               for m in c.get("volumeMounts") or [] if m["name"] == "kv-disk")

    # One field at a time, so that no other change carries the removal along.
    spec = copy.deepcopy(full["spec"])
    for removed, parent, key in (("tolerations", (), "scheduling"), ("env entry", ("engine",), "env"),
                                 ("disk tier", ("offload",), "disk")):
        node = spec
        for p in parent:
            node = node[p]
        del node[key]
        sha = setup.commit({"qwen": {**full, "spec": spec}})
        setup.fetch(sha)
        setup.wait_applied(sha)
        live = setup.kvs()["spec"]
        for p in parent:
            live = live[p]
        assert key not in live, (removed, live)  # Flux's apply removed the field it had set
        setup.wait_kvs_ready()
        expected = next(c for c in pipeline.desired("qwen", setup.ns, "", spec, Settings()).children
                        if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]
        pod = template()
        assert pod.get("tolerations") == expected.get("tolerations"), (removed, pod.get("tolerations"))
        assert vllm_env(pod) == vllm_env(expected), (removed, vllm_env(pod))
        assert sorted(v["name"] for v in pod["volumes"]) == sorted(v["name"] for v in expected["volumes"]), removed
    assert "VLLM_LOGGING_LEVEL" not in vllm_env(pod) and not any("hostPath" in v for v in pod["volumes"])


def test_deleted_from_git_is_pruned_with_its_children_and_the_crd_never(cluster, setup):
    sha = setup.commit({"qwen": example_serve(), "other": example_serve("other")})
    setup.apply(setup.example())
    setup.wait_applied(sha)
    setup.wait_kvs_ready("other")
    children = setup.children("other")
    assert ("statefulsets", "other") in children, sorted(children)

    sha = setup.commit({"other": None}, crd=False)  # and the CRD gone from git too
    setup.fetch(sha)
    k = setup.wait_applied(sha)
    setup.wait_applied(sha, name="kvoffload-crds")
    cluster.wait_until(lambda: setup.kvs("other") is None, timeout=60, message="other pruned")
    for kind, name in children:  # its StatefulSet, Services, ConfigMap, PDB: garbage-collected with it
        cluster.wait_until(lambda: not setup.client.exists(kind, name, setup.ns), timeout=90,
                           message=f"{kind}/{name} gone")
    inventory = [e["id"] for e in k["status"]["inventory"]["entries"]]
    assert inventory == [f"{setup.ns}_qwen_kvoffload.io_KVOffloadServe"], inventory
    assert setup.client.exists("customresourcedefinitions", "kvoffloadserves.kvoffload.io")
    assert setup.kvs("qwen") is not None


def test_scaled_kvoffloadserve_keeps_its_replicas_unless_git_names_them(cluster, setup):
    serve = example_serve()
    assert "replicas" not in serve["spec"]  # the example leaves it to kubectl scale / an HPA
    sha = setup.commit({"qwen": serve})
    setup.apply(setup.example())
    setup.wait_applied(sha)
    setup.wait_kvs_ready()

    def scale(n: int) -> None:  # the scale subresource, as `kubectl scale` and the HPA controller write it
        setup.client.patch("kvs", "qwen", {"spec": {"replicas": n}}, setup.ns, subresource="scale")

    scale(2)
    setup.wait_kvs_ready()
    for _ in range(2):
        setup.reconcile()
        assert setup.kvs()["spec"]["replicas"] == 2
    assert setup.client.get("statefulsets", "qwen", setup.ns)["spec"]["replicas"] == 2

    # spec.replicas in git: Flux owns it, and each reconcile sets a scaled value back.
    pinned = copy.deepcopy(serve)
    pinned["spec"]["replicas"] = 1
    sha = setup.commit({"qwen": pinned})
    setup.fetch(sha)
    setup.wait_applied(sha)
    assert setup.kvs()["spec"]["replicas"] == 1
    scale(3)
    assert setup.kvs()["spec"]["replicas"] == 3
    setup.reconcile()
    assert setup.kvs()["spec"]["replicas"] == 1
