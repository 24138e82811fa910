"""spec.routing -> vLLM's router in front of the replicas: a Deployment and a Service, and the least privilege it
needs to discover exactly this resource's serving pods (a ServiceAccount and a Role that lists and watches pods in
its own namespace, bound to it). Pure. docs/routing.md explains the policy and the figures it is given.

The router's flags are vllm-router 0.1.17's (engine/router.py says where each was verified). Its pods do not carry
the serving pods' selector label (kvoffload.io/serve), so neither the serving Service, the PDB nor the router's own
discovery ever selects them.

kv_aware: the router indexes KV events only for the workers it was started with, so the operator starts it with the
serving pods that are Ready (`--worker-urls`, each with its publisher and replay endpoint as a static event source)
and keeps Kubernetes discovery on beside them: a pod that leaves is dropped at once, one that joins is routed on load
until the next render names it (the router Deployment rolls; the old router finishes its requests in flight).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import backends
from ..api import pod_status
from ..api.settings import Settings
from ..api.spec import RoutingSpec, Spec
from ..backends.base import HTTP_PORT, field_env
from ..engine import flags as engine_flags
from ..engine import router as engine_router
from ..planning import routing as plan_routing
from ..planning.sizing import Budget
from . import pod_security

ROUTER_LABEL = "kvoffload.io/router"
# Kinds this module renders (render.CHILD_KINDS lists them with the rest, in apply order: RBAC before the pods).
KINDS = (("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "Role"),
         ("rbac.authorization.k8s.io/v1", "RoleBinding"),
         ("apps/v1", "Deployment"))
# The engine's KV-event topic (kv_aware only): vLLM's KVEventsConfig default, "". vllm-router 0.1.17 drops every message
# whose topic frame is not exactly the static source's topic, which its command line leaves "" (src/kv_index/
# subscriber.rs; src/config/mod.rs parse_static_kv_event_sources).
KV_EVENTS_TOPIC = ""
# A replaced router pod: seconds it keeps serving after it is told to go (its Service endpoint is removed meanwhile),
# then seconds its requests in flight have to finish (a long completion streams for minutes).
ROUTER_DRAIN_S = 5
ROUTER_FINISH_S = 600


def name(owner_name: str) -> str:
    return f"{owner_name}-router"


def pod_labels(owner_name: str, settings: Settings) -> dict[str, str]:
    return {**settings.labels, "app.kubernetes.io/name": "vllm-router", "app.kubernetes.io/instance": owner_name,
            "app.kubernetes.io/component": "router", "app.kubernetes.io/managed-by": "kvoffload",
            "app.kubernetes.io/part-of": "kvoffload", ROUTER_LABEL: owner_name}


def unseen(spec: Spec, budget: Budget) -> tuple[str, ...]:
    """The offload tiers worth a hit (credit above 0) whose KV events the engine does not publish: kv_aware's router
    cannot see what they hold (status.routing.unseenTiers, under kv_aware)."""
    shown = backends.get(spec.offload.backend).event_tiers
    return tuple(t for t, c in plan_routing.credits(budget).items() if c > 0 and t not in shown)


# What `auto` runs: the policy that served best on real engines. On an H200, two vllm-native replicas behind the
# rendered router (docs/benchmarks.md "GPU: routing on real engines"), cache_aware with the operator's tree budget had
# the lowest mean TTFT on every workload: 16-18% below kv_aware with the operator's credits when documents overflow
# the GPU tier into the CPU tier, whose events kv_aware does see (its load weighting sent a quarter of the repeats to a
# replica that had to recompute them), and it recomputed nothing after the cold round.
AUTO_POLICY = "cache_aware"


def resolve(spec: Spec) -> Spec:
    """The spec with spec.routing.policy's `auto` resolved (AUTO_POLICY, on every backend)."""
    routing = spec.routing
    if routing is None or routing.policy != "auto":
        return spec
    return dataclasses.replace(spec, routing=dataclasses.replace(routing, policy=AUTO_POLICY))


def event_ports(spec: Spec) -> tuple[int, ...]:
    """Ports of the serving pods that the router reads besides the serving port: the KV-event publisher's and its
    replay endpoint's (kv_aware)."""
    if spec.routing is None or spec.routing.policy != "kv_aware":
        return ()
    return engine_router.KV_EVENTS_PORT, engine_router.KV_EVENTS_REPLAY_PORT


