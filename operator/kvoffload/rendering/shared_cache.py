"""spec.offload.server PerNode: one LMCache server pod per (resource, node), shared by the resource's replicas on that
node (docs/shared-cache.md). Pure: which nodes get a server, and each node's children.

- Which nodes: every node a serving pod of the resource is bound to (spec.nodeName, from the operator's pod cache),
  plus each node whose server lost its last replica less than the grace period ago (operator setting
  sharedServerGraceSeconds): the Deployment carries when that happened (IDLE_ANNOTATION), so the decision survives
  an operator restart. A node that is neither is not rendered, and the reconcile prunes its Deployment.
- Each node: a Deployment of one pod (so kubelet and the ReplicaSet bring a killed or deleted server back), pinned
  to the node by node affinity on metadata.name (as DaemonSets are), strategy Recreate (two servers of one resource
  on one node would share the L1's segment name and the L2 directory).
- Transport: shared memory. The server and the serving pods mount <sharedMemoryRoot>/<namespace>/<name> (a hostPath:
  the admin's tmpfs root as the volume, the rest a subPathExpr from the downward API) at /dev/shm, where the server's
  L1 segment lives and vLLM's workers copy KV into it (engine-driven). ZMQ (LMCache's control messages) goes through
  one Service per resource with internalTrafficPolicy Local: kube-proxy sends each replica to its own node's server,
  and a node without one refuses the connection (vLLM's connector then runs degraded: no hits, requests answered).
- Fence: the server pods carry no OWNER_LABEL (the serving Service, PDB and StatefulSet select on it) but their own
  SHARED_LABEL; their NetworkPolicy admits only this resource's serving pods, on the ZMQ and HTTP ports (LMCache's
  server has no authentication). Tenants never share a server: one per resource, in the resource's namespace.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..api.managed import SERVER_HTTP_PORT, SERVER_ZMQ_PORT
from .placement import HOSTNAME

if TYPE_CHECKING:  # annotations only: the GPU host imports this without the API client
    from ..api.spec import Spec

# The scheduler's weight (1-100) of a new replica's preference for a node that runs this resource's server: the most a
# preferred term can weigh, since a warm node is what the preference is for (the score's other plugins still count).
WARM_START_WEIGHT = 100
COMPONENT = "shared-cache"  # app.kubernetes.io/component of the server's Deployment, Service and pods
SHARED_LABEL = "kvoffload.io/shared-cache"  # on the server pods: the resource's name (never OWNER_LABEL)
NODE_HASH_LABEL = "kvoffload.io/node-hash"  # a node name can be 253 characters; a label value 63
NODE_ANNOTATION = "kvoffload.io/node"
IDLE_ANNOTATION = "kvoffload.io/idle-since"  # when the node's last replica of the resource left (RFC 3339, UTC)
SUFFIX = "cache"  # <name>-cache: the Service and NetworkPolicy; <name>-cache-<node hash>: a node's Deployment
SHM_MOUNT_PATH = "/dev/shm"


def service_name(owner_name: str) -> str:
    return f"{owner_name}-{SUFFIX}"


def server_dir(owner_name: str) -> str:
    """The shared server's directory beside its replicas' own under <root>/<rel>/<namespace>/<name>/ (the disk tier's
    init step takes it as its --pod): never a StatefulSet pod's name, which ends in an ordinal."""
    return service_name(owner_name)


def node_hash(node: str) -> str:
    return hashlib.sha256(node.encode()).hexdigest()[:10]


def deployment_name(owner_name: str, node: str) -> str:
    return f"{service_name(owner_name)}-{node_hash(node)}"


def dns_address(owner_name: str, namespace: str) -> str:
    """The Service's cluster DNS name: what offline rendering writes, where no API server gave it an address."""
    return f"{service_name(owner_name)}.{namespace}.svc"


