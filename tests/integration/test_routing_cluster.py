"""spec.routing on the real control plane: the real router (vllm-router 0.1.17 from its PyPI wheel, `make router`) with
the arguments the operator rendered and its ServiceAccount's own token discovers exactly the serving pods through
the real API server; stand-in engines on those pods' loopback addresses (kwok runs no containers) model a prefix
cache with the operator's tier capacities (kvtest.standin_prefix_engine) and answer real requests sent to the
router's HTTP port.

- cache_aware (what policy auto runs): every request of a shared prefix reaches the replica that holds it, so repeats
  are GPU hits; round robin, for contrast, spreads each prefix over the replicas.
- kv_aware as rendered (the routing example, backend vllm-native, with policy kv_aware): the router is started with the
  Ready serving pods and their KV-event publishers (static sources, so it asks the engines nothing over HTTP);
  stand-ins publishing vLLM's own KV event classes (under the engine venv's python: `make test` builds it in the
  background and this test waits for it, fixture engine_python; without it the test skips, or fails under
  KVO_REQUIRE_ENGINE) draw each prefix's requests to the replica holding it in its CPU or GPU tier; a replica added
  through the scale subresource joins the rendered workers once Ready.
- the slow-tier rule (cache_aware's tree budget counts only the tiers faster than recompute): with the flags the
  operator rendered for two resources whose disks differ only in speed, a document left only in its holder's slow
  disk tier no longer draws its requests there, the same document in a fast disk tier still does.

Everything binds 127.0.0.x: the router (127.0.0.1), the stand-ins (the pods' loopback IPs).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtest import ROOT, background, condition, images
from kvtest import router_workload as rw
from kvtest.specs import serve, wait_ready
from kvtest.standin_prefix_engine import BLOCK, PrefixCache, StandInPrefixEngine, tokens

pytestmark = pytest.mark.cluster

REPLICAS = 3
PREFIX_WORDS = 320  # 20 blocks of 16 tokens: a shared system prompt / document


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=30).read())


def _get(url: str) -> Any:
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


class Router:
    """The real router with the Deployment's rendered arguments, on 127.0.0.1, authenticated as its ServiceAccount."""

    def __init__(self, binary: Path, args: list[str], kubeconfig: Path, log: Path) -> None:
        self.port, metrics = _free_port(), _free_port()
        args = [a.replace("$(POD_IP)", "127.0.0.1") for a in args]
        args[args.index("--port") + 1] = str(self.port)
        args[args.index("--prometheus-port") + 1] = str(metrics)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}  # no in-cluster config here
        self.log = log
        self.proc = subprocess.Popen([str(binary), *args, "--log-level", "debug"],
                                     env={**env, "KUBECONFIG": str(kubeconfig)},
                                     stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def workers(self) -> set[str]:
        try:
            out = _get(f"{self.url}/list_workers")
        except OSError:
            return set()
        return set(out.get("urls") or [])

    def ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"{self.url}/readiness", timeout=5).status == 200
        except OSError:
            return False

    def complete(self, prompt: str) -> dict[str, Any]:
        return _post(f"{self.url}/v1/completions", {"model": "stand-in", "prompt": prompt, "max_tokens": 1})

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)


def _prompts(rounds: int, prefixes: int, seed: int) -> list[tuple[int, str]]:
    """(prefix index, prompt): each prefix `rounds` times with its own question, in a shuffled order."""
    docs = [" ".join(f"doc{k}s{seed}w{j}" for j in range(PREFIX_WORDS)) for k in range(prefixes)]
    out = [(k, f"{docs[k]} question {r} about {k} " + " ".join(f"q{r}k{k}x{j}" for j in range(12)))
           for r in range(rounds) for k in range(prefixes)]
    random.Random(seed).shuffle(out)
    return out