def kv_events_args(spec: Spec, budget: Budget) -> list[str]:
    """The vLLM flags that publish the engine's KV events where kv_aware reads them (none for other policies)."""
    if not event_ports(spec):
        return []
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{engine_router.KV_EVENTS_PORT}",
              "replay_endpoint": f"tcp://*:{engine_router.KV_EVENTS_REPLAY_PORT}", "topic": KV_EVENTS_TOPIC}
    return ["--kv-events-config", json.dumps(config, separators=(",", ":")),
            *backends.get(spec.offload.backend).kv_events_args(spec, budget)]


def workers(pods: Iterable[Mapping[str, Any]], serving: Mapping[str, str]) -> tuple[str, ...]:
    """The pod IPs kv_aware's router is started with: the serving pods (labels `serving`) that are Ready and not
    leaving, in name order (a pod that is not Ready would hold the router's start-up: it waits for every worker it
    is given)."""
    live = [p for p in pods if serving.items() <= (p["metadata"].get("labels") or {}).items()
            and not p["metadata"].get("deletionTimestamp") and (p.get("status") or {}).get("podIP")
            and pod_status.ready(p)]
    return tuple(p["status"]["podIP"] for p in sorted(live, key=lambda p: p["metadata"]["name"]))


def _host(ip: str) -> str:
    """An IP as a URL's host: an IPv6 address in brackets."""
    return f"[{ip}]" if ":" in ip else ip


def _worker_url(ip: str) -> str:
    # The router's own spelling of a discovered pod (http://<SocketAddr>), so discovery and the static list agree.
    return f"http://{_host(ip)}:{HTTP_PORT}"


def _zmq(ip: str, port: int) -> str:
    return f"tcp://{_host(ip)}:{port}"


def worker_args(spec: Spec, ips: tuple[str, ...]) -> list[str]:
    """kv_aware's workers, each with its KV-event publisher and replay endpoint (static sources: the router asks the
    engines nothing over HTTP), the block size and the model identity they share."""
    if not ips:
        return []
    args = ["--worker-urls", *map(_worker_url, ips)]
    for ip in ips:
        args += ["--kv-event-source", f"{_worker_url(ip)}={_zmq(ip, engine_router.KV_EVENTS_PORT)}",
                 "--kv-event-replay-source", f"{_worker_url(ip)}={_zmq(ip, engine_router.KV_EVENTS_REPLAY_PORT)}"]
    return args + ["--kv-event-block-size", str(engine_flags.BLOCK_TOKENS), "--kv-event-model", spec.model.served_name]


def max_tree_size(routing: RoutingSpec | None, budget: Budget) -> int | None:
    """The tree budget the router is given (--max-tree-size): cache_aware's only; None for every other policy."""
    return plan_routing.max_tree_size(budget) if routing is not None and routing.policy == "cache_aware" else None


def policy_args(routing: RoutingSpec, budget: Budget) -> list[str]:
    """--policy and the figures that policy is given: kv_aware's tier credits; cache_aware's tree budget, trimmed to
    every second (the router's shortest interval: its default, 120 s, lets a tree grow far past its budget between
    trims, remembering prefixes the replica has evicted)."""
    args = ["--policy", routing.policy]
    if routing.policy == "kv_aware":
        credits = plan_routing.credits(budget)
        # No tier of ours is "external" (a remote KV store): nothing should be credited as one.
        for tier, flag in engine_router.CREDIT_FLAGS.items():
            args += [flag, repr(credits.get(tier, 0.0))]
    elif (tree := max_tree_size(routing, budget)) is not None:  # cache_aware
        args += ["--max-tree-size", str(tree),
                 "--eviction-interval-secs", str(engine_router.MIN_EVICTION_INTERVAL_S)]
    return args


def _args(owner_name: str, namespace: str, serving: dict[str, str], spec: Spec, budget: Budget, ips: tuple[str, ...],
          api_key: bool) -> list[str]:
    routing = spec.routing
    assert routing is not None
    args = ["--host", "$(POD_IP)", "--port", str(engine_router.HTTP_PORT),
            "--service-discovery", "--selector", *(f"{k}={v}" for k, v in sorted(serving.items())),
            "--service-discovery-namespace", namespace, "--service-discovery-port", str(HTTP_PORT),
            *policy_args(routing, budget),
            *(worker_args(spec, ips) if routing.policy == "kv_aware" else []),
            "--prometheus-host", "$(POD_IP)", "--prometheus-port", str(engine_router.METRICS_PORT)]
    if api_key:
        args += ["--api-key", "$(VLLM_API_KEY)"]  # expanded by kubelet: the key stays in its Secret
    return args


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 3}


