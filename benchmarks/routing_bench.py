"""Routing benchmark (docs/benchmarks.md "Routing"): the real vllm-router 0.1.17 (`make router`) in front of 4 stand-in
engines (kvtest.standin_prefix_engine) on 127.0.0.2-5, a shared-prefix workload sent by concurrent clients, and per
configuration the fleet's hits per tier, the tokens recomputed and the time to first token.

Configurations: round robin; cache_aware with the router's own constants; cache_aware with the flags kvoffload renders
(rendering/routing.policy_args on the Budget below). With --kv, also kv_aware with the router's constant credits and
with kvoffload's (kv_aware needs an engine that lets the router index it: the stand-ins then serve GET /get_server_info
and /kv_event_sources and publish vLLM's KV event classes, so they run under the engine venv's python; vLLM 0.26.0
does not: docs/routing.md).

The resource (--resource, RESOURCES below): its tiers' tokens are divided by --scale so a run takes seconds; everything
else comes from its Budget (status.budget.reload): a GPU hit costs nothing, a CPU or disk hit its reload time per token,
a recomputed token the recompute time per token. The stand-ins take that modelled prefill time for each request, one
prefill at a time per replica, so the router's load signal (requests in flight) and the waiting are those of
prefill-bound engines. TTFT figures: "at the replica" from a request's arrival at its replica to the end of its
prefill (queueing included); "modelled" the prefill time alone; "through the router" what the clients measured, which
adds the router's own work (for cache_aware, asking every replica to tokenize the request) on this machine.

The router's constants are capacities and durations too, so they are scaled like the tiers: --max-tree-size
2**25 / scale, --eviction-interval-secs 120 / scale (at least 1, the router's minimum), which keeps them what they are
against the real tiers and the real prefill rate (unscaled, 2**25 would be hundreds of times what a scaled tier holds).

The workload (as a RAG or document-QA service sees it): one system prompt in front of every request, then one of the
documents, then a question of its own; each document asked --rounds times, in a shuffled order, by --clients clients
at once. Two sizes: the documents overflow one replica's GPU tier and fit the fleet's CPU tiers (3/4 of them), or fit
one replica's GPU tier (half of it).

    .venv/bin/python benchmarks/routing_bench.py [--scale 64] [--rounds 6] [--clients 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvoffload.api.settings import Settings
from kvoffload.api.spec import RoutingSpec
from kvoffload.controller import pipeline
from kvoffload.engine import router as engine_router
from kvoffload.planning import routing as plan_routing
from kvoffload.planning.sizing import Budget
from kvoffload.rendering import routing as render_routing
from kvtest.specs import BASE, SERVE_SPEC, spec
from kvtest.standin_prefix_engine import TIERS

ROOT = Path(__file__).resolve().parents[1]
ROUTER = Path.home() / ".cache" / "kvoffload" / f"vllm-router-{engine_router.VERSION}" / "bin" / "vllm-router"
ENGINE_PY = Path.home() / ".cache" / "kvoffload" / "engine-vllm-0.26.0-lmcache-0.5.3" / "bin" / "python"
HOSTS = [f"127.0.0.{i}" for i in range(2, 6)]
PORT = 18200
QUESTION_TOKENS = 16
# name: (what it is, the spec: kvtest.specs.spec(base, **patch)).
RESOURCES = {
    # The CPU tier (1.3M tokens) holds less than the router's constant tree budget (2**25 characters: 4.2M tokens).
    "llama-8b": ("Llama-3.1-8B on 80Gi GPUs, 32K context, CPU tier "
                 "160Gi, disk 200Gi at 0.94 GB/s (slower than recompute)",
                 (BASE, {"offload__cpu__size": "160Gi"})),
    # The CPU tier (6.0M tokens) holds more than the constant: an H200 host's memory shared by its replicas.
    "qwen-7b": ("Qwen2.5-7B on H200s, 16K context, CPU tier 320Gi, disk 100Gi at 0.94 GB/s (slower than recompute)",
                (SERVE_SPEC, {"offload__cpu__size": "320Gi"})),
}


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(system_tokens: int, docs: int, doc_tokens: int, rounds: int, seed: int) -> list[str]:
    """System prompt + document + question; each document `rounds` times, shuffled. One word is one token."""
    system = " ".join(f"sys{j}" for j in range(system_tokens))
    texts = [" ".join(f"d{k}w{j}" for j in range(doc_tokens)) for k in range(docs)]
    out = [f"{system} {texts[k]} " + " ".join(f"q{r}k{k}t{j}" for j in range(QUESTION_TOKENS))
           for r in range(rounds) for k in range(docs)]
    random.Random(seed).shuffle(out)
    return out


def scaled(budget: Budget, scale: int) -> Budget:
    """The Budget with each tier's tokens and sequences divided by `scale` (what the stand-ins hold)."""
    return dataclasses.replace(budget, tiers=tuple(dataclasses.replace(t, tokens=t.tokens // scale)
                                                   for t in budget.tiers))


def _standins(capacity: dict[str, int], seconds_per_token: dict[str, float], kv: bool) -> subprocess.Popen[str]:
    conf = {"engines": [{"name": f"r{i}", "host": h, "port": PORT} for i, h in enumerate(HOSTS)], "capacity": capacity,
            "kv_events": kv, "seconds_per_token": seconds_per_token}
    proc = subprocess.Popen([str(ENGINE_PY if kv else sys.executable), "-m", "kvtest.standin_prefix_engine",
                             json.dumps(conf)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "tests" / "support")})
    assert proc.stdout is not None
    while "stand-in engines ready" not in (line := proc.stdout.readline()):
        assert line, "the stand-in engines did not start"
    return proc


