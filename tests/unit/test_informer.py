"""The watch-fed cache: relists replace what a broken watch hid, older versions never win, reads of
cached kinds make no request, and writes land in the cache (read-your-writes)."""

from __future__ import annotations

from typing import Any

from kvoffload.controller import informer
from kvoffload.controller.kube import Kube, collection
from kvoffload.controller.reconcile import cr_path
from kvoffload.rendering import render

OWNER = render.OWNER_LABEL


def obj(kind: str, name: str, rv: int, owner: str | None = "a", ns: str = "ns", **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": ns, "name": name, "resourceVersion": str(rv),
                            "managedFields": [{"manager": "x"}]}
    if owner:
        meta["labels"] = {OWNER: owner}
    return {"apiVersion": "v1", "kind": kind, "metadata": meta, **extra}


def store() -> informer.Store:
    return informer.Store("ConfigMap", informer._owner_label)


def test_relist_drops_what_the_broken_watch_never_deleted_and_kicks_its_owner():
    s = store()
    s.apply_event("ADDED", obj("ConfigMap", "a-lmcache", 10))
    s.apply_event("ADDED", obj("ConfigMap", "b-lmcache", 11, owner="b"))
    # The watch broke; meanwhile a-lmcache was deleted and b-lmcache changed. The new LIST says so.
    touched = s.replace(None, [obj("ConfigMap", "b-lmcache", 20, owner="b", data={"k": "v"})], "25")
    assert touched == {("ns", "a"), ("ns", "b")}
    assert s.get("ns", "a-lmcache") is None and s.owned("ns", "a") == []
    assert s.get("ns", "b-lmcache")["data"] == {"k": "v"}


def test_relist_keeps_what_we_wrote_after_its_snapshot_and_touches_nothing_unchanged():
    s = store()
    s.apply_event("ADDED", obj("ConfigMap", "old", 10))
    s.observe(obj("ConfigMap", "new", 30))  # our own apply, answered after the LIST's snapshot (rv 25)
    touched = s.replace(None, [obj("ConfigMap", "old", 10)], "25")
    assert touched == set()
    assert [o["metadata"]["name"] for o in s.owned("ns", "a")] == ["new", "old"]


def test_relist_of_one_namespace_leaves_the_others_alone():
    s = store()
    s.apply_event("ADDED", obj("ConfigMap", "x", 10, ns="one"))
    s.apply_event("ADDED", obj("ConfigMap", "y", 11, ns="two"))
    assert s.replace("one", [], "30") == {("one", "a")}
    assert s.get("one", "x") is None and s.get("two", "y") is not None


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
    out = informer.slim(pod, "v1", "Pod")
    assert out["spec"] == {"nodeName": "n1"} and out["status"] == {"phase": "Running"}
    assert "managedFields" not in out["metadata"] and "managedFields" in pod["metadata"]  # the input is untouched
    cm = informer.slim({"metadata": {"name": "x"}, "data": {}}, "v1", "ConfigMap")
    assert (cm["apiVersion"], cm["kind"]) == ("v1", "ConfigMap")  # LIST items come without them


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
    cache = informer.Cache(api, None, lambda ns, name, kind: sent.append((ns, name, kind)))
    kube = informer.CachedKube(api, cache)
    cache.by_kind["KVOffloadServe"].apply_event("ADDED", {"metadata": {"namespace": "ns", "name": "a", "resourceVersion": "5"}})
    cache.by_kind["Pod"].apply_event("ADDED", obj("Pod", "a-0", 6))
    assert kube.get(cr_path("ns", "a"))["metadata"]["resourceVersion"] == "5"
    assert kube.get(cr_path("ns", "nope")) is None
    assert [p["metadata"]["name"] for p in kube.list(collection("v1", "Pod", "ns"), f"{OWNER}=a")] == ["a-0"]
    assert kube.list(collection("v1", "ConfigMap", "ns"), f"{OWNER}=a") == []
    assert api.sent == []  # every read above came from memory

    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"namespace": "ns", "name": "a-lmcache", "labels": {OWNER: "a"}}}
    kube.apply(cm, dry_run=True)
    assert kube.list(collection("v1", "ConfigMap", "ns"), f"{OWNER}=a") == []  # a dry run is not a write
    kube.apply(cm)
    assert [c["metadata"]["name"] for c in kube.list(collection("v1", "ConfigMap", "ns"), f"{OWNER}=a")] == ["a-lmcache"]
    kube.replace_status(cr_path("ns", "a"), {"observedGeneration": 1}, "5")
    assert kube.get(cr_path("ns", "a"))["status"] == {"observedGeneration": 1}
    assert [m for m, _, _ in api.sent] == ["PATCH", "PATCH", "PATCH"]
    # Kinds the cache does not hold still go to the API server.
    kube.get("/apis/coordination.k8s.io/v1/namespaces/ns/leases/x")
    assert api.sent[-1][0] == "GET"


def test_informers_per_namespace_or_cluster_wide():
    cache = informer.Cache(Recording(), ["one", "two"], lambda *a: None)
    paths = sorted(i.path for i in cache.informers)
    assert len(paths) == 14 and "/api/v1/namespaces/one/pods" in paths  # 7 kinds x 2 namespaces
    wide = informer.Cache(Recording(), None, lambda *a: None)
    assert sorted(i.path for i in wide.informers) == sorted([
        "/apis/kvoffload.io/v1alpha1/kvoffloadserves", "/api/v1/configmaps", "/api/v1/services",
        "/apis/apps/v1/statefulsets", "/apis/policy/v1/poddisruptionbudgets",
        "/apis/networking.k8s.io/v1/networkpolicies", "/api/v1/pods"])
    assert {i.selector for i in wide.informers if i.kind != "KVOffloadServe"} == {OWNER}


def test_a_late_delete_of_an_earlier_incarnation_does_not_drop_the_new_one():
    s = store()
    s.apply_event("ADDED", obj("ConfigMap", "c", 10))
    s.observe(obj("ConfigMap", "c", 30))  # deleted at 20 and re-created by us at 30; the watch lags
    assert s.apply_event("DELETED", obj("ConfigMap", "c", 20)) == set()
    assert s.get("ns", "c")["metadata"]["resourceVersion"] == "30"
