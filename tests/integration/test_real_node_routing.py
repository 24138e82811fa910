"""spec.routing on the real node: the router pod exactly as the operator renders it, run by kubelet + containerd + runc,
in front of two serving pods on the same node.

The operator is the demo's (in-cluster, from the chart). tests/cluster/demo-values.yaml places router pods on the real
node (operator.config.routerNodeSelector / routerTolerations) and never pulls the router image
(routerImagePullPolicy Never); the `router_image` fixture builds images/router/Dockerfile here (kvtest.images
"router": vllm-router 0.1.17 from the wheels `make router-wheels` fetched) and imports it into the node. The serving
pods run the slim STAND-IN engine (kvtest.images STANDIN_SLIM: no vLLM, no model); what it answers the router is
tests/fixtures/fake_vllm's recorded mode, whose answers name the pod that served them. Backend lmcache (in-process,
kvtest.node.routed_spec): lmcache-server's server sidecar requests a whole CPU per pod, and this node has two.

What it shows: the router runs under its rendered securityContext (the kernel's view of its process: uid 65532, no
capabilities, no new privileges, seccomp, read-only root); it watches the API server with its own ServiceAccount
(the `kubernetes` Service) and discovers exactly the serving pods; RouterReady and Ready; real requests sent to the
router's Service ClusterIP (198.19.0.x, routed to the bridge on the host) reach both serving pods and come back 200;
with cache_aware, every request on one document reaches the replica that served it first (the workload of
kvtest.router_workload, run against the same router as a host process in tests/unit/test_router_standin.py). Then a
replica added the way an autoscaler adds one (the HPA controller, KEDA's included, writes the resource's scale
subresource) becomes Ready on the node, the router discovers it, and it takes the new document that arrives while
the others are busy.
"""

from __future__ import annotations

import ipaddress
import shutil
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from kvtest import condition, node
from kvtest import router_workload as rw

pytestmark = pytest.mark.cluster

DISK_ROOT = Path("/var/lib/kvoffload")  # one of the chart's allowedDiskRoots
NAME = "routed"
REPLICAS = 2
ROUTER_UID = 65532  # images/router/Dockerfile USER, the rendered runAsUser


@pytest.fixture
def disk_dir():
    DISK_ROOT.mkdir(exist_ok=True)  # the admin's root (the hostPath volume, type Directory)
    d = DISK_ROOT / f"t-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def wait_cond(demo, ns, name, type_, status, timeout=300):
    def check():
        obj = demo.client.get_or_none("kvs", name, ns)
        return obj if condition(obj, type_).get("status") == status else None
    return demo.wait_until(check, timeout=timeout, interval=1, message=f"{name} {type_}={status}")


def to_bytes(q: str) -> int:
    from kvoffload.api.quantity import to_bytes as parse
    return parse(q, "quantity")


def test_the_rendered_router_pod_routes_to_the_serving_pods_on_the_real_node(demo, node_ns, engine_image, router_image,
                                                                              disk_dir):
    cfg = node.operator_config(demo)
    assert cfg.get("routerNodeSelector") == node.PLACEMENT["nodeSelector"] and cfg.get("routerImage") == router_image, (
        "the demo's operator does not run routers on the real node from the image built here (tests/cluster/"
        "demo-values.yaml: routerNodeSelector, routerTolerations, "
        f"routerImagePullPolicy); a demo from an older tree? {cfg}")

    # --- the resource: two stand-in replicas on the real node (backend lmcache, in-process: kvtest.node.routed_spec),
    # routing on (cache_aware: what vLLM 0.26.0 allows)
    body = node.routed_spec(NAME, engine_image, disk_dir, replicas=REPLICAS)
    t0 = time.monotonic()
    demo.client.create(body, node_ns)
    try:
        obj = wait_cond(demo, node_ns, NAME, "Ready", "True", timeout=600)
        print(f"KVOffloadServe {NAME} with its router Ready in {time.monotonic() - t0:.0f}s")
        check_router(demo, node_ns, obj, body, router_image)
        scale_out(demo, node_ns, body)
    except BaseException:
        print_router(demo, node_ns)
        raise


