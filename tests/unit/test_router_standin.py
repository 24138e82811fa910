"""The slim stand-in engine (tests/fixtures/fake_vllm, recorded mode: what the real node's serving pods run) answers
what
vLLM's router asks of a replica, and the real router (vllm-router 0.1.17, `make router`) with the operator's rendered
cache_aware flags keeps each document on one stand-in: the workload tests/integration/test_real_node_routing.py runs
on the real node (kvtest.router_workload), here with the router and two stand-ins as processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvoffload.api.settings import Settings
from kvoffload.controller import pipeline
from kvoffload.planning import routing as plan_routing
from kvtest import ROOT, node, wait_until
from kvtest import router_workload as rw
from kvtest.procs import free_ports

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def rendered() -> pipeline.Desired:
    """The real-node test's KVOffloadServe (kvtest.node.routed_spec), rendered."""
    body = node.routed_spec("routed", "stand-in", Path("/var/lib/kvoffload/t"))["spec"]
    return pipeline.desired("routed", "ns", "uid-1", body, Settings(allowed_images=("stand-in",)))


def containers(d: pipeline.Desired, kind: str) -> dict[str, dict]:
    (obj,) = [c for c in d.children if c["kind"] == kind]
    return {c["name"]: c for c in obj["spec"]["template"]["spec"]["containers"]}


def _with(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


@contextlib.contextmanager
def stand_in(port: int, name: str, container: dict, tmp: Path, host: str = "127.0.0.1") -> Iterator[str]:
    """The stand-in `vllm serve` with the rendered engine container's arguments and plain environment values (its
    multiprocess metrics directory in `tmp`), on `host`:`port`, named `name`."""
    argv = _with(_with(container["args"], "--host", host), "--port", str(port))
    metrics = tmp / f"prometheus-{name}"
    metrics.mkdir()
    rendered_env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    env = {**os.environ, **{k: v for k, v in rendered_env.items() if k.startswith(("VLLM_", "PYTHONHASHSEED"))},
           "PYTHONPATH": str(ROOT / "tests" / "fixtures" / "fake_vllm"), "PROMETHEUS_MULTIPROC_DIR": str(metrics),
           "KVO_STANDIN_RECORDED": str(ROOT / "tests" / "fixtures"), "KVO_STANDIN_REPLICA": name}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://{host}:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or urllib.request.urlopen(f"{url}/health", timeout=2).status == 200,
                   timeout=30, interval=0.1, message=f"stand-in {name} on {url}")
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def engine() -> dict:
    return containers(rendered(), "StatefulSet")["vllm"]


