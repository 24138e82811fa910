"""The caches kopf feeds: relists drop what a broken watch hid, older versions never win, reads of
cached kinds make no request, and writes land in the cache (read-your-writes)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import kopf
import pytest
from kopf._cogs.structs.references import Resource

from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings
from kvoffload.controller import cache, handlers, leader, pipeline, reconcile, runtime
from kvoffload.controller.kube import ApiError, Kube, collection
from kvoffload.controller.reconcile import cr_path
from kvoffload.rendering import autoscaling, render

OWNER = render.OWNER_LABEL
SPEC = {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxModelLen": 4096},
        "offload": {"cpu": {"size": "1Gi"}}, "resources": {"gpuMemory": "141Gi"}}
SCALE = {"maxReplicas": 3, "targets": {"waitingRequestsPerReplica": 4}}


def obj(kind: str, name: str, rv: int, owner: str | None = "a", ns: str = "ns", **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": ns, "name": name, "resourceVersion": str(rv),
                            "managedFields": [{"manager": "x"}]}
    if owner:
        meta["labels"] = {OWNER: owner}
    return {"apiVersion": "v1", "kind": kind, "metadata": meta, **extra}


def store() -> cache.Store:
    return cache.Store("ConfigMap", cache._owner_label)


def filled(namespaces: list[str] | None = None) -> tuple[cache.Cache, set[tuple[str, str]]]:
    """A Cache past kopf's initial listing, and the owners it kicks from now on."""
    kicked: set[tuple[str, str]] = set()
    c = cache.Cache(namespaces, lambda ns, name, kind: kicked.add((ns, name)), settle=60)
    c.event("v1", "ConfigMap", "ADDED", obj("ConfigMap", "unrelated", 1, owner=None))
    return c, kicked


def relist(c: cache.Cache, *objs: dict[str, Any]) -> None:
    """What kopf does after a 410: each listed object through the index handler, then the event handler."""
    for o in objs:
        c.put("v1", "ConfigMap", o)
        c.event("v1", "ConfigMap", None, o)


def test_relist_drops_what_the_broken_watch_never_deleted_and_kicks_its_owner():
    async def scenario() -> None:
        c, kicked = filled()
        c.put("v1", "ConfigMap", obj("ConfigMap", "a-lmcache", 10))
        c.put("v1", "ConfigMap", obj("ConfigMap", "b-lmcache", 11, owner="b"))
        kicked.clear()
        # The watch broke; meanwhile a-lmcache was deleted and b-lmcache changed. kopf's new LIST says so.
        relist(c, obj("ConfigMap", "b-lmcache", 20, owner="b", data={"k": "v"}))
        c.relisted("ConfigMap", None)  # RELIST_SETTLE after its last object
        s = c.by_kind["ConfigMap"]
        assert kicked == {("ns", "a"), ("ns", "b")}
        assert s.get("ns", "a-lmcache") is None and s.owned("ns", "a") == []
        assert s.get("ns", "b-lmcache")["data"] == {"k": "v"}
        assert c.dropped == 1 and not c.relists

    asyncio.run(scenario())


def test_relist_keeps_what_we_wrote_after_it_began_and_touches_nothing_unchanged():
    async def scenario() -> None:
        c, kicked = filled()
        c.put("v1", "ConfigMap", obj("ConfigMap", "old", 10))
        kicked.clear()
        relist(c, obj("ConfigMap", "old", 10))
        c.by_kind["ConfigMap"].observe(obj("ConfigMap", "new", 30))  # our own apply, answered during the relist
        c.relisted("ConfigMap", None)
        assert kicked == set()
        assert [o["metadata"]["name"] for o in c.by_kind["ConfigMap"].owned("ns", "a")] == ["new", "old"]

    asyncio.run(scenario())


def test_relist_of_one_namespace_leaves_the_others_alone():
    async def scenario() -> None:
        c, kicked = filled(["one", "two"])
        c.put("v1", "ConfigMap", obj("ConfigMap", "x", 10, ns="one"))
        c.put("v1", "ConfigMap", obj("ConfigMap", "y", 11, ns="two"))
        c.put("v1", "ConfigMap", obj("ConfigMap", "z", 12, ns="one", owner="b"))
        kicked.clear()
        relist(c, obj("ConfigMap", "z", 12, ns="one", owner="b"))  # x is gone from "one"
        assert set(c.relists) == {("ConfigMap", "one")}
        c.relisted("ConfigMap", "one")
        assert kicked == {("one", "a")}
        s = c.by_kind["ConfigMap"]
        assert s.get("one", "x") is None and s.get("two", "y") is not None and s.get("one", "z") is not None

    asyncio.run(scenario())


