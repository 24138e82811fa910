"""spec.offload.server PerNode (issue 35 slice B; docs/shared-cache.md): one LMCache server pod per (resource, node),
shared by the resource's replicas there. Tables for the parse refusals, the Budget, the rendered serving pod and
server children, which nodes get a server (grace period), and SharedCacheReady."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime, timezone

import pytest

from kvoffload.api import crd, rules
from kvoffload.api.errors import ConfigError
from kvoffload.api.quantity import GiB, MiB
from kvoffload.api.settings import Settings, from_dict
from kvoffload.backends import lmcache_server
from kvoffload.cli import main as cli
from kvoffload.cli import prepare_shm
from kvoffload.controller import conditions, pipeline
from kvoffload.rendering import render, shared_cache
from kvtest.specs import spec

ROOT = "/run/kvoffload-shm"
SETTINGS = Settings(shared_memory_root=ROOT)
ADDRESS = "198.19.0.42"


def shared(**patch):
    return spec(**{"offload__backend": "lmcache-server", "offload__server": "PerNode", **patch})


def desired(s=None, settings=SETTINGS, nodes=(), address=ADDRESS):
    return pipeline.desired("chat", "team-a", "uid-1", s or shared(), settings, nodes=nodes, address=address)


def kinds(children):
    return [(c["kind"], c["metadata"]["name"]) for c in children]


def pod_of(children):
    return next(c for c in children if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]


def servers(children):
    return [c for c in children if c["kind"] == "Deployment"]


# --- refusals: the field path and the allowed values, on the backends that cannot share and without the admin's root
@pytest.mark.parametrize("patch, settings, field, words", [
    ({"offload__backend": "lmcache"}, SETTINGS, "spec.offload.server",
     "must be Sidecar with spec.offload.backend lmcache (there is no LMCache server to share"),
    ({"offload__backend": "vllm-native", "offload__disk": None}, SETTINGS, "spec.offload.server",
     "must be Sidecar with spec.offload.backend vllm-native"),
    ({}, Settings(), "spec.offload.server", "operator.config.sharedMemoryRoot); allowed values here: Sidecar"),
    ({"offload__disk": {"storageClassName": "local-nvme", "size": "100Gi"}}, SETTINGS, "spec.offload.server",
     "with spec.offload.disk.storageClassName the allowed value is Sidecar"),
    ({"offload__server": "Everywhere"}, SETTINGS, "spec.offload.server",
     "'Everywhere' is not allowed; allowed values: Sidecar, PerNode"),
    # LMCache 0.5.3's connector never looks up again after one lookup timed out in an outage
    # (tests/engine/test_l2_restart.py runs both pairs' adapters through it).
    ({"engine__image": "ghcr.io/kvoffload/vllm-lmcache:0.26.0-0.5.3", "engine__vllmVersion": "0.26.0",
      "engine__lmcacheVersion": "0.5.3"}, SETTINGS, "spec.offload.server",
     "PerNode needs LMCache >= 0.5.6; the image holds LMCache 0.5.3"),
])
def test_refused_naming_the_field_and_the_allowed_values(patch, settings, field, words):
    s = shared(**patch)
    with pytest.raises(ConfigError) as err:
        desired(s, settings)
    assert err.value.field == field and words in err.value.message, err.value


def test_the_api_server_refuses_what_the_operator_refuses():
    """The CEL rules of the CRD: the backends' refusal (generated from Backend.refuses) and the disk rule."""
    offload = crd.schema_at("offload")
    assert offload["properties"]["server"]["enum"] == ["Sidecar", "PerNode"]
    assert offload["properties"]["server"]["default"] == "Sidecar"
    said = [r["message"] for r in offload["x-kubernetes-validations"]]
    assert rules.SHARED_DISK_ON_NODE.message in said
    assert any(m.startswith("spec.offload.server must be Sidecar with spec.offload.backend lmcache ") for m in said)
    assert any(m.startswith("spec.offload.server must be Sidecar with spec.offload.backend vllm-native ") for m in said)


@pytest.mark.parametrize("value, ok", [("", True), ("/run/kvoffload-shm", True), ("/", False), ("run/x", False),
                                       ("/run/../etc", False), ("/run/x/", False), (7, False)])