def health(pods: list[dict[str, Any]], up: bool) -> None:
    """The stand-ins end (or restart) their start-up: vllm-router 0.1.17 subscribes to the KV events of workers that
    become healthy after it started (in our runs never to those healthy at its first check), as real engines do."""
    for p in pods:
        _post(f"http://{p['status']['podIP']}:8000/standin/{'start' if up else 'stop'}", {})


def _plain(log: Path) -> str:
    return rw.plain(log.read_text())


def _run(router: Router, prompts: list[tuple[int, str]]) -> dict[int, list[str]]:
    served: dict[int, list[str]] = {}
    for k, prompt in prompts:
        answer = router.complete(prompt)
        assert answer["system_fingerprint"].startswith("kvoffload-stand-in-engine")
        served.setdefault(k, []).append(answer["kvoffload_stand_in"]["replica"])
    return served


@pytest.fixture(scope="module")
def engine_python() -> Path:
    """vLLM 0.26.0's engine venv's python (its KV event classes). Decided when a test asks, not at collection: under
    KVO_WAIT_BUILDS (`make test`) the venv may still be building in the background, so wait for that build first; a
    venv without its done-marker is a build that failed (or never ran): fail under KVO_REQUIRE_ENGINE, else skip."""
    background.wait("engine")
    venv = images.pair(images.STANDIN_PAIR).engine_venv  # the stand-in engines publish vLLM 0.26.0's KV events
    if not (venv / ".done").is_file():
        why = (f"no engine venv at {venv}: run `make engine-venv`"
               f" (`make test` builds it in the background: {background.log('engine')})")
        if os.environ.get("KVO_REQUIRE_ENGINE"):  # make test: this test must run
            pytest.fail(why + " (KVO_REQUIRE_ENGINE is set)", pytrace=False)
        pytest.skip(why)
    return venv / "bin" / "python"


@pytest.fixture
def routed(cluster, namespace, operator, tmp_path, vllm_router):
    """A KVOffloadServe with 3 replicas and spec.routing, Ready (its router Deployment too, as kwok runs it)."""
    cluster.client.apply(serve("svc", replicas=REPLICAS, routing={}), namespace)
    obj = wait_ready(cluster, namespace, "svc", timeout=180)
    pods = cluster.client.list("pods", namespace, labels={"kvoffload.io/serve": "svc"})
    deployment = cluster.client.get("deployment", "svc-router", namespace)
    token = cluster.client.create_token("svc-router", namespace)
    kubeconfig = cluster.token_kubeconfig(tmp_path / "router.kubeconfig", token, namespace, "svc-router")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    yield obj, pods, args, lambda argv, log: Router(vllm_router, argv, kubeconfig, log)