def test_a_relist_ends_on_its_own_once_listing_stops():
    async def scenario() -> None:
        c, kicked = filled()
        c.settle = 0.05
        c.put("v1", "ConfigMap", obj("ConfigMap", "gone", 10))
        relist(c, obj("ConfigMap", "kept", 11))
        await asyncio.sleep(0.2)
        assert not c.relists and c.by_kind["ConfigMap"].get("ns", "gone") is None

    asyncio.run(scenario())


def test_the_first_event_kopf_releases_means_the_caches_are_filled():
    c = cache.Cache(None, lambda *a: None)
    c.put("v1", "ConfigMap", obj("ConfigMap", "c", 1))  # kopf's initial listing: index handlers only
    assert not c.filled
    assert c.event("v1", "ConfigMap", None, obj("ConfigMap", "c", 1)) is True  # listed, not a relist
    assert not c.relists
    assert c.event("v1", "ConfigMap", "MODIFIED", obj("ConfigMap", "c", 2)) is False


def test_an_older_version_never_replaces_a_newer_one():
    s = store()
    s.observe(obj("ConfigMap", "c", 50, data={"v": "ours"}))
    assert s.apply_event("MODIFIED", obj("ConfigMap", "c", 40, data={"v": "late event"})) == set()
    assert s.get("ns", "c")["data"] == {"v": "ours"}
    s.observe(obj("ConfigMap", "c", 45))  # a slow answer to an earlier write
    assert s.get("ns", "c")["data"] == {"v": "ours"}
    assert s.apply_event("DELETED", obj("ConfigMap", "c", 60)) == {("ns", "a")}
    assert s.get("ns", "c") is None


def test_owner_label_change_moves_the_object_between_owners():
    s = store()
    s.apply_event("ADDED", obj("ConfigMap", "c", 1, owner="a"))
    assert s.apply_event("MODIFIED", obj("ConfigMap", "c", 2, owner="b")) == {("ns", "a"), ("ns", "b")}
    assert s.owned("ns", "a") == [] and len(s.owned("ns", "b")) == 1


def test_slim_drops_managed_fields_and_pod_specs():
    pod = obj("Pod", "a-0", 3, spec={"nodeName": "n1", "containers": [{"name": "vllm"}]}, status={"phase": "Running"})
    out = cache.slim(pod, "v1", "Pod")
    assert out["spec"] == {"nodeName": "n1"} and out["status"] == {"phase": "Running"}
    assert "managedFields" not in out["metadata"] and "managedFields" in pod["metadata"]  # the input is untouched
    cm = cache.slim({"metadata": {"name": "x"}, "data": {}}, "v1", "ConfigMap")
    assert (cm["apiVersion"], cm["kind"]) == ("v1", "ConfigMap")  # LIST items come without them
    body = kopf.Body(obj("ConfigMap", "y", 4, data={"k": "v"}))  # what kopf's handlers get
    assert cache.slim(body, "v1", "ConfigMap")["data"] == {"k": "v"}


def test_slim_keeps_only_who_holds_the_name_of_another_owners_object():
    refs = [{"kind": "Deployment", "name": "web", "uid": "u9", "controller": True}]
    theirs = obj("Service", "web", 7, owner=None, spec={"selector": {"app": "web"}}, status={})
    theirs["metadata"] |= {"uid": "u8", "ownerReferences": refs, "labels": {"app": "web"}, "annotations": {"a": "b"}}
    assert cache.slim(theirs, "v1", "Service") == {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "ns", "uid": "u8", "resourceVersion": "7", "ownerReferences": refs}}
    # Ours (labelled), the KVOffloadServes and the pods are kept whole.
    assert cache.slim(obj("Service", "a", 8, spec={}), "v1", "Service")["spec"] == {}
    assert cache.slim(obj("KVOffloadServe", "a", 9, owner=None, spec={}), cache.CR_API_VERSION,
                      "KVOffloadServe")["spec"] == {}


