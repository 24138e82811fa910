"""Routing benchmark (docs/benchmarks.md "Routing"): the real vllm-router 0.1.17 (`make router`) in front of 4 stand-in
engines (kvtest.standin_prefix_engine, under the engine venv's python for vLLM's KV event classes) on 127.0.0.2-5,
one shared-prefix workload sent one request at a time, and per configuration the fleet's hits per tier, the tokens
recomputed and a time-to-first-token estimate.

Configurations: round robin; cache_aware with the router's constant tree budget and with the one kvoffload renders;
kv_aware with the router's constant credits and with kvoffload's. kv_aware needs an engine that lets the router index
it: the stand-ins serve GET /get_server_info and /kv_event_sources (vLLM 0.26.0 does not: docs/routing.md).

Capacities: the tiers of one resource (Llama-3.1-8B on 80Gi GPUs, 32K context, CPU tier 160Gi, disk 200Gi at the
default 0.94 GB/s: slower than recompute; kvtest.specs.BASE with a larger CPU tier) divided by --scale, so the workload
runs in seconds; the credits, the tree budget (in the workload's own characters per token) and the TTFT figures come
from that resource's Budget (status.budget.reload): a GPU hit costs nothing, a CPU or disk hit its reload time per
token, a recomputed token the recompute time per token. cache_aware's trees are trimmed every --eviction-seconds
(the router's default is 120 s, longer than a run) so the budget applies within a run.

    .venv/bin/python benchmarks/routing_bench.py [--scale 256] [--rounds 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvoffload.api.settings import Settings
from kvoffload.controller import pipeline
from kvoffload.engine import router as engine_router
from kvoffload.planning import routing as plan_routing
from kvtest.specs import spec
from kvtest.standin_prefix_engine import TIERS, tokens

ROOT = Path(__file__).resolve().parents[1]
ROUTER = Path.home() / ".cache" / "kvoffload" / f"vllm-router-{engine_router.VERSION}" / "bin" / "vllm-router"
ENGINE_PY = Path.home() / ".cache" / "kvoffload" / "engine-vllm-0.26.0-lmcache-0.5.3" / "bin" / "python"
HOSTS = [f"127.0.0.{i}" for i in range(2, 6)]
PORT = 18200


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(prefixes: int, prefix_tokens: int, rounds: int, seed: int) -> list[str]:
    docs = [" ".join(f"d{k}w{j}" for j in range(prefix_tokens)) for k in range(prefixes)]
    out = [f"{docs[k]} " + " ".join(f"q{r}k{k}t{j}" for j in range(16)) for r in range(rounds) for k in range(prefixes)]
    random.Random(seed).shuffle(out)
    return out


def run(args_policy: list[str], prompts: list[str], log: Path, kv: bool) -> dict[str, Any]:
    for h in HOSTS:
        _post(f"http://{h}:{PORT}/standin/reset", {})
        _post(f"http://{h}:{PORT}/standin/stop", {})  # "starting": the router subscribes to workers that become healthy
    port = _free_port()
    proc = subprocess.Popen([str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                             *[f"http://{h}:{PORT}" for h in HOSTS], "--prometheus-host", "127.0.0.1",
                             "--prometheus-port", str(_free_port()), *args_policy], stdout=log.open("w"), stderr=subprocess.STDOUT)
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
                    if _post(f"{url}/v1/completions", {"model": "stand-in", "prompt": probe})["kvoffload_stand_in"]["replica"] == f"r{i}":
                        break
            for h in HOSTS:
                _post(f"http://{h}:{PORT}/standin/reset", {})
            time.sleep(1)
        start = time.monotonic()
        for p in prompts:
            _post(f"{url}/v1/completions", {"model": "stand-in", "prompt": p, "max_tokens": 1})
        wall = time.monotonic() - start
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    counts = [json.loads(urllib.request.urlopen(f"http://{h}:{PORT}/standin/counts", timeout=10).read()) for h in HOSTS]
    return {"wall_s": round(wall, 2), "requests": [c["requests"] for c in counts],
            "prompt_tokens": sum(c["prompt_tokens"] for c in counts),
            "hit_tokens": {t: sum(c["hit_tokens"][t] for c in counts) for t in TIERS},
            "computed_tokens": sum(c["computed_tokens"] for c in counts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=256, help="divide the Budget's tier tokens by this")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prefix-tokens", type=int, default=256)
    ap.add_argument("--eviction-seconds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-kv", action="store_true", help="leave out the kv_aware configurations")
    a = ap.parse_args()
    budget = pipeline.desired("bench", "bench", "u", spec(routing={}, offload__cpu__size="160Gi"), Settings()).budget
    reload = {r.tier: r for r in budget.reload}
    L = reload["cpu"].tokens
    per_token = {"gpu": 0.0, "cpu": reload["cpu"].reload_s / L, "disk": reload["disk"].reload_s / L}
    recompute = reload["cpu"].recompute_s / L
    capacity = {t.name: t.tokens // a.scale for t in budget.tiers}
    credits = plan_routing.credits(budget)
    gpu_prefixes = max(1, capacity["gpu"] // (2 * a.prefix_tokens))  # fits one replica's GPU tier twice over
    cpu_fleet = len(HOSTS) * capacity["cpu"] // a.prefix_tokens
    loads = {"overflows one GPU tier, fits the fleet's CPU tiers": max(2 * capacity["gpu"] // a.prefix_tokens + 1,
                                                                       cpu_fleet * 3 // 4),
             "fits one GPU tier": gpu_prefixes}
    conf = {"engines": [{"name": f"r{i}", "host": h, "port": PORT} for i, h in enumerate(HOSTS)], "capacity": capacity,
            "kv_events": True}
    standins = subprocess.Popen([str(ENGINE_PY), "-m", "kvtest.standin_prefix_engine", json.dumps(conf)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT / "tests" / "support")})
    assert standins.stdout is not None
    while "stand-in engines ready" not in standins.stdout.readline():
        pass
    results: dict[str, Any] = {"capacity_per_replica": capacity, "replicas": len(HOSTS), "credits": credits,
                               "seconds_per_token": {**per_token, "recompute": recompute}, "workloads": {}}
    logs = Path("/tmp") / "routing-bench"
    logs.mkdir(exist_ok=True)
    try:
        for name, prefixes in loads.items():
            prompts = workload(prefixes, a.prefix_tokens, a.rounds, seed=7)
            chars = sum(len(p) for p in prompts) / sum(len(tokens(p)) for p in prompts)
            scaled = type(budget)(**{**budget.__dict__, "tiers": tuple(type(t)(**{**t.__dict__, "tokens": capacity[t.name]})
                                                                       for t in budget.tiers)})
            tree = plan_routing.max_tree_size(scaled, chars)
            evict = ["--eviction-interval-secs", str(a.eviction_seconds)]
            configs = {
                "round robin": (["--policy", "round_robin"], False),
                "cache_aware, router constants": (["--policy", "cache_aware", *evict], False),
                "cache_aware, kvoffload": (["--policy", "cache_aware", "--max-tree-size", str(tree), *evict], False),
                "kv_aware, router constants": (["--policy", "kv_aware"], True),
                "kv_aware, kvoffload": (["--policy", "kv_aware", *(x for tier, flag in engine_router.CREDIT_FLAGS.items()
                                                                   for x in (flag, repr(credits.get(tier, 0.0))))], True),
            }
            rows = {}
            for label, (policy, kv) in configs.items():
                if kv and a.skip_kv:
                    continue
                r = run(policy, prompts, logs / f"{label.replace(' ', '_').replace(',', '')}.log", kv)
                ttft = (sum(r["hit_tokens"][t] * per_token[t] for t in TIERS) + r["computed_tokens"] * recompute) / len(prompts)
                r["hit_rate"] = {t: round(r["hit_tokens"][t] / r["prompt_tokens"], 4) for t in TIERS}
                r["ttft_estimate_ms"] = round(ttft * 1000, 2)
                rows[label] = r
                print(f"{name} | {label}: hits {r['hit_rate']} recomputed {r['computed_tokens']} TTFT~{r['ttft_estimate_ms']} ms "
                      f"requests/replica {r['requests']}", flush=True)
            results["workloads"][name] = {"prefixes": prefixes, "prefix_tokens": a.prefix_tokens, "rounds": a.rounds,
                                          "requests": len(prompts), "chars_per_token": round(chars, 2), "max_tree_size": tree,
                                          "configs": rows}
    finally:
        if standins.stdin:
            standins.stdin.close()
        standins.wait(timeout=30)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "workloads"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