def test_the_admins_root_is_a_normalized_absolute_directory(value, ok):
    if ok:
        assert from_dict({"sharedMemoryRoot": value}).shared_memory_root == value
    else:
        with pytest.raises(ConfigError, match="sharedMemoryRoot"):
            from_dict({"sharedMemoryRoot": value})


def test_the_grace_period_is_a_whole_number_of_seconds():
    assert from_dict({"sharedServerGraceSeconds": 0}).shared_server_grace_seconds == 0
    with pytest.raises(ConfigError, match="sharedServerGraceSeconds"):
        from_dict({"sharedServerGraceSeconds": -1})


# --- the Budget: the L1 once per node, in the server pod; none in the vLLM container or its /dev/shm
def test_the_l1_moves_from_every_replica_to_the_nodes_server():
    side = pipeline.plan_for(desired(spec(offload__backend="lmcache-server")).spec)
    per_node = desired().budget
    l1 = 40 * GiB
    term = {t.name: t.bytes for t in per_node.memory_terms}
    assert term["cpu_tier"] == 0 and {t.name: t.bytes for t in side.memory_terms}["cpu_tier"] == l1
    assert side.shm - per_node.shm == l1  # /dev/shm: NCCL's share only
    assert side.memory_request - per_node.memory_request >= l1
    # The L1 in each replica's limit only: vLLM's workers are charged for it if they fault it in first.
    assert per_node.memory_limit == per_node.memory_request + l1
    assert term["l1_limit_only"] == l1
    server = {t.name: t.bytes for t in per_node.server_memory_terms}
    # LMCache 0.5.6 (the default pair's) needs a 4 GiB server baseline (engine/images.py SERVER_BASELINE_FLOOR).
    assert server["l1"] == l1 and server["server_baseline"] == 4 * GiB
    assert per_node.server_memory == per_node.server_memory_limit  # request = limit
    assert per_node.server_memory == -(-(l1 + 4 * GiB + server["headroom"]) // MiB) * MiB
    assert per_node.to_dict()["shared"]["scope"] == "node"
    assert "shared" not in side.to_dict()


def test_kvoffload_plan_sizes_it(capsys):
    assert cli.main(["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--max-model-len", "32768",
                     "--cpu-size", "40Gi", "--backend", "lmcache-server", "--server", "PerNode", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    budget = out[0]["budget"] if isinstance(out, list) else out.get("budget", out)
    assert budget["shared"]["scope"] == "node" and budget["serverMemory"]["request"] == budget["serverMemory"]["limit"]
    assert cli.main(["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--max-model-len", "32768",
                     "--cpu-size", "40Gi", "--backend", "lmcache-server", "--server", "PerNode"]) == 0
    text = capsys.readouterr().out
    assert "shared LMCache server pod, one per node with replicas: request = limit" in text
    assert "memory request: " in text and "l1_limit_only" in text
    # The shared tiers are the node's, not the replica's; the server pod as the operator sizes it for the default pair
    # (LMCache 0.5.6's 4 GiB baseline floor, which plan once left at the 2 GiB setting).
    assert "cpu and disk: the node's shared LMCache server's L1 and L2 (--server PerNode), held once per node" in text
    assert budget["serverMemory"]["terms"][0] == {"name": "server_baseline", "bytes": 4 * GiB,
                                                  "note": "LMCache server process (ZMQ + HTTP, torch)"}
    assert cli.main(["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--cpu-size", "40Gi",
                     "--server", "PerNode"]) == 2
    assert "--backend lmcache runs no LMCache server to share" in capsys.readouterr().err


# --- the serving pod: no sidecar, no L1; the node's server through the Service and the shared directory
def test_the_serving_pod_reaches_its_nodes_server():
    d = desired()
    pod = pod_of(d.children)
    vllm = pod["containers"][0]
    config = json.loads(vllm["args"][vllm["args"].index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "LMCacheMPConnector"
    assert config["kv_connector_extra_config"] == {
        "lmcache.mp.host": f"tcp://{ADDRESS}", "lmcache.mp.port": 5555, "lmcache.mp.mp_transfer_mode": "engine_driven",
        "lmcache.mp.mq_timeout": lmcache_server.SHARED_MQ_TIMEOUT_S}
    assert [c["name"] for c in pod["initContainers"]] == [render.SHM_INIT, render.WAIT_INIT, "report-engine-versions"]
    assert not any(c.get("restartPolicy") == "Always" for c in pod["initContainers"])  # no server sidecar
    assert {"name": "dshm", "mountPath": "/dev/shm", "subPathExpr": "$(POD_NAMESPACE)/chat"} in vllm["volumeMounts"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm == {"name": "dshm", "hostPath": {"path": ROOT, "type": "Directory"}}
    assert not any(v["name"] == "kv-disk" for v in pod["volumes"])  # the L2 is the server's
    assert f"http://{ADDRESS}:8081/status" in pod["containers"][1]["args"]
    # The exporter labels the server's figures with the pod's node (tier="shared"; docs/metrics.md).
    exporter = pod["containers"][1]
    assert exporter["args"][exporter["args"].index("--shared-node") + 1] == "$(NODE_NAME)"
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}}} \
        in exporter["env"]
    assert pod_of(desired(address="").children)["initContainers"][1]["args"][-1] == "chat-cache.team-a.svc:5555"


def test_only_the_init_steps_run_as_root_and_nothing_shares_the_hosts_namespaces():
    d = desired(nodes=(shared_cache.Node("gpu-node-0"),))
    for pod in (pod_of(d.children), servers(d.children)[0]["spec"]["template"]["spec"]):
        assert not any(pod.get(k) for k in ("hostIPC", "hostPID", "hostNetwork"))
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["initContainers"] + pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and "ALL" in sc["capabilities"]["drop"]
            assert sc.get("readOnlyRootFilesystem") is True, c["name"]
            if sc.get("runAsUser") == 0:
                assert c["name"] in (render.SHM_INIT, render.DISK_INIT) and c["image"] == SETTINGS.kvoffload_image
                assert set(sc["capabilities"]["add"]) <= {"CHOWN", "DAC_OVERRIDE", "FOWNER"}
        for v in pod["volumes"]:
            if "hostPath" in v:  # the admin's roots only, each reached through a subPathExpr
                assert v["hostPath"]["path"] in (ROOT, "/mnt/nvme") and v["hostPath"]["type"] == "Directory"
                mounts = [m for c in pod["initContainers"] + pod["containers"] for m in c.get("volumeMounts", [])
                          if m["name"] == v["name"]]
                assert mounts and all("$(POD_NAMESPACE)/chat" in m["subPathExpr"] for m in mounts)


# --- the server's children
def test_one_server_per_wanted_node_pinned_there():
    wanted = (shared_cache.Node("gpu-node-0"), shared_cache.Node("gpu-node-1", "2026-12-03T20:00:00Z"))
    d = desired(nodes=wanted)
    assert kinds(d.children)[:6] == [
        ("Service", "chat"), ("Service", "chat-pods"), ("Service", "chat-cache"), ("NetworkPolicy", "chat-cache"),
        ("Deployment", f"chat-cache-{shared_cache.node_hash('gpu-node-0')}"),
        ("Deployment", f"chat-cache-{shared_cache.node_hash('gpu-node-1')}")]
    first, second = servers(d.children)
    assert first["metadata"]["annotations"] == {shared_cache.NODE_ANNOTATION: "gpu-node-0"}
    assert second["metadata"]["annotations"][shared_cache.IDLE_ANNOTATION] == "2026-12-03T20:00:00Z"
    assert first["spec"]["replicas"] == 1 and first["spec"]["strategy"] == {"type": "Recreate"}
    pod = first["spec"]["template"]
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms == {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                                             "values": ["gpu-node-0"]}]}]}
    # Never the owner label: the serving Service, PDB and StatefulSet select on it.
    assert render.OWNER_LABEL not in pod["metadata"]["labels"]
    assert pod["metadata"]["labels"][shared_cache.SHARED_LABEL] == "chat"
    assert first["metadata"]["labels"][render.OWNER_LABEL] == "chat"  # the reconcile finds its children by it
    (server,) = pod["spec"]["containers"]
    assert "restartPolicy" not in server
    limits, requests = server["resources"]["limits"], server["resources"]["requests"]
    assert limits["memory"] == requests["memory"]
    args = server["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[args.index("--l1-size-gb") + 1] == "40.0"
    assert args[args.index("--shm-name") + 1] == lmcache_server.SERVER_SHM_NAME
    l2 = json.loads(args[args.index("--l2-adapter") + 1])
    assert l2["base_path"] == "/kvcache" and l2["max_capacity_gb"] == 200.0
    disk = next(m for m in server["volumeMounts"] if m["name"] == "kv-disk")
    assert disk["subPathExpr"] == "lmcache/$(POD_NAMESPACE)/chat/chat-cache"
    init = next(c for c in pod["spec"]["initContainers"] if c["name"] == render.DISK_INIT)
    assert init["args"][init["args"].index("--pod") + 1] == "chat-cache" and "--fingerprint" in init["args"]


def test_the_servers_are_fenced_to_the_resources_serving_pods():
    d = desired()
    policy = next(c for c in d.children if c["kind"] == "NetworkPolicy" and c["metadata"]["name"] == "chat-cache")
    assert policy["spec"] == {"podSelector": {"matchLabels": {shared_cache.SHARED_LABEL: "chat"}},
                              "policyTypes": ["Ingress"],
                              "ingress": [{"from": [{"podSelector": {"matchLabels": {
                                  render.OWNER_LABEL: "chat", "app.kubernetes.io/component": "serving"}}}],
                                  "ports": [{"protocol": "TCP", "port": 5555}, {"protocol": "TCP", "port": 8081}]}]}
    svc = next(c for c in d.children if c["kind"] == "Service" and c["metadata"]["name"] == "chat-cache")
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["spec"]["selector"] == {shared_cache.SHARED_LABEL: "chat"}


def test_sidecar_renders_as_before():
    """Sidecar (the default) renders no shared child and keeps the sidecar's loopback wiring."""
    d = desired(spec(offload__backend="lmcache-server"))
    assert not [c for c in d.children if c["metadata"]["name"].startswith("chat-cache")]
    vllm = pod_of(d.children)["containers"][0]
    assert lmcache_server.MP_KV_TRANSFER_CONFIG in vllm["args"]


# --- which nodes get a server
NOW = datetime(2026, 12, 3, 22, 0, 0)


@pytest.mark.parametrize("serving, live, want", [
    ({"a"}, {}, [("a", "")]),
    ({"a"}, {"a": "2026-12-03T21:00:00Z"}, [("a", "")]),  # a replica came back: no longer idle
    (set(), {"a": ""}, [("a", "2026-12-03T22:00:00Z")]),  # the last replica just left: its grace begins now
    (set(), {"a": "2026-12-03T21:55:00Z"}, [("a", "2026-12-03T21:55:00Z")]),  # within the grace period
    (set(), {"a": "2026-12-03T21:49:59Z"}, []),  # past it: pruned
    (set(), {"a": "not a time"}, [("a", "2026-12-03T22:00:00Z")]),  # unreadable: its grace begins now
    ({"b", "a"}, {"c": "2026-12-03T21:59:00Z"}, [("a", ""), ("b", ""), ("c", "2026-12-03T21:59:00Z")]),
])
def test_nodes_with_replicas_and_servers_in_their_grace_period(serving, live, want):
    assert [(n.name, n.idle_since) for n in shared_cache.nodes(serving, live, NOW, 600)] == want


def test_a_pod_being_deleted_or_not_bound_holds_no_node():
    serving = render.serving_labels(render.Owner("chat", "team-a"))
    pods = [{"metadata": {"labels": serving}, "spec": {"nodeName": "a"}},
            {"metadata": {"labels": serving, "deletionTimestamp": "x"}, "spec": {"nodeName": "b"}},
            {"metadata": {"labels": serving}, "spec": {}},
            {"metadata": {"labels": {render.OWNER_LABEL: "chat"}}, "spec": {"nodeName": "c"}}]
    assert shared_cache.serving_nodes(pods, serving) == {"a"}


# --- SharedCacheReady
def deployment(node, ready):
    return {"metadata": {"annotations": {shared_cache.NODE_ANNOTATION: node}},
            "status": {"readyReplicas": 1 if ready else 0}}


@pytest.mark.parametrize("s, nodes, live, status, reason, words", [
    (spec(offload__backend="lmcache-server"), (), (), "False", "NotConfigured", "not PerNode"),
    (None, (), (), "False", "NoReplicasPlaced", "reached at 198.19.0.42"),
    (None, (shared_cache.Node("a"),), (), "False", "ServersNotReady", "0/1 node(s)"),
    (None, (shared_cache.Node("a"), shared_cache.Node("b")), (deployment("a", True), deployment("b", False)),
     "False", "ServersNotReady", "not ready on b: replicas starting there wait for it"),
    (None, (shared_cache.Node("a"), shared_cache.Node("z", "2026-12-03T21:00:00Z")), (deployment("a", True),),
     "True", "ServersReady", "kept until their grace period ends: z (no replica since 2026-12-03T21:00:00Z)"),
])
def test_shared_cache_ready(s, nodes, live, status, reason, words):
    d = desired(s, nodes=nodes)
    body = {"metadata": {"name": "chat", "namespace": "team-a", "generation": 1}, "spec": {}}
    out = conditions.status(body, d, None, conditions.Observed(None, [], servers=live))
    (c,) = [c for c in out["conditions"] if c["type"] == "SharedCacheReady"]
    assert (c["status"], c["reason"]) == (status, reason) and words in c["message"], c


def test_desired_is_cached_per_nodes_and_address():
    cache = pipeline.DesiredCache()
    a = cache.get("chat", "team-a", "uid-1", shared(), SETTINGS, (), (shared_cache.Node("a"),), ADDRESS)
    assert cache.get("chat", "team-a", "uid-1", shared(), SETTINGS, (), (shared_cache.Node("a"),), ADDRESS) is a
    b = cache.get("chat", "team-a", "uid-1", shared(), SETTINGS, (), (shared_cache.Node("b"),), ADDRESS)
    assert servers(b.children)[0]["metadata"]["annotations"][shared_cache.NODE_ANNOTATION] == "b"
    assert dataclasses.replace(b, children=[]).address == ADDRESS


# --- the init steps' commands
def test_prepare_shared_memory_hands_the_directory_over(tmp_path):
    d = tmp_path / "team-a" / "chat"
    d.mkdir(parents=True)
    uid, gid = os.getuid(), os.getgid()
    assert prepare_shm.prepare(str(d), uid, gid) == (uid, gid, 0o700)
    assert prepare_shm.prepare(str(d), uid, gid) == (uid, gid, 0o700)  # a second pod's step: already handed over
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(ConfigError, match="--dir"):  # a link is refused, never followed
        prepare_shm.prepare(str(link), uid, gid)


def test_wait_for_shared_cache(capsys):
    import socket

    from kvoffload.cli import wait_server
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        assert cli.main(["wait-for-shared-cache", "--address", f"127.0.0.1:{port}", "--timeout", "5"]) == 0
    assert not wait_server.wait("127.0.0.1", port, timeout=0.2, interval=0.1)
    assert cli.main(["wait-for-shared-cache", "--address", "nohost"]) == 2


# --- the reconcile's reads for PerNode (controller/reconcile.py), against a stand-in of the operator's cached client
class Cached:
    """get/list/apply as controller.cache.CachedKube answers them, from a dict of objects by path."""

    def __init__(self, objects: dict[str, dict], lists: dict[str, list[dict]] | None = None) -> None:
        self.objects, self.lists, self.applied = objects, lists or {}, []

    def get(self, path):
        return self.objects.get(path)

    def list(self, path, selector):
        return self.lists.get(path, [])

    def apply(self, obj):
        self.applied.append(obj)
        return {**obj, "spec": {**obj["spec"], "clusterIP": "198.19.0.7"}}


OURS = [{"uid": "uid-1", "controller": True}]
SVC = "/api/v1/namespaces/team-a/services/chat-cache"


def test_the_address_is_the_clusterip_of_our_own_service():
    from kvoffload.controller import reconcile
    assert reconcile._cluster_ip(None, "uid-1") == ""
    assert reconcile._cluster_ip({"metadata": {"ownerReferences": OURS}, "spec": {"clusterIP": "1.2.3.4"}},
                                 "uid-1") == "1.2.3.4"
    theirs = {"metadata": {"ownerReferences": [{"uid": "other", "controller": True}]}, "spec": {"clusterIP": "9.9.9.9"}}
    assert reconcile._cluster_ip(theirs, "uid-1") == ""  # another owner's: NameConflict comes from sync_children


def test_the_service_is_created_first_only_when_absent():
    from kvoffload.controller import reconcile
    d = desired(address="")
    kube = Cached({})
    assert reconcile._create_service(kube, d, "team-a", "chat", "uid-1") == "198.19.0.7"  # applied; its ClusterIP
    (svc,) = kube.applied
    assert svc["kind"] == "Service" and svc["metadata"]["name"] == "chat-cache"
    kube = Cached({SVC: {"metadata": {}}})
    assert reconcile._create_service(kube, d, "team-a", "chat", "uid-1") == "" and not kube.applied


def test_the_nodes_come_from_the_cached_pods_and_servers():
    from kvoffload.controller import reconcile
    serving = render.serving_labels(render.Owner("chat", "team-a"))
    pods = [{"metadata": {"labels": serving}, "spec": {"nodeName": "a"}}]
    idle = {"metadata": {"ownerReferences": OURS, "labels": {"app.kubernetes.io/component": shared_cache.COMPONENT},
                         "annotations": {shared_cache.NODE_ANNOTATION: "b",
                                         shared_cache.IDLE_ANNOTATION: "2026-12-03T21:59:00Z"}}}
    kube = Cached({SVC: {"metadata": {"ownerReferences": OURS}, "spec": {"clusterIP": "198.19.0.7"}}},
                  {"/apis/apps/v1/namespaces/team-a/deployments": [idle]})
    nodes, address = reconcile._shared_servers(kube, "team-a", "chat", "uid-1", pods, SETTINGS,
                                               datetime(2026, 12, 3, 22, 0, 0, tzinfo=timezone.utc))
    assert nodes == (shared_cache.Node("a"), shared_cache.Node("b", "2026-12-03T21:59:00Z"))
    assert address == "198.19.0.7"


# --- warm start: new replicas prefer a node where the resource's server runs (docs/autoscaling.md)
WARM = {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": {shared_cache.SHARED_LABEL: "chat"}},
                                           "topologyKey": "kubernetes.io/hostname"}}