def test_a_name_another_owner_holds_is_refused_from_the_cache_with_no_request():
    """reconcile's NameConflict check reads the holder of a child's name from the cache (the child kinds are
    watched whole): a new resource whose Service name a person's Service holds sends nothing but its status."""
    api = Recording()
    c = cache.Cache(None, lambda ns, name, kind: None)
    kube = cache.CachedKube(api, c)
    c.by_kind["KVOffloadServe"].apply_event("ADDED", {"apiVersion": cache.CR_API_VERSION, "kind": "KVOffloadServe",
                                                      "metadata": {"namespace": "ns", "name": "a", "uid": "ua",
                                                                   "generation": 1, "resourceVersion": "5"},
                                                      "spec": SPEC})
    c.put("v1", "Service", obj("Service", "a", 6, owner=None, spec={"selector": {"app": "mine"}}))
    assert reconcile.reconcile(kube, "ns", "a", Settings()) == reconcile.CHILD_REFUSED
    assert [(m, p.rsplit("/", 1)[1]) for m, p, _ in api.sent] == [("PATCH", "status")]  # no GET, no apply
    valid = next(x for x in kube.get(cr_path("ns", "a"))["status"]["conditions"] if x["type"] == "ConfigValid")
    assert valid["reason"] == "NameConflict" and "Service ns/a already exists" in valid["message"], valid
    assert "no owner" in valid["message"], valid


class Recording(Kube):
    """A Kube that records what would go to the API server and answers writes like it."""

    def __init__(self) -> None:
        self.api, self.timeout, self.sent = None, 1, []

    def request(self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
                content_type: str = "application/json") -> Any:
        self.sent.append((method, path, dict(query or {})))
        if method == "PATCH" and path.endswith("/status"):
            return {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe",
                    "metadata": {"namespace": "ns", "name": "a", "resourceVersion": "99"}, "status": body[1]["value"]}
        if method == "PATCH":
            return {**body, "metadata": {**body["metadata"], "resourceVersion": "98"}}
        return {"items": []}


def test_cached_reads_make_no_request_and_writes_are_read_back():
    sent: list[tuple[str, str, str]] = []
    api = Recording()
    c = cache.Cache(None, lambda ns, name, kind: sent.append((ns, name, kind)))
    kube = cache.CachedKube(api, c)
    c.by_kind["KVOffloadServe"].apply_event("ADDED", {"metadata": {"namespace": "ns", "name": "a",
                                                                   "resourceVersion": "5"}})
    c.by_kind["Pod"].apply_event("ADDED", obj("Pod", "a-0", 6))
    assert kube.get(cr_path("ns", "a"))["metadata"]["resourceVersion"] == "5"
    assert kube.get(cr_path("ns", "nope")) is None
    assert [p["metadata"]["name"] for p in kube.list(collection("v1", "Pod", "ns"), f"{OWNER}=a")] == ["a-0"]
    assert kube.list(collection("v1", "ConfigMap", "ns"), f"{OWNER}=a") == []
    assert api.sent == []  # every read above came from memory

    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"namespace": "ns", "name": "a-lmcache",
                                                                "labels": {OWNER: "a"}}}
    kube.apply(cm, dry_run=True)
    assert kube.list(collection("v1", "ConfigMap", "ns"), f"{OWNER}=a") == []  # a dry run is not a write
    kube.apply(cm)
    assert ([c["metadata"]["name"] for c in kube.list(collection("v1", "ConfigMap", "ns"), f"{OWNER}=a")]
            == ["a-lmcache"])
    kube.replace_status(cr_path("ns", "a"), {"observedGeneration": 1}, "5")
    assert kube.get(cr_path("ns", "a"))["status"] == {"observedGeneration": 1}
    assert [m for m, _, _ in api.sent] == ["PATCH", "PATCH", "PATCH"]
    # Kinds the cache does not hold still go to the API server.
    kube.get("/apis/coordination.k8s.io/v1/namespaces/ns/leases/x")
    assert api.sent[-1][0] == "GET"