def with_address(spec: Spec, owner_name: str, namespace: str, address: str) -> Spec:
    """The spec with where vLLM reaches its node's server: the Service's ClusterIP (reconcile reads it, so no cluster
    DNS is needed and a zmq reconnect resolves nothing), else its DNS name."""
    if not spec.offload.shared:
        return spec
    return dataclasses.replace(spec, offload=dataclasses.replace(
        spec.offload, shared_address=address or dns_address(owner_name, namespace)))


@dataclasses.dataclass(frozen=True)
class Node:
    """A node that gets the resource's server: its name, and since when it has no replica ("" while it has)."""
    name: str
    idle_since: str = ""


def iso(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(text: str) -> datetime | None:
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=None)
    except (TypeError, ValueError):
        return None


def serving_nodes(pods: list[dict[str, Any]], serving: Mapping[str, str]) -> set[str]:
    """Nodes the resource's serving pods (labels `serving`) are bound to; a pod being deleted has left."""
    out = set()
    for p in pods:
        meta = p.get("metadata") or {}
        labels = meta.get("labels") or {}
        node = (p.get("spec") or {}).get("nodeName")
        if node and not meta.get("deletionTimestamp") and all(labels.get(k) == v for k, v in serving.items()):
            out.add(node)
    return out


def live_servers(deployments: list[dict[str, Any]]) -> dict[str, str]:
    """node -> idle-since ("" while it has replicas) of the resource's server Deployments as read."""
    out = {}
    for d in deployments:
        meta = d.get("metadata") or {}
        if (meta.get("labels") or {}).get("app.kubernetes.io/component") != COMPONENT:
            continue
        node = (meta.get("annotations") or {}).get(NODE_ANNOTATION)
        if node and not meta.get("deletionTimestamp"):
            out[node] = (meta.get("annotations") or {}).get(IDLE_ANNOTATION, "")
    return out


def nodes(serving: set[str], live: Mapping[str, str], now: datetime, grace_s: int) -> tuple[Node, ...]:
    """The nodes whose server is wanted now, sorted: each node with a replica, and each live server's node without
    one until `grace_s` after it lost its last (from its idle-since; one without a readable one starts its grace
    now). `now` is naive UTC."""
    out = [Node(n) for n in serving]
    for node, since in live.items():
        if node in serving:
            continue
        began = parse_iso(since) or now
        if now < began + timedelta(seconds=grace_s):
            out.append(Node(node, iso(began)))
    return tuple(sorted(out, key=lambda n: n.name))


def warm_start_term(owner_name: str) -> dict[str, Any]:
    """A serving pod's preference for a node where the resource's server runs: a replica the autoscaler (or a scale-up,
    or a reschedule) adds lands, where it can, on a node whose server holds the resource's prefixes (its L1 while it
    runs, its kept L2 too), and its first requests can hit there; elsewhere it starts cold and needs a server of its
    own. A server runs on every node with a replica, and on a node whose last replica left less than the grace period
    ago, so this also prefers nodes that already serve the resource over empty ones. Preferred, never required: a new
    replica still schedules where no server runs."""
    return {"weight": WARM_START_WEIGHT, "podAffinityTerm": {
        "labelSelector": {"matchLabels": {SHARED_LABEL: owner_name}}, "topologyKey": HOSTNAME}}


def with_warm_start(owner_name: str, affinity: Mapping[str, Any] | None) -> dict[str, Any]:
    """spec.scheduling.affinity (or none) with warm_start_term added to its preferred pod affinity terms (the user's
    terms kept, first)."""
    out = dict(affinity or {})
    pod_affinity = dict(out.get("podAffinity") or {})
    key = "preferredDuringSchedulingIgnoredDuringExecution"
    pod_affinity[key] = [*(pod_affinity.get(key) or []), warm_start_term(owner_name)]
    out["podAffinity"] = pod_affinity
    return out