KV_NAME = "kvrouted"


def _router_args(demo, ns: str, name: str) -> list[str]:
    deployment = demo.client.get("deployments", f"{name}-router", ns)
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def _ready_router_with(demo, ns: str, name: str, ips: set[str]) -> dict | None:
    """The router pod that runs the template naming exactly `ips` as its workers, once it is Ready and alone."""
    args = _router_args(demo, ns, name)
    if set(rw.worker_urls(args)) != {f"http://{ip}:8000" for ip in ips}:
        return None
    pods = demo.client.list("pods", ns, labels={"kvoffload.io/router": name})
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    if len(live) != 1 or live[0]["spec"]["containers"][0]["args"] != args:
        return None
    return live[0] if condition(live[0], "Ready").get("status") == "True" else None


def test_kv_aware_on_the_real_node_follows_each_replicas_kv_events(demo, node_ns, engine_image, router_image):
    """spec.routing kv_aware on backend vllm-native (its engines publish the GPU and CPU tiers' KV events):
    the operator renders the router pod with the Ready serving pods' IPs as workers and their publishers as static
    event sources, and rolls it when they change. On the real node: the router pod reaches each serving pod's
    publisher on the bridge; a document computed on one replica (the other kept busy, so load alone would not pick
    it) keeps its requests there, and still does once that replica's GPU tier evicted it (its CPU tier holds it,
    whose events the router credited): CPU hits. Then a replica added through the scale subresource: once Ready it
    is rendered into the router's workers, the router pod rolls, and requests sent all through the roll all answer.
    The serving pods run the slim STAND-IN engine, whose KV events are vLLM's classes (byte-equal to vLLM 0.26.0's:
    tests/engine/test_kv_events_mirror.py)."""
    body = node.kv_routed_spec(KV_NAME, engine_image, replicas=REPLICAS)
    model = body["spec"]["model"]["name"]
    c = demo.client
    c.create(body, node_ns)
    try:
        wait_cond(demo, node_ns, KV_NAME, "Ready", "True", timeout=600)
        serving = c.list("pods", node_ns, labels={"kvoffload.io/serve": KV_NAME})
        ips = {p["status"]["podIP"] for p in serving}
        rpod = demo.wait_until(lambda: _ready_router_with(demo, node_ns, KV_NAME, ips), timeout=180, interval=1,
                               message="the router pod rendered with both serving pods as workers is Ready")
        st = c.get("kvs", KV_NAME, node_ns)["status"]["routing"]
        assert (st["policy"], st["eventTiers"], st["workers"]) == ("kv_aware", ["gpu", "cpu"], REPLICAS), st
        args = rpod["spec"]["containers"][0]["args"]
        assert set(rw.flag_values(args, "--kv-event-source")) == {f"http://{ip}:8000=tcp://{ip}:5557" for ip in ips}
        assert rpod["spec"]["nodeName"] == node.NAME

        router = f"http://{c.get('services', f'{KV_NAME}-router', node_ns)['spec']['clusterIP']}:8000"
        demo.wait_until(lambda: urllib.request.urlopen(f"{router}/readiness", timeout=5).status == 200,  # noqa: S310
                        timeout=60, interval=1, message="the router's /readiness on its ClusterIP")
        # A document only in one replica's CPU tier (its BlockStored, medium CPU, over the bridge): the router finds
        # it in its index (a placement lookup hit: only those events could tell it) and sends it there, CPU hits.
        holder = sorted(serving, key=lambda p: p["metadata"]["name"])[-1]
        holder_url = f"http://{holder['status']['podIP']}:8000"
        metrics = f"http://{rpod['status']['podIP']}:29000/metrics"

        def lookup_hits() -> float:
            return rw.total(rw.parse_metrics(rw.metrics_text(metrics)), "vllm_router_kv_placement_lookups_total",
                            result="hit")

        try_cpu = rw.kv_seeded(router, model, holder_url, ("cpu",), None)

        def credited() -> tuple | None:
            before = lookup_hits()
            got = try_cpu()
            return got if got[0] == holder["metadata"]["name"] and lookup_hits() > before else None

        got = demo.wait_until(credited, timeout=90, interval=0.5, message="the router credits a CPU-tier document")
        assert got[3]["cpu"] == 320, got
        print(f"kv_aware on the real node: a document only in {got[0]}'s CPU tier reached it, {got[3]['cpu']} "
              "CPU-tier hit tokens")
        doc = " ".join(f"kvnode{uuid.uuid4().hex[:6]}w{j}" for j in range(320))

        # --- a replica added the way an autoscaler adds one; requests keep flowing while the router rolls
        results: list[object] = []  # each request's status, or what failed it
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                try:
                    status, _ = rw.post_json(f"{router}/v1/completions", {"model": model, "prompt": f"{doc} during",
                                                                           "max_tokens": 1})
                    results.append(status)
                except Exception as e:  # noqa: BLE001 - a dropped request is what this counts
                    results.append(repr(e))

        sender = threading.Thread(target=traffic, daemon=True)
        sender.start()
        t0 = time.monotonic()
        c.patch("kvoffloadserves", KV_NAME, {"spec": {"replicas": REPLICAS + 1}}, node_ns, subresource="scale")

        def grown() -> dict | None:
            pods = c.list("pods", node_ns, labels={"kvoffload.io/serve": KV_NAME})
            up = {p["status"]["podIP"] for p in pods if condition(p, "Ready").get("status") == "True"}
            return _ready_router_with(demo, node_ns, KV_NAME, up) if len(up) == REPLICAS + 1 else None

        demo.wait_until(grown, timeout=300, interval=1, message="the router rolled to the 3 Ready serving pods")
        time.sleep(3)  # deliberate: traffic goes on through the new router for a moment before it stops
        stop.set()
        sender.join(timeout=60)
        print(f"scale {REPLICAS} -> {REPLICAS + 1}: router rolled after {time.monotonic() - t0:.0f}s, "
              f"{len(results)} requests through the roll")
        assert results and set(results) == {200}, results
        assert c.get("kvs", KV_NAME, node_ns)["status"]["routing"]["workers"] == REPLICAS + 1
    except BaseException:
        print_router(demo, node_ns, KV_NAME)
        raise
    finally:
        c.delete("kvoffloadserves", KV_NAME, node_ns, missing_ok=True)