def test_kopf_watches_every_cached_kind_and_only_our_pods():
    registry = kopf.get_default_registry()
    settings = kopf.OperatorSettings()
    handlers.tune(settings)
    resources = {kind: Resource(group=api_version.rpartition("/")[0], version=api_version.rpartition("/")[2],
                                plural=collection(api_version, kind, "_").rsplit("/", 1)[1], kind=kind, namespaced=True)
                 for api_version, kind in cache.KINDS}
    # the CR, 10 child kinds, pods
    assert len(resources) == 12 and {"HorizontalPodAutoscaler", "Deployment", "Role"} <= set(resources)
    for kind, resource in resources.items():
        assert registry._indexing.has_handlers(resource=resource), kind  # feeds the cache, gates the first reconcile
        assert registry._watching.has_handlers(resource=resource), kind
        assert not registry._changing.has_handlers(resource=resource)  # so no finalizer, no annotations
        # Only pods are filtered: the child kinds are watched whole (the NameConflict check reads their names).
        want = [OWNER] if kind == "Pod" else []
        assert settings.watching.label_selectors.collect(resource) == want, kind
    assert settings.watching.server_timeout == 300 and settings.watching.client_timeout == 310
    first = list(itertools.islice(iter(settings.networking.error_backoffs), 6))
    assert first == [1, 2, 4, 8, 10, 10] and list(itertools.islice(iter(settings.networking.error_backoffs),
                                                                   2)) == [1, 2]


def test_a_late_delete_of_an_earlier_incarnation_does_not_drop_the_new_one():
    s = store()
    s.apply_event("ADDED", obj("ConfigMap", "c", 10))
    s.observe(obj("ConfigMap", "c", 30))  # deleted at 20 and re-created by us at 30; the watch lags
    assert s.apply_event("DELETED", obj("ConfigMap", "c", 20)) == set()
    assert s.get("ns", "c")["metadata"]["resourceVersion"] == "30"


def test_the_initial_listing_released_after_the_gate_is_not_a_relist():
    """kopf releases the initial LIST's events only once every kind is listed, mixed with watch events of
    objects made meanwhile: none of that is a relist, and nothing may be dropped for it."""
    async def scenario() -> None:
        c = cache.Cache(None, lambda *a: None, settle=0.05)
        c.put("v1", "ConfigMap", obj("ConfigMap", "listed", 1))
        c.put("v1", "ConfigMap", obj("ConfigMap", "listed-too", 2))
        c.put("v1", "ConfigMap", obj("ConfigMap", "added", 3))  # created after the LIST, before the gate
        assert c.event("v1", "ConfigMap", None, obj("ConfigMap", "listed", 1))
        c.event("v1", "ConfigMap", "ADDED", obj("ConfigMap", "added", 3))
        c.event("v1", "ConfigMap", None, obj("ConfigMap", "listed-too", 2))
        await asyncio.sleep(0.2)
        assert not c.relists and len(c.by_kind["ConfigMap"]) == 3 and not c.unreleased

    asyncio.run(scenario())


class Discovery(Kube):
    """Answers discovery only: /apis/<group>/<version> lists `served` (plural names); any other group is a 404."""

    def __init__(self, served: dict[str, list[str]]) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self.served, self.asked = served, []

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        self.asked.append(path)
        gv = path.removeprefix("/apis/")
        if gv not in self.served:
            raise ApiError(404, "Not Found", "{}")
        return {"resources": [{"name": n} for n in self.served[gv]]}