def deployment(meta: dict[str, Any], owner_name: str, namespace: str, spec: Spec, serving: dict[str, str],
               budget: Budget, settings: Settings, ips: tuple[str, ...] = ()) -> dict[str, Any]:
    routing = spec.routing
    assert routing is not None
    env = [field_env("POD_IP", "status.podIP")]
    if spec.engine.api_key_secret:
        secret, key = spec.engine.api_key_secret
        env.append({"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    labels = pod_labels(owner_name, settings)
    container = {
        "name": "router",
        "image": settings.router_image,
        "imagePullPolicy": settings.router_image_pull_policy,
        "command": ["vllm-router"],
        "args": _args(owner_name, namespace, serving, spec, budget, ips, bool(spec.engine.api_key_secret)),
        "env": env,
        "ports": [{"name": "http", "containerPort": engine_router.HTTP_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": engine_router.METRICS_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        # /readiness is 503 until a serving pod is healthy: the Service sends nothing to a router with no replica.
        "readinessProbe": _probe("/readiness", 5, 3),
        "livenessProbe": _probe("/liveness", 10, 3),
        # A router that is replaced (its workers changed) keeps taking requests until its Service endpoint is gone,
        # then finishes those in flight on SIGTERM.
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_DRAIN_S}}},
        "volumeMounts": [{"name": "tmp", "mountPath": pod_security.TMP_DIR}],
        "securityContext": pod_security.restricted(readOnlyRootFilesystem=True, runAsNonRoot=True, runAsUser=65532,
                                                   runAsGroup=65532),
    }
    pod: dict[str, Any] = {
        "serviceAccountName": name(owner_name),
        "automountServiceAccountToken": True,  # the router watches pods through the API server
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": ROUTER_DRAIN_S + ROUTER_FINISH_S,
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]}
    # Where routers run is the admin's (operator settings), not the serving pods' placement: they need no GPU.
    if settings.router_node_selector:
        pod["nodeSelector"] = dict(settings.router_node_selector)
    if settings.router_tolerations:
        pod["tolerations"] = [dict(t) for t in settings.router_tolerations]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": routing.replicas, "selector": {"matchLabels": {ROUTER_LABEL: owner_name}},
                     # A new router serves before the old one goes: never fewer ready routers than asked for.
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": {"metadata": {"labels": labels}, "spec": pod}}}


def service(meta: dict[str, Any], owner_name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"type": "ClusterIP", "selector": {ROUTER_LABEL: owner_name},
                     "ports": [{"name": "http", "port": engine_router.HTTP_PORT, "targetPort": "http",
                                "protocol": "TCP"},
                               {"name": "metrics", "port": engine_router.METRICS_PORT, "targetPort": "metrics",
                                "protocol": "TCP"}]}}


def rbac(meta: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
    """The ServiceAccount, and a Role (pods: list, watch, in this namespace only) bound to it."""
    m = meta()
    return [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": m, "automountServiceAccountToken": False},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(),
             "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(),
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": m["name"]},
             "subjects": [{"kind": "ServiceAccount", "name": m["name"], "namespace": m["namespace"]}]}]


def children(meta: Callable[[], dict[str, Any]], owner_name: str, namespace: str, spec: Spec, serving: dict[str, str],
             budget: Budget, settings: Settings, ips: tuple[str, ...] = ()
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(RBAC, [Service, Deployment]) for spec.routing, or empty lists without it; `meta()` makes each child's metadata
    (one name for all five), `serving` are the labels of exactly this resource's serving pods, `ips` the addresses
    of those that are Ready (`workers`; kv_aware's router is started with them)."""
    if spec.routing is None:
        return [], []
    return rbac(meta), [service(meta(), owner_name), deployment(meta(), owner_name, namespace, spec, serving, budget,
                                                                settings, ips)]


def endpoint(owner_name: str, namespace: str) -> str:
    return f"http://{name(owner_name)}.{namespace}.svc:{engine_router.HTTP_PORT}/v1"