def test_the_stand_in_answers_what_the_router_asks_in_vllm_0_26_shapes(tmp_path):
    (port,) = free_ports(1)
    args = engine()["args"]
    assert "LMCacheConnectorV1" in args[args.index("--kv-transfer-config") + 1]  # in-process LMCache (routed_spec)
    with stand_in(port, "replica-a", engine(), tmp_path) as url:
        prompt = "one two three one"
        _, render = rw.post_json(f"{url}/v1/completions/render", {"model": MODEL, "prompt": prompt})
        (item,) = render  # vLLM 0.26.0: a list of GenerateRequest, one per prompt
        assert len(item["token_ids"]) == 4 and item["token_ids"][0] == item["token_ids"][3]
        _, tok = rw.post_json(f"{url}/tokenize", {"model": MODEL, "prompt": prompt})
        assert tok["tokens"] == item["token_ids"] and tok["count"] == 4
        assert tok["max_model_len"] == int(args[args.index("--max-model-len") + 1])
        status, answer = rw.post_json(f"{url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert status == 200 and answer["object"] == "text_completion" and "STAND-IN" in answer["choices"][0]["text"]
        assert answer["system_fingerprint"] == "kvoffload-stand-in-engine replica-a"
        assert answer[rw.STAND_IN]["replica"] == "replica-a" and answer["usage"]["prompt_tokens"] == 4
        # A held request is in flight at this replica until its time is up.
        held = threading.Thread(target=rw.post_json, args=(f"{url}/v1/completions", {"prompt": "x", rw.HOLD: 1.5}))
        held.start()
        try:
            wait_until(lambda: rw.counts([url])[0]["in_flight"] == 1, timeout=5, interval=0.05, message="held request")
        finally:
            held.join()
        assert rw.counts([url])[0] == {"replica": "replica-a", "completions": 2, "render": 1, "tokenize": 1,
                                       "in_flight": 0, "held": 1}
        with pytest.raises(urllib.error.HTTPError) as err:
            rw.post_json(f"{url}/v1/chat/completions/nothing", {})
        assert err.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", b"[1]", method="POST"), timeout=5)
        assert err.value.code == 400


def test_the_real_router_keeps_each_document_on_one_stand_in(vllm_router, tmp_path):
    """The router with the Deployment's rendered arguments (cache_aware, the operator's tree budget), given the two
    stand-ins as --worker-urls (discovery is the cluster tests'): the second document, sent while the first is in
    flight, goes to the other replica by load; every later question on a document reaches the replica that holds it."""
    router_args = containers(rendered(), "Deployment")["router"]["args"]
    assert router_args[router_args.index("--policy") + 1] == "cache_aware"
    a, b, port, metrics = free_ports(4)
    with stand_in(a, "replica-a", engine(), tmp_path) as url_a, stand_in(b, "replica-b", engine(), tmp_path) as url_b:
        argv = [x.replace("$(POD_IP)", "127.0.0.1") for x in router_args]
        argv = (argv[:argv.index("--service-discovery")] + ["--worker-urls", url_a, url_b]
                + argv[argv.index("--policy"):])
        argv = _with(_with(argv, "--port", str(port)), "--prometheus-port", str(metrics))
        log = tmp_path / "router.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        proc = subprocess.Popen([str(vllm_router), *argv], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        router = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: rw.workers(router) == {url_a, url_b}, timeout=60,
                       message=f"the router's workers ({log})")
            wait_until(lambda: urllib.request.urlopen(f"{router}/readiness", timeout=5).status == 200, timeout=60,
                       message="the router ready")
            served = rw.affinity(router, [url_a, url_b], MODEL, rounds=3, hold_s=3.0, wait=wait_until)
            assert {k: len(set(v)) for k, v in served.items()} == {0: 1, 1: 1}, served
            assert served[0][0] != served[1][0], served  # load placed the second document on the other replica
            samples = rw.parse_metrics(rw.metrics_text(f"http://127.0.0.1:{metrics}/metrics"))
            decisions = {lab["outcome"]: v for n, lab, v in samples if n == rw.PREFIX_DECISIONS}
            assert decisions.get("prefix_hit", 0) >= 2 * 3 and not decisions.get("missing_tokens"), decisions
            assert rw.by_label(samples, "vllm_router_worker_health", "worker") == {url_a: 1.0, url_b: 1.0}
            assert rw.by_label(samples, "vllm_router_processed_requests_total", "worker") == {url_a: 4.0, url_b: 4.0}
            # The router asked each stand-in for the token ids of every request (its render route), and each answered
            # the completions of its own document.
            seen = {c["replica"]: c for c in rw.counts([url_a, url_b])}
            assert all(c["render"] >= 8 and c["completions"] == 4 for c in seen.values()), seen
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def test_the_real_router_as_rendered_for_kv_aware_follows_the_stand_ins_kv_events(vllm_router, tmp_path):
    """kv_aware as the operator renders it (backend vllm-native, auto), the workers two stand-ins on their own loopback
    addresses at the rendered port 8000, each publishing vLLM's KV event classes (the STAND-IN module, byte-equal to
    vLLM's: tests/engine/test_kv_events_mirror.py) on the rendered publisher and replay ports. The router's own
    account (its debug log's decision: the worker and the prefix tokens credited there): a document in one replica's
    GPU tier is credited whole and sent there (GPU hits); one only in its CPU tier is credited at kvoffload's CPU
    credit (--kv-penalty-host) and sent there (CPU hits); one its CPU tier stored and evicted is credited nowhere."""
    body = node.kv_routed_spec("kv", "stand-in")["spec"]
    ips = ("127.0.0.2", "127.0.0.3")
    d = pipeline.desired("kv", "ns", "uid-1", body, Settings(allowed_images=("stand-in",)), ips)
    router_args = containers(d, "Deployment")["router"]["args"]
    assert router_args[router_args.index("--policy") + 1] == "kv_aware"
    vllm = containers(d, "StatefulSet")["vllm"]
    port, metrics = free_ports(2)
    with (stand_in(8000, "replica-a", vllm, tmp_path, host=ips[0]) as url_a,
          stand_in(8000, "replica-b", vllm, tmp_path, host=ips[1]) as url_b):
        assert (url_a, url_b) == tuple(f"http://{ip}:8000" for ip in ips)
        argv = [x.replace("$(POD_IP)", "127.0.0.1") for x in router_args]
        # No API server here: without its discovery flags the router is exactly the rendered static workers.
        start, end = argv.index("--service-discovery"), argv.index("--policy")
        argv = _with(_with(argv[:start] + argv[end:], "--port", str(port)), "--prometheus-port", str(metrics))
        log = tmp_path / "router.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        proc = subprocess.Popen([str(vllm_router), *argv, "--log-level", "debug"], env=env, stdout=log.open("w"),
                                stderr=subprocess.STDOUT)
        router = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: urllib.request.urlopen(f"{router}/readiness", timeout=5).status == 200, timeout=60,
                       message=f"the router ready ({log})")
            holder, holder_url = "replica-b", url_b  # not the worker load alone would pick on a tie
            cpu = plan_routing.credit(d.budget, "cpu")

            def seeded(tiers: tuple[str, ...], evict: str | None = None) -> Callable[[], tuple]:
                return rw.kv_seeded(router, MODEL, holder_url, tiers, log.read_text, evict=evict)

            # A document only in the holder's GPU tier: the router credits all of it there (a GPU hit counts 1).
            got = wait_until(lambda: (r := seeded(("gpu",))())[:3] == (holder, holder_url, 320) and r, timeout=60,
                             message=f"the router credits the holder's GPU tier ({log})")
            assert got[3]["gpu"] == 320, got
            # Only in its CPU tier (vllm-native's CPU BlockStored): credited at kvoffload's CPU credit, a CPU hit.
            want = int(320 * cpu)
            got = wait_until(lambda: (r := seeded(("cpu",))())[:3] == (holder, holder_url, want) and r, timeout=60,
                             message=f"the router credits the holder's CPU tier at {cpu} ({log})")
            assert got[3]["cpu"] == 320, got
            # Stored and then evicted from the CPU tier (its BlockRemoved): the router credits nothing anywhere.
            got = wait_until(lambda: (r := seeded(("cpu",), evict="cpu")())[2] == 0 and r, timeout=60,
                             message=f"the router forgets what the CPU tier evicted ({log})")
            assert sum(got[3].values()) == 0, got
            text = log.read_text()  # the rendered sources, no GET /get_server_info (neither vLLM serves it)
            assert "using configured static KV event sources" in text and "no block_size" not in text
        finally:
            proc.terminate()
            proc.wait(timeout=20)