def run(router: Path, policy: list[str], prompts: list[str], clients: int, log: Path, kv: bool) -> dict[str, Any]:
    for h in HOSTS:
        _post(f"http://{h}:{PORT}/standin/reset", {})
        _post(f"http://{h}:{PORT}/standin/stop", {})  # "starting": the router subscribes to workers that become healthy
    port, metrics = _free_port(), _free_port()
    proc = subprocess.Popen([str(router), "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                             *[f"http://{h}:{PORT}" for h in HOSTS], "--prometheus-host", "127.0.0.1",
                             "--prometheus-port", str(metrics), *policy],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        time.sleep(2)
        for h in HOSTS:
            _post(f"http://{h}:{PORT}/standin/start", {})
        for _ in range(240):
            try:
                if urllib.request.urlopen(f"{url}/readiness", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        if kv:  # until the router routes by each stand-in's events (what is published before it subscribed is lost)
            for i, h in enumerate(HOSTS):
                for n in range(240):
                    probe = " ".join(f"probe{i}n{n}w{j}" for j in range(64))
                    _post(f"http://{h}:{PORT}/standin/seed", {"prompt": probe, "tiers": ["gpu"]})
                    time.sleep(0.3)
                    if _post(f"{url}/v1/completions",
                             {"model": "stand-in", "prompt": probe})["kvoffload_stand_in"]["replica"] == f"r{i}":
                        break
            for h in HOSTS:
                _post(f"http://{h}:{PORT}/standin/reset", {})
            time.sleep(1)

        def one(prompt: str) -> float:
            t0 = time.monotonic()
            _post(f"{url}/v1/completions", {"model": "stand-in", "prompt": prompt, "max_tokens": 1})
            return time.monotonic() - t0

        start = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            ttft = list(pool.map(one, prompts))
        wall = time.monotonic() - start
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        decisions = _decisions(scraped)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    counts = [json.loads(urllib.request.urlopen(f"http://{h}:{PORT}/standin/counts", timeout=10).read()) for h in HOSTS]
    return {"wall_s": round(wall, 2), "requests": [c["requests"] for c in counts], "router_decisions": decisions,
            "prompt_tokens": sum(c["prompt_tokens"] for c in counts),
            "hit_tokens": {t: sum(c["hit_tokens"][t] for c in counts) for t in TIERS},
            "computed_tokens": sum(c["computed_tokens"] for c in counts),
            "ttft_ms": {"at the replica": _ms([x for c in counts for x in c["ttft_s"]]),
                        "through the router": _ms(ttft)}}


def _decisions(metrics: str) -> dict[str, int]:
    """cache_aware's decisions by outcome, from the router's own counter: prefix_hit (followed a tree), prefix_miss
    (no tree matched enough: by load), load_imbalance, missing_tokens (a replica did not tokenize it within the
    router's 1 s budget: by load, and remembered nowhere)."""
    found = re.findall(r'^vllm_router_prefix_routing_decisions_total\{([^}]*)\} (\S+)$', metrics, re.M)
    out: dict[str, int] = {}
    for labels, value in found:
        outcome = re.search(r'outcome="([^"]+)"', labels)
        if outcome:
            out[outcome.group(1)] = out.get(outcome.group(1), 0) + int(float(value))
    return out


def _ms(seconds: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.mean(seconds) * 1000, 2),
            "p90": round(statistics.quantiles(seconds, n=10)[-1] * 1000, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=64, help="divide the Budget's tier tokens by this")
    ap.add_argument("--rounds", type=int, default=6, help="times each document is asked about")
    ap.add_argument("--system-tokens", type=int, default=256, help="the system prompt in front of every request")
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--clients", type=int, default=8, help="requests in flight at once")
    ap.add_argument("--seeds", type=int, default=1, help="run each configuration on this many orders of the requests")
    ap.add_argument("--resource", choices=sorted(RESOURCES), default="llama-8b")
    ap.add_argument("--router", type=Path, default=ROUTER, help="the vllm-router binary (make router)")
    ap.add_argument("--only", default="", help="run only the workloads whose name contains this")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--kv", action="store_true", help="also the kv_aware configurations (needs the engine venv)")
    a = ap.parse_args()
    settings = Settings()
    base, patch = RESOURCES[a.resource][1]
    full = pipeline.desired("bench", "bench", "u", spec(base, routing={}, **patch), settings).budget
    budget = scaled(full, a.scale)
    reload = {r.tier: r for r in budget.reload}
    L = reload["cpu"].tokens
    per_token = {"gpu": 0.0, "cpu": reload["cpu"].reload_s / L, "disk": reload["disk"].reload_s / L,
                 "recompute": reload["cpu"].recompute_s / L}
    capacity = {t.name: t.tokens for t in budget.tiers}
    credits = plan_routing.credits(budget)
    per_request = a.system_tokens + a.doc_tokens + QUESTION_TOKENS
    fleet_cpu_docs = len(HOSTS) * (capacity["cpu"] - a.system_tokens) // (a.doc_tokens + QUESTION_TOKENS)
    loads = {"overflows one GPU tier, fits the fleet's CPU tiers":
             max(2 * capacity["gpu"] // per_request + 1, fleet_cpu_docs * 3 // 4),
             "fits one GPU tier": max(1, (capacity["gpu"] // 2 - a.system_tokens) // (a.doc_tokens + QUESTION_TOKENS))}
    # As many requests in each workload: the smaller one asks each of its documents more often.
    rounds = {name: a.rounds * max(1, max(loads.values()) // docs) for name, docs in loads.items()}
    interval = max(engine_router.MIN_EVICTION_INTERVAL_S, round(engine_router.DEFAULT_EVICTION_INTERVAL_S / a.scale))
    constants = ["--max-tree-size", str(engine_router.DEFAULT_MAX_TREE_SIZE // a.scale), "--eviction-interval-secs",
                 str(interval)]
    configs = {
        "round robin": (["--policy", "round_robin"], False),
        "cache_aware, router constants": (["--policy", "cache_aware", *constants], False),
        "cache_aware, kvoffload": (render_routing.policy_args(RoutingSpec("cache_aware", "cache_aware", 1), budget),
                                   False),
    }
    if a.kv:
        configs["kv_aware, router constants"] = (["--policy", "kv_aware"], True)
        configs["kv_aware, kvoffload"] = (render_routing.policy_args(RoutingSpec("kv_aware", "kv_aware", 1), budget),
                                          True)
    results: dict[str, Any] = {"resource": RESOURCES[a.resource][0], "scale": a.scale,
                               "capacity_per_replica": capacity, "replicas": len(HOSTS), "clients": a.clients,
                               "credits": credits,
                               "seconds_per_token": per_token, "configs": {k: v[0] for k, v in configs.items()},
                               "workloads": {}}
    logs = Path("/tmp") / "routing-bench"
    logs.mkdir(exist_ok=True)
    for kv in sorted({kv for _, kv in configs.values()}):
        standins = _standins(capacity, per_token, kv)
        try:
            for name, docs in loads.items():
                if a.only not in name:
                    continue
                for seed in range(7, 7 + a.seeds):  # each seed: another order of the same requests
                    prompts = workload(a.system_tokens, docs, a.doc_tokens, rounds[name], seed)
                    rows = results["workloads"].setdefault(name, {"documents": docs, "system_tokens": a.system_tokens,
                                                                  "doc_tokens": a.doc_tokens, "rounds": rounds[name],
                                                                  "requests": len(prompts), "configs": {}})["configs"]
                    for label, (policy, needs_kv) in configs.items():
                        if needs_kv != kv:
                            continue
                        r = run(a.router, policy, prompts, a.clients,
                                logs / f"{label.replace(' ', '_').replace(',', '')}.log", kv)
                        est = sum(r["hit_tokens"][t] * per_token[t]
                                  for t in TIERS) + r["computed_tokens"] * per_token["recompute"]
                        r["hit_rate"] = {t: round(r["hit_tokens"][t] / r["prompt_tokens"], 4) for t in TIERS}
                        r["ttft_ms"]["modelled"] = round(est / len(prompts) * 1000, 2)
                        r["seed"] = seed
                        rows.setdefault(label, []).append(r)
                        print(f"{name} | seed {seed} | {label}: hits {r['hit_rate']} recomputed {r['computed_tokens']} "
                              f"TTFT {r['ttft_ms']} ms requests/replica {r['requests']} router {r['router_decisions']}",
                              flush=True)
        finally:
            if standins.stdin:
                standins.stdin.close()
            standins.wait(timeout=30)
    for name, w in results["workloads"].items():  # the mean over the seeds
        for label, runs in w["configs"].items():
            mean = {"hit_rate": round(statistics.mean(sum(r["hit_rate"].values()) for r in runs), 4),
                    "computed_tokens": round(statistics.mean(r["computed_tokens"] for r in runs)),
                    "ttft_at_replica_ms": round(statistics.mean(r["ttft_ms"]["at the replica"]["mean"] for r in runs),
                                                2),
                    "ttft_modelled_ms": round(statistics.mean(r["ttft_ms"]["modelled"] for r in runs), 2)}
            print(f"{name} | mean of {len(runs)} | {label}: {mean}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "workloads"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