def print_router(demo, ns: str, name: str = NAME) -> None:
    """What a failure needs: the resource's conditions, the router pod's state and log (through the API server)."""
    obj = demo.client.get_or_none("kvs", name, ns) or {}
    print("conditions:", [(c["type"], c["status"], c.get("reason"), c.get("message")) for c in
                          (obj.get("status") or {}).get("conditions", [])])
    for pod in demo.client.list("pods", ns, labels={"kvoffload.io/router": name}):
        print(f"router pod {pod['metadata']['name']} on {pod['spec'].get('nodeName')}: {pod['status'].get('phase')}, "
              f"{pod['status'].get('containerStatuses')}")
        try:
            log = demo.client.request("GET", f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}/log")
            print(f"router log (last 6000 characters):\n{str(log)[-6000:]}")
        except Exception as e:  # noqa: BLE001 - a diagnostic only
            print(f"no router log: {e!r}")


def check_router(demo, node_ns: str, obj: dict, body: dict, router_image: str) -> None:
    router_ready = condition(obj, "RouterReady")
    assert (router_ready["status"], router_ready["reason"]) == ("True", "RouterAvailable"), router_ready
    st = obj["status"]
    assert st["routing"]["policy"] == "cache_aware" and st["routing"]["readyReplicas"] == 1, st["routing"]
    assert st["endpoint"] == f"http://{NAME}-router.{node_ns}.svc:8000/v1", st["endpoint"]
    model = body["spec"]["model"]["name"]

    serving = demo.client.list("pods", node_ns, labels={"kvoffload.io/serve": NAME})
    assert len(serving) == REPLICAS and {p["spec"]["nodeName"] for p in serving} == {node.NAME}, serving
    (rpod,) = demo.client.list("pods", node_ns, labels={"kvoffload.io/router": NAME})
    assert rpod["spec"]["nodeName"] == node.NAME and rpod["status"]["phase"] == "Running", rpod["status"]
    (rendered,) = rpod["spec"]["containers"]
    assert rendered["image"] == router_image and rendered["imagePullPolicy"] == "Never", rendered
    (cs,) = rpod["status"]["containerStatuses"]
    assert cs["ready"] and cs["restartCount"] == 0, cs  # its probes pass on the pod IP
    router_ip = rpod["status"]["podIP"]
    assert ipaddress.ip_address(router_ip) in ipaddress.ip_network(node.POD_CIDR)

    # --- what runc was given, and the kernel's view of the router's process
    oci = node.oci_specs(demo.cluster, node_ns, rpod["metadata"]["name"])["router"]
    proc = oci["process"]
    assert (proc["user"]["uid"], proc["user"]["gid"]) == (ROUTER_UID, ROUTER_UID), proc["user"]
    assert oci["root"]["readonly"] is True and proc["noNewPrivileges"] is True
    assert not (proc.get("capabilities", {}).get("effective") or []), proc.get("capabilities")
    assert oci["linux"]["resources"]["memory"]["limit"] == to_bytes(rendered["resources"]["limits"]["memory"])
    pids = node.task_pids(demo.cluster, rpod)
    assert set(pids) == {"router"}, pids
    pid = pids["router"]
    status = node.proc_status(pid)
    assert status["Uid"].split() == [str(ROUTER_UID)] * 4 and status["Gid"].split() == [str(ROUTER_UID)] * 4, status
    assert (status["CapEff"], status["CapPrm"], status["NoNewPrivs"], status["Seccomp"]) == \
        ("0000000000000000", "0000000000000000", "1", "2"), status
    mounts = node.mount_options(pid)
    assert mounts["/"][0].split(",")[0] == "ro", mounts["/"]
    assert mounts["/tmp"][0].split(",")[0] == "rw", mounts.get("/tmp")  # the emptyDir, its only writable place
    # Its own token, mounted where kubelet put it (/var/run is a link to /run in the image: read the mount table,
    # since the link would resolve against this host's root through /proc/PID/root).
    (sa,) = [m for m in mounts if m.endswith("/secrets/kubernetes.io/serviceaccount")]
    assert mounts[sa][0].split(",")[0] == "ro" and Path(f"/proc/{pid}/root{sa}/token").exists(), (sa, mounts[sa])
    # It listens on its pod IP only: the HTTP port and the metrics port the rendered Service names.
    listeners = node.listening(pid)
    assert {(router_ip, 8000), (router_ip, 29000)} <= listeners, listeners
    assert not [a for a in listeners if a[0] == "0.0.0.0"], listeners

    # --- discovery: exactly the serving pods, through the API server with its ServiceAccount
    direct = f"http://{router_ip}:8000"
    want = {f"http://{p['status']['podIP']}:8000" for p in serving}
    demo.wait_until(lambda: rw.workers(direct) == want, timeout=60, message=f"the router's workers are {sorted(want)}")
    assert f"http://{router_ip}:8000" not in rw.workers(direct)
    samples = rw.parse_metrics(rw.metrics_text(f"http://{router_ip}:29000/metrics"))
    assert rw.by_label(samples, "vllm_router_worker_health", "worker") == dict.fromkeys(want, 1.0), samples

    # --- real requests to the router's Service (its ClusterIP, on the bridge; kube-proxy picks the router pod)
    svc = demo.client.get("services", f"{NAME}-router", node_ns)
    cluster_ip = svc["spec"]["clusterIP"]
    assert ipaddress.ip_address(cluster_ip) in ipaddress.ip_network(node.SERVICE_CIDR), cluster_ip
    router = f"http://{cluster_ip}:8000"
    try:  # kube-proxy programs the Service once the router pod is ready: allow it a moment
        demo.wait_until(lambda: urllib.request.urlopen(f"{router}/readiness", timeout=5).status == 200,  # noqa: S310
                        timeout=60, interval=1, message=f"the router's /readiness on its ClusterIP {cluster_ip}")
    except TimeoutError as e:
        pytest.fail("the router answers on its pod IP but not on its "
                    f"Service's ClusterIP {cluster_ip} from the host: {e}")
    replicas = sorted(want)
    served = rw.affinity(router, replicas, model, rounds=3, hold_s=5.0, seed=uuid.uuid4().hex[:6], wait=demo.wait_until)
    print(f"served: {served}")
    names = {p["metadata"]["name"] for p in serving}
    assert {r for rs in served.values() for r in rs} == names, (served, names)  # both serving pods answered
    assert {k: len(set(v)) for k, v in served.items()} == {0: 1, 1: 1}, served  # each document stayed on one replica
    assert served[0][0] != served[1][0], served

    # The router's own account: prefix hits for every repeat, token ids from every replica, four requests each.
    samples = rw.parse_metrics(rw.metrics_text(f"http://{router_ip}:29000/metrics"))
    decisions = {lab["outcome"]: v for n, lab, v in samples if n == rw.PREFIX_DECISIONS
                 and lab.get("policy") == "cache_aware"}
    assert decisions.get("prefix_hit", 0) >= 2 * 3 and not decisions.get("missing_tokens"), decisions
    assert rw.by_label(samples, "vllm_router_processed_requests_total", "worker") == dict.fromkeys(want, 4.0), samples
    asked = {c["replica"]: c for c in rw.counts(replicas)}
    assert set(asked) == names and all(c["completions"] == 4 and c["render"] >= 8 for c in asked.values()), asked

    # Nothing left the bridge on the way (the guard's counters: kvtest.node).
    dropped = {k: v for k, v in node.guard_counters().items() if v}
    assert not dropped, (dropped, node.guard_log()[-20:])


