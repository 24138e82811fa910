"""spec.routing (docs/routing.md): parse, the figures the router is given (credits, cache_aware's tree budget),
the rendered router and its least privilege, and what status says about it. The flag names are checked against
the real vllm-router 0.1.17 `--help` where its cached venv exists (`make router`)."""

from __future__ import annotations

import json
import re
import subprocess
from datetime import datetime, timezone

import pytest
import yaml

from kvoffload.api import crd
from kvoffload.api.errors import ConfigError
from kvoffload.api.settings import Settings, from_dict
from kvoffload.api.spec import RoutingSpec
from kvoffload.cli import why
from kvoffload.controller import conditions, pipeline
from kvoffload.engine import router as engine_router
from kvoffload.planning import routing as plan_routing
from kvoffload.rendering import render, routing
from kvtest import ROOT
from kvtest import router_workload as rw
from kvtest.specs import PAIR, spec

ROUTED = {"replicas": 4, "routing__policy": "auto"}
KV_ROUTED = {"replicas": 4, "routing__policy": "kv_aware"}


def desired(s: dict, settings: Settings | None = None) -> pipeline.Desired:
    return pipeline.desired("svc", "team-a", "uid-1", s, settings or Settings())


def kind(d: pipeline.Desired, k: str) -> list[dict]:
    return [c for c in d.children if c["kind"] == k]


def router_container(d: pipeline.Desired) -> dict:
    return kind(d, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]


# --- parse


NATIVE = {"offload__backend": "vllm-native", "offload__disk": None}
WORKERS = ("198.18.0.12", "198.18.0.11")


def test_auto_runs_cache_aware_on_every_backend():
    """What served best on real engines (docs/benchmarks.md "GPU: routing on real engines"), also where the engines'
    KV events cover every tier worth a hit (vllm-native)."""
    for backend in ({}, NATIVE, {"offload__backend": "lmcache-server"}):
        d = desired(spec(**PAIR, **ROUTED, **backend))
        assert d.spec.routing == RoutingSpec(policy="cache_aware", requested="auto", replicas=1)
        assert d.unseen_tiers == ()  # kv_aware's blind spots: nothing to say under cache_aware
    assert desired(spec(**NATIVE, replicas=4, routing__policy="round_robin")).spec.routing.policy == "round_robin"


def test_kv_aware_names_the_tiers_worth_a_hit_whose_events_it_cannot_see():
    """lmcache's CPU tier is worth a hit and publishes no KV events the router can use; vllm-native's does."""
    d = desired(spec(**PAIR, replicas=4, routing__policy="kv_aware"))
    assert routing.unseen(d.spec, d.budget) == d.unseen_tiers == ("cpu",)
    d = desired(spec(**PAIR, replicas=4, routing__policy="kv_aware", **NATIVE))
    assert routing.unseen(d.spec, d.budget) == d.unseen_tiers == ()


def test_the_routing_example_runs_cache_aware_and_kv_aware_by_name_with_the_cpu_tiers_credit():
    doc = yaml.safe_load((ROOT / "examples" / "routing" / "native-qwen25-7b.yaml").read_text())
    d = pipeline.desired(doc["metadata"]["name"], doc["metadata"]["namespace"], "", doc["spec"], Settings())
    assert d.spec.routing is not None and d.spec.routing.policy == "cache_aware"
    body = {**doc["spec"], "routing": {"policy": "kv_aware"}}
    d = pipeline.desired(doc["metadata"]["name"], doc["metadata"]["namespace"], "", body, Settings())
    args = router_container(d)["args"]
    assert args[args.index("--kv-penalty-host") + 1] == repr(plan_routing.credit(d.budget, "cpu")) != "0.0"


def test_kv_aware_takes_effect_on_every_backend_and_status_says_what_it_cannot_see():
    for backend, unseen in (("lmcache", ["cpu"]), ("lmcache-server", ["cpu"]), ("vllm-native", None)):
        s = spec(**PAIR, replicas=2, routing__policy="kv_aware", offload__backend=backend, offload__disk=None)
        d = desired(s)
        assert d.spec.routing is not None and d.spec.routing.policy == "kv_aware"
        st = conditions.status({**BODY, "spec": s}, d, None, conditions.Observed(STS, []))["routing"]
        assert st.get("unseenTiers") == unseen and st["eventTiers"] == (["gpu", "cpu"] if unseen is None else ["gpu"])
        assert st["workers"] == 0