def service(meta: dict[str, Any], owner_name: str) -> dict[str, Any]:
    """One Service for every node's server: internalTrafficPolicy Local keeps each replica on its own node's."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"type": "ClusterIP", "internalTrafficPolicy": "Local", "selector": {SHARED_LABEL: owner_name},
                     "ports": [{"name": "zmq", "port": SERVER_ZMQ_PORT, "targetPort": SERVER_ZMQ_PORT,
                                "protocol": "TCP"},
                               {"name": "http", "port": SERVER_HTTP_PORT, "targetPort": SERVER_HTTP_PORT,
                                "protocol": "TCP"}]}}


def network_policy(meta: dict[str, Any], owner_name: str, serving: Mapping[str, str]) -> dict[str, Any]:
    """Only this resource's serving pods reach its servers (ZMQ and the /status the exporters read); nothing else,
    whatever spec.networkPolicy says (LMCache's server authenticates nobody)."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": {"matchLabels": {SHARED_LABEL: owner_name}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": dict(serving)}}],
                                  "ports": [{"protocol": "TCP", "port": p}
                                            for p in (SERVER_ZMQ_PORT, SERVER_HTTP_PORT)]}]}}


def shm_volume(spec: Spec) -> dict[str, Any]:
    """Exactly the admin's tmpfs root, which must exist (Directory): DirectoryOrCreate would make it on the node's
    root file system, and the L1 would fill the disk instead of memory."""
    return {"name": "dshm", "hostPath": {"path": spec.offload.shared_memory_root, "type": "Directory"}}


def shm_mount(owner_name: str) -> dict[str, Any]:
    """The resource's own directory of the root as /dev/shm; kubelet opens each component with O_NOFOLLOW and
    refuses one that leaves the volume. POD_NAMESPACE comes from the downward API (refused in spec.engine.env)."""
    return {"name": "dshm", "mountPath": SHM_MOUNT_PATH, "subPathExpr": f"$(POD_NAMESPACE)/{owner_name}"}


def pod_labels(owner_name: str, node: str, base: Mapping[str, str]) -> dict[str, str]:
    """The server pods' labels: `base` (the chart's and the app.kubernetes.io ones, without the owner label) and
    their own."""
    return {**base, "app.kubernetes.io/component": COMPONENT, SHARED_LABEL: owner_name,
            NODE_HASH_LABEL: node_hash(node)}


def deployment(meta: dict[str, Any], owner_name: str, node: Node, labels: Mapping[str, str],
               pod: dict[str, Any]) -> dict[str, Any]:
    """`node`'s server: `pod` (rendering.render builds it) pinned there, one replica, replaced not rolled."""
    annotations = {NODE_ANNOTATION: node.name, **({IDLE_ANNOTATION: node.idle_since} if node.idle_since else {})}
    selector = {SHARED_LABEL: owner_name, NODE_HASH_LABEL: node_hash(node.name)}
    pinned = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node.name]}]}]}}}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {**meta, "annotations": {**meta.get("annotations", {}), **annotations}},
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": selector},
                     "template": {"metadata": {"labels": pod_labels(owner_name, node.name, labels)},
                                  "spec": {**pod, "affinity": pinned}}}}


def children(meta: Callable[[str], dict[str, Any]], owner_name: str, serving: Mapping[str, str],
             labels: Mapping[str, str], wanted: tuple[Node, ...],
             pod: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
    """The Service, the NetworkPolicy and one Deployment per wanted node (`meta(name)`: a child's metadata, which keeps
    the owner label: the reconcile finds its children by it; `labels`: the server pods' base labels)."""
    def own(name: str) -> dict[str, Any]:
        m = meta(name)
        return {**m, "labels": {**m["labels"], "app.kubernetes.io/component": COMPONENT}}

    name = service_name(owner_name)
    server_pod = pod() if wanted else {}
    return [service(own(name), owner_name), network_policy(own(name), owner_name, serving),
            *(deployment(own(deployment_name(owner_name, n.name)), owner_name, n, labels, server_pod)
              for n in wanted)]