def test_scaled_objects_are_watched_only_with_autoscaler_keda_and_only_where_served(monkeypatch):
    """KEDA's ScaledObject joins the watched kinds (cache, kopf handlers, owner-label selector) before kopf starts,
    only with autoscaler keda and a served CRD; without the CRD the operator runs on, and the reconcile refuses a
    spec.autoscaling naming the field instead of failing on a 404."""
    registry = kopf.OperatorRegistry()
    monkeypatch.setattr(handlers, "_watched", list(render.CHILD_KINDS))
    monkeypatch.setattr(kopf._core.intents.registries, "_default_registry", registry)
    so = Resource(group="keda.sh", version="v1alpha1", plural="scaledobjects", kind="ScaledObject", namespaced=True)
    keda = Settings(autoscaler="keda", prometheus_address="http://127.0.0.1:9090")
    served = Discovery({"keda.sh/v1alpha1": ["scaledobjects", "scaledobjects/status"]})

    assert asyncio.run(handlers.watch_optional_kinds(served, Settings())).missing == () and served.asked == []  # hpa
    assert asyncio.run(handlers.watch_optional_kinds(Discovery({}), keda)).missing == (autoscaling.SCALED_OBJECT,)
    assert handlers._watched == list(render.CHILD_KINDS) and not registry._indexing.has_handlers(resource=so)
    children = pipeline.desired("a", "ns", "u", {**SPEC, "autoscaling": SCALE}, keda).applied
    with pytest.raises(ConfigError) as err:  # before any request (no kube): nothing is half-applied
        reconcile.sync_children(None, "ns", "a", "u", children,  # type: ignore[arg-type]
                                kinds=tuple(handlers._watched))
    assert err.value.field == "spec.autoscaling" and "install KEDA" in err.value.message

    assert asyncio.run(handlers.watch_optional_kinds(served, keda)) == handlers.Watched(keda)
    assert handlers._watched == [*render.CHILD_KINDS, autoscaling.SCALED_OBJECT]
    # auto with a Prometheus: KEDA where served (then watched), else the HPA with nothing missing.
    auto = Settings(prometheus_address="http://127.0.0.1:9090")
    watched = asyncio.run(handlers.watch_optional_kinds(Discovery({}), auto))
    assert watched.missing == () and watched.settings.autoscaler == "hpa"
    monkeypatch.setattr(handlers, "_watched", list(render.CHILD_KINDS))
    watched = asyncio.run(handlers.watch_optional_kinds(served, auto))
    assert watched.missing == () and watched.settings.autoscaler == "keda"
    assert handlers._watched == [*render.CHILD_KINDS, autoscaling.SCALED_OBJECT]
    assert registry._indexing.has_handlers(resource=so) and registry._watching.has_handlers(resource=so)
    settings = kopf.OperatorSettings()
    handlers.tune(settings)
    assert settings.watching.label_selectors.collect(so) == []  # watched whole, as every child kind
    rt = runtime.Runtime(kube=Discovery({}), settings=keda, child_kinds=tuple(handlers._watched))
    assert "ScaledObject" in rt.cache.by_kind
    path = collection(*autoscaling.SCALED_OBJECT, "ns")
    rt.cache.by_kind["ScaledObject"].apply_event("ADDED", {**obj("ScaledObject", "a", 3),
                                                           "apiVersion": "keda.sh/v1alpha1"})
    assert [o["metadata"]["name"] for o in rt.kube.list(path, f"{OWNER}=a")] == ["a"]  # type: ignore[union-attr]
    assert rt.kube.inner.asked == []  # type: ignore[union-attr]  # from the cache: no LIST per reconcile


def test_the_startup_handler_takes_what_run_decided_from_the_memo(monkeypatch):
    """handlers.configure builds the Runtime from the one handlers.Decided in kopf's memo: no environment read."""
    made: dict[str, Any] = {}

    class FakeRuntime:
        def __init__(self, kube: object, settings: Settings, **kw: Any) -> None:
            made.update(settings=settings, **kw)
            self.metrics = self

        def serve(self, listen: str) -> None:
            made["listen"] = listen

        def start(self, lease: object, lease_kube: object) -> None:
            made.update(lease=lease, lease_kube=lease_kube)

    async def served(kube: object) -> None:
        pass

    monkeypatch.setattr(handlers, "_wait_for_crd", served)
    monkeypatch.setattr(handlers, "load_api_client", lambda: None)
    monkeypatch.setattr(handlers, "Kube", lambda client, timeout=None: ("kube", timeout))
    monkeypatch.setattr(handlers, "Runtime", FakeRuntime)
    keda = Settings(autoscaler="keda", prometheus_address="http://127.0.0.1:9090")
    lease = leader.LeaseConfig(namespace="ops", name="l", identity="me")
    memo = kopf.Memo(decided=handlers.Decided(keda, ("a", "b"), "127.0.0.1:9101", lease))
    asyncio.run(handlers.configure(settings=kopf.OperatorSettings(), memo=memo))
    assert made["settings"] is keda and made["namespaces"] == ["a", "b"] and made["listen"] == "127.0.0.1:9101"
    assert made["lease"] is lease and made["lease_kube"] == ("kube", 5)
    made.clear()
    memo = kopf.Memo(decided=handlers.Decided(Settings()))  # every namespace, no metrics, standalone
    asyncio.run(handlers.configure(settings=kopf.OperatorSettings(), memo=memo))
    assert made["namespaces"] is None and "listen" not in made and made["lease"] is None and made["lease_kube"] is None