@pytest.mark.parametrize("patch, field, says", [
    ({"routing__policy": "least_loaded"}, "spec.routing.policy",
     "allowed values: auto, kv_aware, cache_aware, round_robin"),
    ({"routing__replicas": 0}, "spec.routing.replicas", "must be an integer in [1, 10]"),
    ({"routing__enabled": "yes"}, "spec.routing.enabled", "must be true or false"),
])
def test_bad_routing_fields_name_the_field_and_what_is_allowed(patch, field, says):
    with pytest.raises(ConfigError) as err:
        desired(spec(**patch))
    assert err.value.field == field and says in err.value.message


def test_the_crd_declares_the_policies_with_auto_as_default():
    node = crd.schema_at("routing.policy")
    assert node["enum"] == list(engine_router.POLICIES) and node["default"] == "auto"
    assert crd.schema_at("routing.enabled")["default"] is True


def test_disabled_or_absent_routing_renders_no_router():
    for s in (spec(**ROUTED, routing__enabled=False), spec(replicas=4)):
        d = desired(s)
        assert d.spec.routing is None
        assert not kind(d, "Deployment") and not kind(d, "Role")
        assert conditions.status({"metadata": {"name": "svc", "namespace": "team-a", "generation": 1}, "spec": s}, d,
                                 None,
                                 conditions.Observed(None, []))["endpoint"] == "http://svc.team-a.svc:8000/v1"


# --- the figures: credits and the tree budget


def test_credit_is_the_share_of_recompute_a_hit_saves_and_zero_when_slower():
    b = desired(spec(**ROUTED)).budget
    cpu, disk = (next(r for r in b.reload if r.tier == t) for t in ("cpu", "disk"))
    assert not cpu.slower_than_recompute and disk.slower_than_recompute  # the default H200 figures: disk 0.94 GB/s
    assert plan_routing.credits(b) == {"cpu": round(1 - cpu.reload_s / cpu.recompute_s, 4), "disk": 0.0}
    assert 0.9 < plan_routing.credit(b, "cpu") < 1


def test_a_fast_disk_earns_a_credit_and_an_absent_tier_none():
    fast = desired(spec(**ROUTED, offload__disk__readGbps=12)).budget
    disk = next(r for r in fast.reload if r.tier == "disk")
    assert plan_routing.credit(fast, "disk") == round(1 - disk.reload_s / disk.recompute_s, 4) > 0
    assert plan_routing.credits(desired(spec(**ROUTED, offload__disk=None)).budget)["disk"] == 0.0


def test_tree_budget_counts_only_tiers_worth_reloading():
    slow = desired(spec(**ROUTED)).budget  # disk slower than recompute: GPU or CPU, whichever holds more
    assert plan_routing.cached_tokens(slow) == max(slow.tier("gpu").tokens, slow.tier("cpu").tokens)
    fast = desired(spec(**ROUTED, offload__disk__readGbps=12)).budget  # the disk holds the most and is worth it
    assert plan_routing.cached_tokens(fast) == fast.tier("disk").tokens > plan_routing.cached_tokens(slow)
    # The router's tree holds each token id as 8 hex characters (vllm-router 0.1.17 src/protocols/spec.rs TOKEN_WIDTH).
    assert plan_routing.max_tree_size(fast) == 8 * fast.tier("disk").tokens


def test_cache_aware_is_given_the_tree_budget_from_the_tiers_trimmed_every_second():
    d = desired(spec(**ROUTED))
    args = router_container(d)["args"]
    assert args[args.index("--policy") + 1] == "cache_aware"
    assert int(args[args.index("--max-tree-size") + 1]) == 8 * plan_routing.cached_tokens(d.budget)
    assert args[args.index("--eviction-interval-secs") + 1] == "1"  # the shortest the router takes; its default is 120
    assert not any(a.startswith("--kv-penalty") for a in args)