def test_new_replicas_prefer_a_node_whose_server_exists():
    pod = pod_of(desired().children)
    assert pod["affinity"] == {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [WARM]}}
    # The selector is exactly the server pods' label (shared_cache.pod_labels), never the serving pods'.
    labels = servers(desired(nodes=(shared_cache.Node("n"),)).children)[0]["spec"]["template"]["metadata"]["labels"]
    assert WARM["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    assert render.OWNER_LABEL not in labels
    assert "affinity" not in pod_of(desired(spec(offload__backend="lmcache-server")).children)  # Sidecar: none


def test_the_users_affinity_is_kept_and_the_warm_start_added():
    mine = {"weight": 10, "podAffinityTerm": {"labelSelector": {"matchLabels": {"app": "db"}},
                                              "topologyKey": "topology.kubernetes.io/zone"}}
    zone = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}
    user = {"nodeAffinity": zone, "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [mine]}}
    pod = pod_of(desired(shared(scheduling__affinity=user)).children)
    assert pod["affinity"] == {"nodeAffinity": zone,
                               "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [mine, WARM]}}
    assert user["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [mine]  # not mutated


# --- routing: vllm-router knows workers, not nodes (docs/routing.md, "A shared tier (PerNode)")
def test_cache_aware_counts_the_nodes_shared_tier_for_each_replica():
    """PerNode: the Budget's cpu and disk tiers are the node server's L1 and L2; each replica serves from them, so
    cache_aware's per-replica tree counts the shared tier where it is the largest worthwhile one (here a 160Gi L1
    beats the GPU tier), and kv_aware names it as a tier whose events the router cannot see."""
    from kvoffload.planning import routing as plan_routing
    from kvoffload.rendering import routing

    big = desired(shared(offload__cpu={"size": "160Gi"}, routing={"policy": "cache_aware"}))
    b = big.budget
    assert b.shared and b.tier("cpu").tokens > b.tier("gpu").tokens
    router = next(c for c in big.children if c["kind"] == "Deployment" and c["metadata"]["name"] == "chat-router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    tree = args[args.index("--max-tree-size") + 1]
    assert tree == str(8 * b.tier("cpu").tokens) == str(plan_routing.max_tree_size(b))
    kv = desired(shared(routing={"policy": "kv_aware"}))
    assert routing.unseen(kv.spec, kv.budget) == ("cpu",)  # the shared L1: no events vllm-router admits