def test_router_discovers_the_serving_pods_and_keeps_each_prefix_on_one_replica(cluster, namespace, routed, tmp_path):
    obj, pods, args, start = routed
    st = obj["status"]
    assert st["endpoint"] == f"http://svc-router.{namespace}.svc:8000/v1"
    assert st["routing"]["policy"] == "cache_aware" and condition(obj, "RouterReady")["reason"] == "RouterAvailable"
    assert args[args.index("--max-tree-size") + 1] == str(st["routing"]["maxTreeSize"])
    # The namespace also holds the router's own pod (kwok runs it): the router must not discover it.
    router_pods = cluster.client.list("pods", namespace, labels={"kvoffload.io/router": "svc"})
    assert len(pods) == REPLICAS and router_pods
    capacity = {t["name"]: t["tokens"] for t in st["budget"]["tiers"]}
    engines = [StandInPrefixEngine(p["metadata"]["name"], p["status"]["podIP"], 8000, capacity) for p in pods]
    routers: list[Router] = []
    try:
        want = {f"http://{p['status']['podIP']}:8000" for p in pods}
        router = start(args, tmp_path / "router.log")
        routers.append(router)
        cluster.wait_until(lambda: router.workers() == want, timeout=90,
                           message=f"the router discovers exactly {sorted(want)} (log: {router.log})")
        # Least privilege: the ServiceAccount may list and watch pods here, nothing in other namespaces, no Secrets.
        for attrs, allowed in (({"namespace": namespace, "verb": "watch", "resource": "pods"}, True),
                               ({"namespace": "default", "verb": "list", "resource": "pods"}, False),
                               ({"namespace": namespace, "verb": "get", "resource": "secrets"}, False)):
            review = cluster.client.create({
                "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                "spec": {"user": f"system:serviceaccount:{namespace}:svc-router", "resourceAttributes": attrs}})
            assert review["status"]["allowed"] is allowed, (attrs, review["status"])

        served = _run(router, _prompts(rounds=4, prefixes=4, seed=1))
        assert all(len(set(r)) == 1 for r in served.values()), served  # each prefix always reached its replica
        hits = sum(e.cache.counts.hit_tokens["gpu"] for e in engines)
        prefix_blocks = len(tokens(" ".join(["w"] * PREFIX_WORDS))) // BLOCK * BLOCK
        assert hits >= 4 * 3 * prefix_blocks  # every repeat of every prefix hit its whole prefix in the GPU tier
        router.stop()

        # Round robin, for contrast: the same workload spreads prefixes over replicas and recomputes them.
        rr = [*args]
        rr[rr.index("--policy") + 1: rr.index("--eviction-interval-secs") + 2] = ["round_robin"]
        before = {e.name: e.cache.counts.computed_tokens for e in engines}
        rrouter = start(rr, tmp_path / "router-rr.log")
        routers.append(rrouter)
        cluster.wait_until(lambda: rrouter.workers() == want, timeout=90,
                           message="round robin router discovers the pods")
        served_rr = _run(rrouter, _prompts(rounds=4, prefixes=4, seed=2))
        assert any(len(set(r)) > 1 for r in served_rr.values()), served_rr
        recomputed_rr = sum(e.cache.counts.computed_tokens - before[e.name] for e in engines)
        assert recomputed_rr > 4 * prefix_blocks  # more than each prefix's first prefill

        # Scaling down: the router drops the pod that goes.
        cluster.client.patch("kvs", "svc", {"spec": {"replicas": REPLICAS - 1}}, namespace)
        cluster.wait_until(lambda: len(rrouter.workers()) == REPLICAS - 1, timeout=90,
                           message="the router drops the removed pod")
        assert rrouter.workers() < want
    finally:
        for r in routers:
            if r.proc.poll() is None:
                r.stop()
        for e in engines:
            e.close()


def test_kv_aware_as_rendered_indexes_every_replicas_events_and_follows_the_replicas(engine_python, cluster, namespace,
                                                                                    operator, tmp_path, vllm_router):
    """examples/routing/native-qwen25-7b.yaml with policy kv_aware: backend vllm-native publishes its GPU and CPU tiers'
    KV events. The operator renders the
    router with the Ready serving pods as --worker-urls, each with its publisher and replay endpoint (static sources:
    the router asks the engines nothing over HTTP, so the vLLM routes it lacks do not matter). The real router with
    exactly those arguments, in front of stand-in engines on the pods' addresses that publish vLLM's own event classes
    (BlockStored, medium GPU or CPU): a prefix held by one replica only in its CPU tier, and one held only in another's
    GPU tier, draw every request to their holder, which serves them as hits. Scaled up by the scale subresource, the
    new pod is rendered into the router's workers once it is Ready."""
    example = yaml.safe_load((ROOT / "examples" / "routing" / "native-qwen25-7b.yaml").read_text())
    kv_spec = {**example["spec"], "replicas": REPLICAS, "routing": {"policy": "kv_aware"}}
    cluster.client.apply({**example, "metadata": {"name": "kv"}, "spec": kv_spec}, namespace)
    wait_ready(cluster, namespace, "kv", timeout=180)
    rendered: dict[str, Any] = {}

    def workers_rendered(n: int) -> bool:
        obj = cluster.client.get("kvs", "kv", namespace)
        deployment = cluster.client.get("deployment", "kv-router", namespace)
        rendered.update(obj=obj, args=deployment["spec"]["template"]["spec"]["containers"][0]["args"])
        return len(rw.worker_urls(rendered["args"])) == n and (obj.get("status") or {}).get("routing", {}).get(
            "workers") == n

    cluster.wait_until(lambda: workers_rendered(REPLICAS), timeout=120,
                       message="the operator renders the router with every Ready serving pod")
    obj, args = rendered["obj"], rendered["args"]
    st = obj["status"]["routing"]
    assert st["policy"] == "kv_aware" and st["eventTiers"] == ["gpu", "cpu"] and "unseenTiers" not in st
    pods = sorted(cluster.client.list("pods", namespace, labels={"kvoffload.io/serve": "kv"}),
                  key=lambda p: p["metadata"]["name"])
    hosts = [p["status"]["podIP"] for p in pods]
    assert rw.worker_urls(args) == [f"http://{h}:8000" for h in hosts]
    assert rw.flag_values(args, "--kv-event-source") == [
        f"http://{h}:8000=tcp://{h}:5557" for h in hosts]
    assert args[args.index("--kv-penalty-host") + 1] == repr(st["credits"]["cpu"]) and st["credits"]["cpu"] > 0.9
    # The engines publish their events where the router reads them (vLLM's KVEventsConfig, with the replay endpoint).
    sts = cluster.client.get("statefulset", "kv", namespace)
    vllm = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    argv = [*vllm.get("command", []), *vllm.get("args", [])]
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert events["replay_endpoint"] == "tcp://*:5558" and events["endpoint"] == "tcp://*:5557"

    capacity = {t["name"]: t["tokens"] for t in obj["status"]["budget"]["tiers"]}
    conf = {"engines": [{"name": p["metadata"]["name"], "host": h, "port": 8000} for p, h in zip(pods, hosts)],
            "capacity": capacity, "kv_events": events}  # they bind the ports the operator rendered
    standins = subprocess.Popen([str(engine_python), "-m", "kvtest.standin_prefix_engine", json.dumps(conf)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=(tmp_path / "standins.log").open("w"),
                                env={**os.environ, "PYTHONPATH": str(ROOT / "tests" / "support")}, text=True)
    token = cluster.client.create_token("kv-router", namespace)
    kubeconfig = cluster.token_kubeconfig(tmp_path / "router.kubeconfig", token, namespace, "kv-router")
    router = None
    try:
        assert standins.stdout is not None
        while "stand-in engines ready" not in (line := standins.stdout.readline()):
            assert line, (tmp_path / "standins.log").read_text()[-3000:]
        router = Router(vllm_router, args, kubeconfig, tmp_path / "router.log")
        health(pods, True)  # the router waits for every worker it is given before it serves
        cluster.wait_until(router.ready, timeout=120, message=f"the kv_aware router is ready (log: {router.log})")
        # Each replica's CPU tier, then replica 0's GPU tier, holds a document no other replica has: the router's
        # own account (its decision: the worker it chose, the prefix tokens credited there) credits that replica, at
        # kvoffload's CPU credit for the CPU tier and whole for the GPU tier, and the replica serves it as hits.
        cpu_credit = int(PREFIX_WORDS * st["credits"]["cpu"])
        for k, h in enumerate(hosts):
            url = f"http://{h}:8000"
            try_cpu = rw.kv_seeded(router.url, "stand-in", url, ("cpu",), lambda: router.log.read_text())
            got = cluster.wait_until(lambda: (r := try_cpu())[1:3] == (url, cpu_credit) and r, timeout=60,
                                     message=f"the router credits {url}'s CPU tier (log: {router.log})")
            assert got[0] == pods[k]["metadata"]["name"] and got[3]["cpu"] >= PREFIX_WORDS // BLOCK * BLOCK, got
        url = f"http://{hosts[0]}:8000"
        try_gpu = rw.kv_seeded(router.url, "stand-in", url, ("gpu",), lambda: router.log.read_text())
        got = cluster.wait_until(lambda: (r := try_gpu())[1:3] == (url, PREFIX_WORDS) and r, timeout=60,
                                 message=f"the router credits {url}'s GPU tier (log: {router.log})")
        assert got[3]["gpu"] == PREFIX_WORDS, got
        log = _plain(router.log)
        assert "using configured static KV event sources" in log  # no GET /get_server_info asked
        for h in hosts:
            asked = set(_get(f"http://{h}:8000/standin/counts")["asked"])
            assert not asked & {"/get_server_info", "/kv_event_sources"}, asked
    finally:
        if router is not None and router.proc.poll() is None:
            router.stop()
        if standins.stdin:
            standins.stdin.close()
        standins.wait(timeout=30)

    # A replica added the way an autoscaler adds one: once Ready, it is in the router's workers.
    cluster.client.patch("kvs", "kv", {"spec": {"replicas": REPLICAS + 1}}, namespace, subresource="scale")
    cluster.wait_until(lambda: workers_rendered(REPLICAS + 1), timeout=120,
                       message="the new Ready pod is rendered into the router's workers")
    assert "--service-discovery" in rendered["args"]


# A small resource (a 24 GB workstation GPU, Llama-2-7B: 512 KiB of KV per token) so a few requests overflow its GPU
# and CPU tiers; its disk tier holds them all. The disk at the default 0.94 GB/s reloads slower than the prefill
# recomputes; at 30 GB/s (a striped NVMe array) faster.
SMALL_TIERS = {"model": {"name": "meta-llama/Llama-2-7b-hf"}, "engine": {"maxModelLen": 4096},
               "offload": {"cpu": {"size": "2Gi"}, "disk": {"path": "/mnt/nvme/lmcache", "size": "20Gi"}},
               "resources": {"gpuMemory": "24Gi"}}
DOC_WORDS = 1000


def revisit_the_oldest(binary: Path, args: list[str], capacity: dict[str, int], texts: list[str], log: Path,
                       wait_until: Any) -> dict[str, Any]:
    """Two stand-in replicas with `capacity`, the router with the rendered `args` given them as --worker-urls
    (discovery is the first test's): every document goes to one replica (the holder; the other is kept busy by one
    waiting request meanwhile), the router trims its trees, then the first document is asked again. The stand-in's
    answer, with the holder's name and where the holder keeps that document."""
    engines = [StandInPrefixEngine(f"r{i}", "127.0.0.1", _free_port(), capacity, seconds_per_token={"recompute": 0.0})
               for i in range(2)]
    argv = (args[:args.index("--service-discovery")] + ["--worker-urls", *(e.url for e in engines)]
            + args[args.index("--policy"):])
    router = Router(binary, argv, Path("/nonexistent"), log)
    try:
        wait_until(router.ready, timeout=60, message=f"the router sees both stand-ins (log: {log})")
        # The replica the router picks first (both idle) gets one request that waits for its prefill, so every new
        # document goes to the other, idle one.
        for e in engines:
            e.prefill.acquire()
        blocker = threading.Thread(target=router.complete, args=("one request that keeps this replica busy",))
        blocker.start()
        wait_until(lambda: any(e.waiting for e in engines), timeout=30, message="the busy request arrives")
        busy = next(e for e in engines if e.waiting)
        holder = next(e for e in engines if e is not busy)
        holder.prefill.release()
        for k, text in enumerate(texts):
            assert router.complete(f"{text} question {k}")["kvoffload_stand_in"]["replica"] == holder.name
        busy.prefill.release()
        blocker.join(timeout=30)
        first = PrefixCache.keys(tokens(texts[0]))[0]
        where = [t for t in ("gpu", "cpu", "disk") if first in holder.cache.tiers[t]]
        # A whole trimming of the trees after the last document (the router logs each at debug level).
        trims = _plain(log).count("Cache eviction completed")
        wait_until(lambda: _plain(log).count("Cache eviction completed") >= trims + 2, timeout=30,
                   message="the router trims its trees")
        answer = router.complete(f"{texts[0]} another question")["kvoffload_stand_in"]
        return {**answer, "holder": holder.name, "holder_tiers": where}
    finally:
        router.stop()
        for e in engines:
            e.close()


def test_a_prefix_left_only_in_a_slow_tier_stops_drawing_its_requests(cluster, namespace, operator, tmp_path,
                                                                      vllm_router):
    """The operator's cache_aware rendering on the real router: the tree budget counts only the tiers worth a hit. Two
    resources differ only in their disk tier's read rate; on one replica of each, the same documents leave the first
    one in its disk tier alone (the GPU and CPU tiers evicted it). Where that disk is slower than recompute, the
    router has forgotten the document and sends its next request by load, away from the replica that holds it; where
    the disk is faster than recompute, the router still sends it to that replica, which serves it from its disk."""
    for name, disk in (("slow", {}), ("fast", {"readGbps": 30})):
        cluster.client.apply(serve(name, SMALL_TIERS, replicas=2, routing={},
                                   offload__disk={**SMALL_TIERS["offload"]["disk"], **disk}), namespace)
    rendered: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for name in ("slow", "fast"):
        def seen(name: str = name) -> bool:
            st = cluster.client.get("kvs", name, namespace).get("status") or {}
            if "maxTreeSize" in st.get("routing", {}) and "budget" in st:
                deployment = cluster.client.get("deployment", f"{name}-router", namespace)
                rendered[name] = (st, deployment["spec"]["template"]["spec"]["containers"][0]["args"])
            return name in rendered
        cluster.wait_until(seen, timeout=120, message=f"the operator renders {name}'s router and its Budget")
    (slow, slow_args), (fast, fast_args) = rendered["slow"], rendered["fast"]
    assert slow["budget"]["tiers"] == fast["budget"]["tiers"]  # the same tiers: only the disk's read rate differs
    assert {r["tier"]: r["slowerThanRecompute"] for r in slow["budget"]["reload"]} == {"cpu": False, "disk": True}
    assert {r["tier"]: r["slowerThanRecompute"] for r in fast["budget"]["reload"]} == {"cpu": False, "disk": False}
    for st, args in rendered.values():
        assert args[args.index("--max-tree-size") + 1] == str(st["routing"]["maxTreeSize"])
    capacity = {t["name"]: t["tokens"] for t in slow["budget"]["tiers"]}
    docs = capacity["disk"] // (DOC_WORDS + BLOCK) - 1  # fill the disk tier, overflow the GPU and CPU tiers
    assert (docs - 1) * DOC_WORDS > max(capacity["gpu"], capacity["cpu"])
    texts = [" ".join(f"slowtier{k}w{j}" for j in range(DOC_WORDS)) for k in range(docs)]

    # Slow disk: the tree budget is the GPU tier's (it holds more than the CPU tier), so the router has forgotten the
    # document; load decides (both idle: the first replica), and the request is recomputed there.
    answer = revisit_the_oldest(vllm_router, slow_args, capacity, texts, tmp_path / "router-slow.log",
                                cluster.wait_until)
    assert answer["holder_tiers"] == ["disk"], answer
    assert answer["replica"] != answer["holder"] and sum(answer["hit_tokens"].values()) == 0, answer
    # Fast disk: the tree budget is the disk tier's; the router sends the document to its holder, a disk hit.
    answer = revisit_the_oldest(vllm_router, fast_args, capacity, texts, tmp_path / "router-fast.log",
                                cluster.wait_until)
    assert answer["holder_tiers"] == ["disk"], answer
    assert answer["replica"] == answer["holder"] and answer["hit_tokens"]["disk"] >= DOC_WORDS // BLOCK * BLOCK, answer