def test_kv_aware_is_given_each_tiers_credit_and_the_engine_publishes_its_events():
    d = desired(spec(**ROUTED))
    args = routing.policy_args(RoutingSpec("kv_aware", "kv_aware", 1), d.budget)
    credits = plan_routing.credits(d.budget)
    assert args == ["--policy", "kv_aware", "--kv-penalty-host", repr(credits["cpu"]), "--kv-penalty-external", "0.0",
                    "--kv-penalty-disk", "0.0"]
    kv_spec = d.spec.__class__(**{**d.spec.__dict__, "routing": RoutingSpec("kv_aware", "kv_aware", 1)})
    flag, value = routing.kv_events_args(kv_spec, d.budget)
    assert flag == "--kv-events-config" and json.loads(value) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558", "topic": ""}  # vllm-router 0.1.17 reads only topic "" from static sources
    assert routing.kv_events_args(d.spec, d.budget) == []  # cache_aware: the engine publishes nothing
    assert ("--kv-events-config"
            not in render.vllm_argv(kind(d, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]))


def test_vllm_native_publishes_its_cpu_tiers_events_as_well():
    """vLLM's OffloadingConnector publishes the CPU tier's BlockStored / BlockRemoved only when asked for
    self-describing events; vLLM merges this extra config with the one --kv-offloading-size makes."""
    d = desired(spec(**PAIR, **KV_ROUTED, **NATIVE))
    argv = render.vllm_argv(kind(d, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0])
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config == {"kv_connector_extra_config": {"self_describing_kv_events": True}}
    assert argv[argv.index("--kv-offloading-backend") + 1] == "native" and "--kv-events-config" in argv
    # With a NetworkPolicy, the router's pods may reach the publisher and its replay endpoint.
    fenced = desired(spec(**PAIR, **KV_ROUTED, **NATIVE, networkPolicy__servingFrom=["clients"]))
    (rule,) = [r for r in kind(fenced, "NetworkPolicy")[0]["spec"]["ingress"]
               if r["from"] == [{"podSelector": {"matchLabels": {routing.ROUTER_LABEL: "svc"}}}]]
    events = {engine_router.KV_EVENTS_PORT, engine_router.KV_EVENTS_REPLAY_PORT}
    assert {p["port"] for p in rule["ports"]} == {8000, *events}