def scale_out(demo, node_ns: str, body: dict) -> None:
    c, model, grown = demo.client, body["spec"]["model"]["name"], REPLICAS + 1
    t0 = time.monotonic()
    c.patch("kvoffloadserves", NAME, {"spec": {"replicas": grown}}, node_ns, subresource="scale")

    def ready() -> list[dict] | None:
        pods = c.list("pods", node_ns, labels={"kvoffload.io/serve": NAME})
        up = [p for p in pods if any(x["type"] == "Ready" and x["status"] == "True"
                                     for x in (p.get("status") or {}).get("conditions") or [])]
        return up if len(up) == grown else None

    serving = demo.wait_until(ready, timeout=300, interval=1, message=f"{grown} serving pods Ready")
    print(f"scale subresource {REPLICAS} -> {grown}: the new pod Ready after {time.monotonic() - t0:.0f}s")
    assert {p["spec"]["nodeName"] for p in serving} == {node.NAME}
    (rpod,) = c.list("pods", node_ns, labels={"kvoffload.io/router": NAME})
    want = {f"http://{p['status']['podIP']}:8000" for p in serving}
    demo.wait_until(lambda: rw.workers(f"http://{rpod['status']['podIP']}:8000") == want, timeout=60, interval=1,
                    message=f"the router's workers are the {grown} pods")
    print(f"the router routes to the new pod {time.monotonic() - t0:.0f}s after the scale write")
    # Three new documents, each held in flight while the next arrives: a cache_aware miss goes to the least
    # loaded replica, so the third lands on the one replica that is idle, whichever that is; all three answer.
    router = f"http://{c.get('services', f'{NAME}-router', node_ns)['spec']['clusterIP']}:8000"
    docs = rw.documents(grown, 300, uuid.uuid4().hex[:6])
    answers: list[dict] = []
    threads = [threading.Thread(target=lambda d=d: answers.append(rw.complete(router, model, f"{d} question 0",
                                                                              hold_s=6.0)), daemon=True) for d in docs]
    for k, t in enumerate(threads):
        t.start()
        demo.wait_until(lambda k=k: sum(x["in_flight"] for x in rw.counts(sorted(want))) == k + 1, timeout=5,
                        interval=0.05, message=f"request {k + 1} in flight")
    for t in threads:
        t.join(timeout=60)
    served = sorted(a[rw.STAND_IN]["replica"] for a in answers)
    assert served == sorted(p["metadata"]["name"] for p in serving), served  # the new pod took one