def _pod(name: str, ip: str | None, ready: bool = True, leaving: bool = False, component: str = "serving") -> dict:
    meta: dict = {"name": name, "labels": {"kvoffload.io/serve": "svc", "app.kubernetes.io/component": component}}
    if leaving:
        meta["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    return {"metadata": meta, "status": {**({"podIP": ip} if ip else {}),
                                         "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_kv_aware_workers_are_the_ready_serving_pods_in_name_order():
    labels = {"kvoffload.io/serve": "svc", "app.kubernetes.io/component": "serving"}
    pods = [_pod("svc-2", "198.18.0.13"), _pod("svc-0", "198.18.0.11"), _pod("svc-1", "198.18.0.12", ready=False),
            _pod("svc-3", None), _pod("svc-4", "198.18.0.15", leaving=True),
            _pod("svc-router-x", "198.18.0.16", component="router")]
    assert routing.workers(pods, labels) == ("198.18.0.11", "198.18.0.13")


def test_kv_aware_router_is_started_with_each_worker_and_its_event_sources():
    """vllm-router 0.1.17 indexes only the workers it starts with, and asks an engine over HTTP for nothing when
    its event source is given: each worker with its publisher and replay endpoint, vLLM's block size and one
    model identity. Discovery stays on beside them (a pod that goes is dropped at once)."""
    s = spec(**PAIR, **KV_ROUTED, **NATIVE)
    d = pipeline.desired("svc", "team-a", "uid-1", s, Settings(), WORKERS)
    args = router_container(d)["args"]
    urls = ["http://198.18.0.12:8000", "http://198.18.0.11:8000"]
    assert rw.worker_urls(args) == urls
    sources, replays = rw.flag_values(args, "--kv-event-source"), rw.flag_values(args, "--kv-event-replay-source")
    assert sources == [f"{u}=tcp://{ip}:5557" for u, ip in zip(urls, WORKERS)]
    assert replays == [f"{u}=tcp://{ip}:5558" for u, ip in zip(urls, WORKERS)]
    assert args[args.index("--kv-event-block-size") + 1] == "16"
    assert args[args.index("--kv-event-model") + 1] == d.spec.model.served_name
    assert "--service-discovery" in args and d.workers == WORKERS
    # Without Ready pods (offline rendering, a new resource) the router starts on discovery alone.
    assert "--worker-urls" not in router_container(desired(s))["args"]
    # IPv6 pod addresses, as the router spells a discovered one.
    assert routing.worker_args(d.spec, ("fd00::5",))[:2] == ["--worker-urls", "http://[fd00::5]:8000"]


def test_only_kv_aware_reads_the_workers_and_the_cache_follows_them():
    cache = pipeline.DesiredCache()
    s = spec(**PAIR, **KV_ROUTED, **NATIVE)
    one = cache.get("svc", "team-a", "uid-1", s, Settings(), WORKERS[:1])
    two = cache.get("svc", "team-a", "uid-1", s, Settings(), WORKERS)
    assert one.workers == WORKERS[:1] and two.workers == WORKERS and one is not two
    assert cache.get("svc", "team-a", "uid-1", s, Settings(), WORKERS) is two
    plain = spec(**PAIR, **ROUTED)  # cache_aware: the pods do not change what is rendered
    first = cache.get("svc", "team-b", "uid-2", plain, Settings(), WORKERS)
    assert first.workers == () and cache.get("svc", "team-b", "uid-2", plain, Settings(), ()) is first


def test_a_router_that_is_replaced_serves_until_its_successor_is_ready_and_drains():
    deployment = kind(desired(spec(**ROUTED)), "Deployment")[0]
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": routing.ROUTER_DRAIN_S}}}
    assert pod["terminationGracePeriodSeconds"] == routing.ROUTER_DRAIN_S + routing.ROUTER_FINISH_S


# --- the rendered router


def test_router_discovers_exactly_the_serving_pods():
    d = desired(spec(**ROUTED))
    args = router_container(d)["args"]
    selector = args[args.index("--selector") + 1: args.index("--service-discovery-namespace")]
    assert selector == ["app.kubernetes.io/component=serving", "kvoffload.io/serve=svc"]
    assert args[args.index("--service-discovery-namespace") + 1] == "team-a"
    assert args[args.index("--service-discovery-port") + 1] == "8000"
    serving = kind(d, "StatefulSet")[0]["spec"]["template"]["metadata"]["labels"]
    router_pods = kind(d, "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert all(serving.get(k.split("=")[0]) == k.split("=")[1] for k in selector)
    # Router pods match neither its own discovery nor the serving Service, the PDB or the StatefulSet.
    assert render.OWNER_LABEL not in router_pods and router_pods[routing.ROUTER_LABEL] == "svc"
    service = next(c for c in kind(d, "Service") if c["metadata"]["name"] == "svc-router")
    assert service["spec"]["selector"] == {routing.ROUTER_LABEL: "svc"}
    assert [p["port"] for p in service["spec"]["ports"]] == [8000, 29000]


def test_router_rbac_is_pods_list_watch_in_its_namespace_only():
    d = desired(spec(**ROUTED))
    (role,), (binding,), (sa,) = kind(d, "Role"), kind(d, "RoleBinding"), kind(d, "ServiceAccount")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == sa["metadata"]["namespace"] == "team-a"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "svc-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "svc-router", "namespace": "team-a"}]
    pod = kind(d, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "svc-router" and pod["automountServiceAccountToken"] is True
    assert sa["automountServiceAccountToken"] is False  # only the router's pods get its token
    assert not kind(d, "ClusterRole")


def test_router_runs_hardened_with_probes():
    c = router_container(desired(spec(**ROUTED)))
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["runAsNonRoot"] and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsUser"] != 0
    assert (c["readinessProbe"]["httpGet"]["path"] == "/readiness"
            and c["livenessProbe"]["httpGet"]["path"] == "/liveness")
    assert c["image"] == Settings().router_image == engine_router.DEFAULT_IMAGE
    assert c["args"][c["args"].index("--host") + 1] == "$(POD_IP)"


def test_router_gets_the_api_key_from_its_secret_never_in_the_spec():
    c = router_container(desired(spec(**ROUTED, engine__apiKeySecretRef__name="api")))
    assert c["args"][-2:] == ["--api-key", "$(VLLM_API_KEY)"]
    assert {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "api-key"}}} in c["env"]


PLACED = {"routerNodeSelector": {"pool": "cpu"},
          "routerTolerations": [{"key": "dedicated", "operator": "Equal", "value": "routers", "effect": "NoSchedule"}]}


def test_where_routers_run_is_the_admins_setting_not_the_serving_pods_placement():
    scheduled = spec(**ROUTED, scheduling__nodeSelector={"gpu": "h200"},
                     scheduling__tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    pod = kind(desired(scheduled), "Deployment")[0]["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod  # a router needs no GPU: nothing by default
    d = desired(scheduled, from_dict(PLACED))
    pod = kind(d, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"} and pod["tolerations"] == PLACED["routerTolerations"]
    serving = kind(d, "StatefulSet")[0]["spec"]["template"]["spec"]
    assert serving["nodeSelector"]["gpu"] == "h200" and "pool" not in serving["nodeSelector"]
    assert PLACED["routerTolerations"][0] not in serving["tolerations"]


@pytest.mark.parametrize(("bad", "named"), [
    ({"routerNodeSelector": ["pool=cpu"]}, "operator config routerNodeSelector"),
    ({"routerNodeSelector": {"pool": 1}}, "operator config routerNodeSelector"),
    ({"routerTolerations": {"key": "x"}}, "operator config routerTolerations"),
    ({"routerTolerations": [{"key": "x", "operatr": "Exists"}]}, "operator config routerTolerations[0]"),
    ({"routerTolerations": [{"key": "x", "operator": "In"}]}, "operator config routerTolerations[0].operator"),
    ({"routerTolerations": [{"key": "x", "effect": "NoExecut"}]}, "operator config routerTolerations[0].effect"),
    ({"routerTolerations": [{"key": "x", "tolerationSeconds": "60"}]},
     "operator config routerTolerations[0].tolerationSeconds"),
])
def test_bad_router_placement_is_refused_naming_the_setting(bad, named):
    with pytest.raises(ConfigError) as err:
        from_dict(bad)
    assert err.value.field == named, err.value


def test_network_policy_lets_the_router_reach_the_serving_port():
    d = desired(spec(**ROUTED, networkPolicy__servingFrom=["clients"]))
    ingress = kind(d, "NetworkPolicy")[0]["spec"]["ingress"]
    assert ingress[0] == {"from": [{"podSelector": {"matchLabels": {routing.ROUTER_LABEL: "svc"}}}],
                          "ports": [{"protocol": "TCP", "port": 8000}]}


# --- status


BODY = {"metadata": {"name": "svc", "namespace": "team-a", "generation": 1}}
STS = {"metadata": {"name": "svc", "generation": 1}, "status": {"observedGeneration": 1, "replicas": 4,
                                                                "readyReplicas": 4,
                                                 "updatedReplicas": 4, "currentRevision": "r", "updateRevision": "r"}}


def _deployment(ready: int, message: str = "") -> dict:
    return {"metadata": {"name": "svc-router", "generation": 1},
            "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": ready,
                       "availableReplicas": ready,
                       "conditions": [{"type": "Available", "status": "True" if ready else "False",
                                       "message": message}]}}


def _conds(st: dict) -> dict:
    return {c["type"]: c for c in st["conditions"]}


def test_the_tree_budget_is_decided_once_and_rendered_as_decided():
    """status.routing.maxTreeSize comes from Desired (what the pipeline decided), not from the rendered args."""
    d = desired(spec(**ROUTED))
    assert d.max_tree_size == plan_routing.max_tree_size(d.budget)
    (router,) = [c for c in d.children if c["kind"] == "Deployment"]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-tree-size") + 1] == str(d.max_tree_size)
    assert routing.max_tree_size(RoutingSpec("kv_aware", "kv_aware", 1), d.budget) is None
    assert routing.max_tree_size(None, d.budget) is None and desired(spec()).max_tree_size is None


def test_ready_waits_for_the_router_and_status_names_it():
    s = spec(**ROUTED)
    d = desired(s)
    st = conditions.status({**BODY, "spec": s}, d, None,
                           conditions.Observed(STS, [], None, None, _deployment(0, "no pod")))
    c = _conds(st)
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "RouterNotReady")
    assert (c["RouterReady"]["status"], c["RouterReady"]["reason"]) == ("False", "RouterNotReady")
    assert "no pod" in c["RouterReady"]["message"] and c["Reconciling"]["reason"] == "RouterNotReady"
    assert st["endpoint"] == "http://svc-router.team-a.svc:8000/v1"
    assert st["routing"] == {"policy": "cache_aware", "deployment": "svc-router", "readyReplicas": 0,
                             "credits": plan_routing.credits(d.budget),
                             "maxTreeSize": plan_routing.max_tree_size(d.budget)}
    st = conditions.status({**BODY, "spec": s}, d, None, conditions.Observed(STS, [], None, None, _deployment(1)))
    c = _conds(st)
    assert c["Ready"]["status"] == "True" and c["RouterReady"]["reason"] == "RouterAvailable"
    assert "policy cache_aware (auto)" in c["RouterReady"]["message"]
    assert why.kstatus({**BODY, "spec": s, "status": {**st, "observedGeneration": 1}}) == ("Current", "ready")


def test_without_routing_the_router_condition_says_so_and_ready_ignores_it():
    s = spec(replicas=4)
    st = conditions.status({**BODY, "spec": s}, desired(s), None, conditions.Observed(STS, []))
    c = _conds(st)
    assert c["Ready"]["status"] == "True" and c["RouterReady"]["reason"] == "NotConfigured"
    assert "routing" not in st


def test_why_explains_the_router():
    s = spec(**ROUTED)
    st = conditions.status({**BODY, "spec": s}, desired(s), None,
                           conditions.Observed(STS, [], None, None, _deployment(0)))
    obj = {**BODY, "spec": s, "status": {**st, "observedGeneration": 1}}
    text = why.explain(obj, STS, [], [], datetime.now(timezone.utc))
    assert "Not ready yet (RouterNotReady)" in text and "the router in front of them (spec.routing) is not" in text
    assert "vllm-router svc-router: policy cache_aware, 0 router pod(s) ready" in text
    assert re.search(r"credit per offload tier .*: cpu 0\.9\d+, disk 0", text)
    tokens = plan_routing.cached_tokens(desired(s).budget)
    assert f"cache_aware remembers {tokens:,} tokens of prompts per replica (--max-tree-size {8 * tokens}" in text
    assert "KV events the engines do not publish" not in text  # kv_aware's blind spots: not cache_aware's
    blind = spec(**PAIR, **KV_ROUTED)  # lmcache's CPU tier publishes no events the router can use
    st = conditions.status({**BODY, "spec": blind}, desired(blind), None, conditions.Observed(STS, []))
    text = why.explain({**BODY, "spec": blind, "status": {**st, "observedGeneration": 1}}, STS, [], [],
                       datetime.now(timezone.utc))
    assert ("tiers worth a hit whose KV events the engines do not publish: cpu (kv_aware cannot credit their hits; "
            "cache_aware's tree budget counts them)") in text
    kv = spec(**PAIR, **KV_ROUTED, **NATIVE)
    d = pipeline.desired("svc", "team-a", "uid-1", kv, Settings(), WORKERS)
    st = conditions.status({**BODY, "spec": kv}, d, None, conditions.Observed(STS, [], None, None, _deployment(1)))
    text = why.explain({**BODY, "spec": kv, "status": {**st, "observedGeneration": 1}}, STS, [], [],
                       datetime.now(timezone.utc))
    assert "kv_aware indexes the KV events (gpu, cpu tiers) of the 2 serving pod(s) it was started with" in text
    assert "KV events of 2/4 replicas indexed" in _conds(st)["RouterReady"]["message"]


# --- the real router's flags


def test_every_rendered_flag_is_one_the_real_router_declares(vllm_router):
    help_text = subprocess.run([str(vllm_router), "--help"], capture_output=True, text=True, timeout=60,
                               check=True).stdout
    declared = set(re.findall(r"(--[a-z0-9-]+)", help_text))
    d = desired(spec(**ROUTED, engine__apiKeySecretRef__name="api"))
    rendered = {a for a in router_container(d)["args"] if a.startswith("--")}
    kv = pipeline.desired("svc", "team-a", "uid-1", spec(**KV_ROUTED, **NATIVE), Settings(), WORKERS)
    rendered |= {a for a in router_container(kv)["args"] if a.startswith("--")}
    assert "--kv-event-source" in rendered and "--worker-urls" in rendered
    assert rendered <= declared, rendered - declared
    for policy in engine_router.POLICIES[1:]:
        assert policy in help_text
