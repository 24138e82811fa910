"""Routing on real engines (issue 33): two replicas of a rendered KVOffloadServe as vLLM processes on one GPU, vLLM's
router (vllm-router 0.1.17, the PyPI wheel the router image holds) in front of them with the arguments the operator
renders for each policy, and shared-prefix workloads: documents that overflow each replica's GPU tier into its CPU
tier (`overflow`), the same behind a long prefix every request shares (`overflow_shared`: a system prompt), documents
that fit its GPU tier (`fitting`); and the same short requests sent direct and through the router.

    here (the operator's venv):
        python benchmarks/gpu/routing_gpu.py render --spec benchmarks/gpu/routing-qwen25-7b.yaml --out routing.json
    on the GPU host (dev.sh plan-routing):
        python3 routing_gpu.py run --rendered routing.json --out DIR --router-site DIR [--budget-s S]

`render` runs the operator's pipeline (controller.pipeline.desired) with the two replicas Ready at 127.0.0.2 and
127.0.0.3, once per policy: round_robin, cache_aware (what `auto` resolves to), kv_aware. A fourth policy, kv_aware
with the router's own credits, is the kv_aware rendering without its --kv-penalty-* flags.

`run` starts both engines from the kv_aware rendering (gpu_manifests.localize, each change listed), then per policy
the router, its arguments as rendered with only these changes: $(POD_IP) -> 127.0.0.1 and the discovery flags dropped
(no API server here; kv_aware's router is started with its static workers, as in the cluster). The engines are the
same processes for every policy (their KV-event flags are kv_aware's; the other policies' renderings differ from it
only there, which `render` checks); each policy gets documents no earlier one sent, and both GPU prefix caches are
reset before it. Each engine's own counters (vllm:prompt_tokens_by_source_total) give the tokens recomputed and the
hits per tier (GPU: local_cache_hit, CPU: external_kv_transfer). Every request is max_tokens 1: its latency is its
time to first token, queueing included. Everything binds to loopback addresses; every wait has a deadline.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kvoffload.engine import router as engine_router  # noqa: E402  (PYTHONPATH=operator here and on the GPU host)

IPS = ("127.0.0.2", "127.0.0.3")  # the two replicas' pod IPs: one address each, the rendered ports on both
ROUTER = ("127.0.0.1", 8000)
POLICIES = ("round_robin", "cache_aware", "kv_aware_constants", "kv_aware")
PENALTY_FLAGS = ("--kv-penalty-host", "--kv-penalty-disk", "--kv-penalty-external")
HTTP_PORT = 8000  # the rendered vLLM port (backends.base.HTTP_PORT), on each replica's own address


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- render (here, with the operator's dependencies)

def render(spec_path: str) -> dict[str, Any]:
    """Each policy's rendering of the spec with both replicas Ready: the router's arguments, the engine container,
    and the kv_aware rendering's manifests (the engines' source)."""
    import yaml

    from kvoffload.api.settings import Settings
    from kvoffload.controller import pipeline
    from kvoffload.planning import routing as plan_routing

    doc = yaml.safe_load(Path(spec_path).read_text())
    name, ns = doc["metadata"]["name"], doc["metadata"]["namespace"]
    out: dict[str, Any] = {"spec": spec_path, "ips": list(IPS), "policies": {}}
    engines: dict[str, list[str]] = {}
    for policy in ("round_robin", "cache_aware", "kv_aware"):
        body = copy.deepcopy(doc["spec"])
        body["routing"] = {**(body.get("routing") or {}), "policy": policy}
        d = pipeline.desired(name, ns, "uid-routing-bench", body, Settings(), IPS)
        kinds = {c["kind"]: c for c in d.children}
        router = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
        vllm = {c["name"]: c for c in kinds["StatefulSet"]["spec"]["template"]["spec"]["containers"]}["vllm"]
        resolved = router["args"][router["args"].index("--policy") + 1]
        out["policies"][resolved] = {"router_args": router["args"], "router_command": router["command"]}
        engines[resolved] = vllm["args"]
        if resolved == "kv_aware":
            out["manifests"] = yaml.safe_dump_all(d.children, sort_keys=False)
            out["credits"] = plan_routing.credits(d.budget)
            out["tiers"] = {t.name: t.tokens for t in d.budget.tiers}
    if set(out["policies"]) != {"round_robin", "cache_aware", "kv_aware"}:
        raise SystemExit(f"render: policies {sorted(out['policies'])}")
    kv = out["policies"]["kv_aware"]["router_args"]
    out["policies"]["kv_aware_constants"] = {"router_args": drop_flags(kv, PENALTY_FLAGS),
                                             "router_command": out["policies"]["kv_aware"]["router_command"]}
    # The engines run kv_aware's arguments for every policy: say exactly where the other renderings differ.
    out["engine_differences"] = {p: sorted(set(engines["kv_aware"]) ^ set(a)) for p, a in engines.items()}
    return out


def drop_flags(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """`args` without each of `flags` and its value."""
    out, i = [], 0
    while i < len(args):
        if args[i] in flags:
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


# ---------------------------------------------------------------- the pieces `run` localizes (pure)

def event_ports(index: int) -> tuple[int, int]:
    """Replica `index`'s KV-event publisher and replay ports on this host. vLLM binds a publisher only on a wildcard
    endpoint (tcp://*:PORT; to any other it connects: vllm/distributed/kv_events.py), so two replicas on one host
    cannot share the rendered ports: the second moves 10 up."""
    return engine_router.KV_EVENTS_PORT + 10 * index, engine_router.KV_EVENTS_REPLAY_PORT + 10 * index


def router_argv(rendered: list[str], host: str, port: int, metrics_port: int) -> tuple[list[str], list[str]]:
    """The rendered router arguments as run here, and the changes: $(POD_IP) -> host, the Kubernetes discovery flags
    dropped (from --service-discovery up to --policy), and where the rendering has no static workers (every policy but
    kv_aware), the replicas discovery would find given as --worker-urls; each replica's event sources on its ports
    (event_ports); the router's ports."""
    args = [a.replace("$(POD_IP)", host) for a in rendered]
    changes = [f"$(POD_IP) -> {host}"]
    if "--service-discovery" in args:
        start, end = args.index("--service-discovery"), args.index("--policy")
        changes.append(f"dropped (no API server): {' '.join(args[start:end])}")
        args = args[:start] + args[end:]
        if "--worker-urls" not in args:
            urls = [f"http://{ip}:{HTTP_PORT}" for ip in IPS]
            args[start:start] = ["--worker-urls", *urls]
            changes.append(f"--worker-urls {' '.join(urls)}: the Ready replicas its discovery would find")
    for i, ip in enumerate(IPS):
        for rendered_port, moved in zip((engine_router.KV_EVENTS_PORT, engine_router.KV_EVENTS_REPLAY_PORT),
                                        event_ports(i), strict=True):
            old, new = f"tcp://{ip}:{rendered_port}", f"tcp://{ip}:{moved}"
            if old != new and any(a.endswith("=" + old) for a in args):
                args = [a[: -len(old)] + new if a.endswith("=" + old) else a for a in args]
                changes.append(f"event source {old} -> {new}")
    for flag, value in (("--port", port), ("--prometheus-port", metrics_port)):
        i = args.index(flag) + 1
        if args[i] != str(value):
            changes.append(f"{flag} {args[i]} -> {value}")
            args[i] = str(value)
    return args, changes


def engine_argv(argv: list[str], ip: str, index: int) -> tuple[list[str], list[str]]:
    """A localized engine argv on its own address: --host `ip`, --port the rendered one, and the KV-event endpoints
    on the replica's ports (event_ports), still wildcards: vLLM connects to any other endpoint instead of binding."""
    out, changes = list(argv), []
    i = out.index("--host") + 1
    changes.append(f"--host {out[i]} -> {ip}")
    out[i] = ip
    i = out.index("--port") + 1
    if out[i] != str(HTTP_PORT):
        changes.append(f"--port {out[i]} -> {HTTP_PORT}")
        out[i] = str(HTTP_PORT)
    if "--kv-events-config" in out:
        i = out.index("--kv-events-config") + 1
        cfg = json.loads(out[i])
        for key, port in zip(("endpoint", "replay_endpoint"), event_ports(index), strict=True):
            if cfg.get(key) != f"tcp://*:{port}":
                changes.append(f"--kv-events-config {key} {cfg.get(key)} -> tcp://*:{port}")
                cfg[key] = f"tcp://*:{port}"
        out[i] = json.dumps(cfg, separators=(",", ":"))
    return out, changes


def documents(seed: str, n: int, tokens: int, vocab: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(100, vocab - 100) for _ in range(tokens)] for _ in range(n)]


def schedule(docs: int, rounds: int, seed: str) -> list[tuple[int, int]]:
    """(round, document) in the order sent: every document once per round, each round shuffled."""
    rnd = random.Random(seed)
    out = []
    for r in range(rounds):
        order = list(range(docs))
        rnd.shuffle(order)
        out += [(r, d) for d in order]
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary(lat: list[float]) -> dict[str, float]:
    return {"n": len(lat), "mean_s": round(statistics.fmean(lat), 5), "p50_s": round(pct(lat, 0.5), 5),
            "p95_s": round(pct(lat, 0.95), 5)}


# ---------------------------------------------------------------- run (the GPU host)

def http_req(host: str, port: int, method: str, path: str, body: Any = None, timeout: float = 10) -> tuple[int, str]:
    import gpu_bench
    return gpu_bench.http_req(port, method, path, body, timeout, host=host)


def wait_ok(host: str, port: int, path: str, deadline_s: float, proc: subprocess.Popen, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before {path} answered")
        try:
            if http_req(host, port, "GET", path, timeout=5)[0] == 200:
                return round(time.monotonic() - t0, 1)
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what}: no 200 from {path} within {deadline_s:.0f} s")


class Replica:
    def __init__(self, ip: str, argv: list[str], env: dict[str, str], logfile: Path) -> None:
        self.ip, self.argv, self.env, self.logfile = ip, argv, env, logfile
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        import gpu_bench
        self.proc = gpu_bench.spawn(self.argv, self.env, self.logfile)

    def counters(self) -> dict[str, float]:
        import gpu_bench
        import gpu_counters
        status, text = http_req(self.ip, HTTP_PORT, "GET", "/metrics", timeout=20)
        if status != 200:
            raise RuntimeError(f"{self.ip} /metrics: HTTP {status}")
        page = gpu_counters.Page(text)
        out = gpu_bench.sources(page)
        out["requests"] = page.sum("vllm:request_success_total") or 0.0
        return out

    def reset(self, deadline_s: float = 120) -> int:
        import gpu_bench
        t0, attempts = time.monotonic(), 0
        while True:
            attempts += 1
            status, body = http_req(self.ip, HTTP_PORT, "POST", "/reset_prefix_cache", timeout=60)
            if status == 200 and gpu_bench.reset_succeeded(body):
                return attempts
            if time.monotonic() - t0 > deadline_s:
                raise RuntimeError(f"{self.ip} /reset_prefix_cache: {status} {body[:200]}")
            time.sleep(0.2)


def complete(host: str, port: int, model: str, ids: list[int], timeout: float) -> float:
    t0 = time.perf_counter()
    status, body = http_req(host, port, "POST", "/v1/completions",
                            {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}, timeout=timeout)
    if status != 200:
        raise RuntimeError(f"completion via {host}:{port}: HTTP {status}: {body[:300]}")
    return time.perf_counter() - t0


def phase(replicas: list[Replica], model: str, docs: list[list[int]], order: list[tuple[int, int]], suffix: int,
          concurrency: int, seed: str, timeout: float) -> dict[str, Any]:
    """The requests of `order` through the router, `concurrency` in flight: document + a fresh suffix each."""
    rnd = random.Random(seed)
    prompts = [(r, docs[d] + [rnd.randrange(100, 30000) for _ in range(suffix)]) for r, d in order]
    before = [x.counters() for x in replicas]
    t0 = time.perf_counter()

    def one(item: tuple[int, list[int]]) -> tuple[int, float]:
        return item[0], complete(*ROUTER, model, item[1], timeout)

    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    time.sleep(0.5)  # the engines publish a request's stats after answering it
    after = [x.counters() for x in replicas]
    per = [{k: round(a[k] - b[k]) for k in a} for a, b in zip(after, before, strict=True)]
    lat = [s for _r, s in rows]
    rounds = sorted({r for r, _s in rows})
    return {"requests": len(rows), "concurrency": concurrency, "wall_s": round(wall, 3), **summary(lat),
            "by_round": {str(r): summary([s for rr, s in rows if rr == r]) for r in rounds},
            "recomputed_tokens": sum(p["local_compute"] for p in per),
            "gpu_hit_tokens": sum(p["local_cache_hit"] for p in per),
            "cpu_hit_tokens": sum(p["external_kv_transfer"] for p in per),
            "per_replica": per, "latencies_s": [round(s, 5) for s in lat]}


def overhead(replica: Replica, model: str, doc: list[int], n: int, timeout: float) -> dict[str, Any]:
    """The same request (a prefix every replica already holds: a GPU hit) alternately direct to `replica` and through
    the router: the difference of the medians is what the router adds."""
    direct, routed = [], []
    for _ in range(3):  # warm: the prefix in every replica the router may pick
        complete(replica.ip, HTTP_PORT, model, doc, timeout)
        complete(*ROUTER, model, doc, timeout)
    for _ in range(n):
        direct.append(complete(replica.ip, HTTP_PORT, model, doc, timeout))
        routed.append(complete(*ROUTER, model, doc, timeout))
    return {"tokens": len(doc), "direct": summary(direct), "routed": summary(routed),
            "added_p50_ms": round(1000 * (pct(routed, 0.5) - pct(direct, 0.5)), 3),
            "added_mean_ms": round(1000 * (statistics.fmean(routed) - statistics.fmean(direct)), 3),
            "direct_s": [round(s, 5) for s in direct], "routed_s": [round(s, 5) for s in routed]}


def start_router(policy: str, rendered: dict[str, Any], args: argparse.Namespace, out_dir: Path, tag: str
                 ) -> tuple[subprocess.Popen, list[str]]:
    import gpu_bench
    argv, changes = router_argv(rendered["policies"][policy]["router_args"], ROUTER[0], ROUTER[1], args.router_metrics)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (args.router_site, env.get("PYTHONPATH", "")) if p)
    # The console script `vllm-router` of the wheel (entry point vllm_router.launch_router:main).
    cmd = [args.router_python, "-c", "import sys; from vllm_router.launch_router import main; sys.exit(main())",
           *argv, "--log-level", "debug"]
    proc = gpu_bench.spawn(cmd, env, out_dir / "logs" / f"router-{tag}.log")
    wait_ok(*ROUTER, "/readiness", 120, proc, f"router {tag}")
    return proc, changes


def run(args: argparse.Namespace) -> int:
    import gpu_bench
    import gpu_manifests
    import gpu_pod

    # Absolute: the engines' environment puts the serving image's PATH first (gpu_pod.image_env).
    args.engine_python = shutil.which(args.engine_python) or args.engine_python
    args.router_python = shutil.which(args.router_python) or args.router_python
    rendered = json.loads(Path(args.rendered).read_text())
    out_dir = Path(args.out)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - t_start) if args.budget_s else 1e9  # noqa: E731
    res: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args),
                           "rendered": {k: v for k, v in rendered.items() if k != "manifests"}, "passes": []}

    def save() -> None:
        (out_dir / "results.json").write_text(json.dumps(res, indent=1, sort_keys=True))

    import atexit
    import signal
    signal.signal(signal.SIGTERM, gpu_bench._on_signal)
    atexit.register(gpu_bench._kill_all)

    r = gpu_manifests.parse_rendered(rendered["manifests"])
    cfg = gpu_bench.catalog_config(gpu_manifests.flag(gpu_manifests.exec_argv(r.vllm)[0], "--served-model-name")
                                   or gpu_manifests.exec_argv(r.vllm)[0][2])
    vocab = int(cfg.get("vocab_size", 32000))
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    replicas: list[Replica] = []
    extra = [w for a in args.engine_arg for w in a.split()]
    for i, ip in enumerate(IPS):
        # Distinct layout ports: the TMPDIR of each replica is /tmp/kvb-<port> (its ZMQ ipc sockets).
        layout = gpu_manifests.Layout(root=str(work / f"replica-{i}"), model_dir=str(work / "model"),
                                      disk_dir=str(work / f"disk-{i}"), port=18000 + i, exporter_port=19400 + i,
                                      python=args.engine_python)
        lr = gpu_manifests.localize(r, layout, connector=True, model_config=cfg, extra_args=extra)
        argv, changes = engine_argv(lr.engine_argv, ip, i)
        home0 = str(work / "replica-0" / "volumes")
        env = {k: v.replace(f"{layout.root}/volumes/home", f"{home0}/home") for k, v in lr.engine_env.items()}
        if i:
            changes.append("HOME (vLLM's compile cache) shared with replica 0: start-up time only")
        for d in lr.fresh_dirs:
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d, exist_ok=True)
        os.makedirs(f"{home0}/home", exist_ok=True)
        for path, text in lr.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        img = gpu_pod.image_env(r.vllm.image, args.engine_python) if args.image_env else {}
        replicas.append(Replica(ip, argv, {**os.environ, **gpu_bench.BASE_ENV, **img, **env},
                                out_dir / "logs" / f"engine-{i}.log"))
        res.setdefault("engines", []).append({"ip": ip, "argv": argv, "env": env, "changes": lr.changes + changes})
    model = gpu_manifests.flag(replicas[0].argv, "--served-model-name") or str(work / "model")
    save()
    try:
        # One at a time: the second engine's memory check at start-up sees the first's allocation settled.
        for i, rep in enumerate(replicas):
            rep.start()
            assert rep.proc is not None
            res["engines"][i]["start_s"] = wait_ok(rep.ip, HTTP_PORT, "/health", args.start_timeout, rep.proc,
                                                   f"engine {rep.ip}")
            log(f"engine {rep.ip} healthy after {res['engines'][i]['start_s']} s")
        save()
        # name: (documents, tokens each, rounds, tokens of a prefix every request shares before its document)
        work_sets = {"overflow": (args.overflow_docs, args.doc_tokens, args.overflow_rounds, 0),
                     "overflow_shared": (args.overflow_docs, args.doc_tokens - args.shared_tokens, args.overflow_rounds,
                                         args.shared_tokens),
                     "fitting": (args.fit_docs, args.fit_tokens, args.fit_rounds, 0)}
        for p in range(args.passes):
            order = POLICIES if p % 2 == 0 else tuple(reversed(POLICIES))
            ps: dict[str, Any] = {"order": list(order), "policies": {}}
            res["passes"].append(ps)
            for policy in order:
                if left() < args.policy_estimate_s:
                    log(f"pass {p} {policy}: skipped, {left():.0f} s of --budget-s left")
                    ps["policies"][policy] = {"skipped": True}
                    continue
                for rep in replicas:
                    rep.reset()
                proc, changes = start_router(policy, rendered, args, out_dir, f"{p}-{policy}")
                entry: dict[str, Any] = {"router_changes": changes}
                try:
                    time.sleep(args.settle_s)  # kv_aware: the router's subscriptions and replay settle
                    for ws, (n, tokens, rounds, shared) in work_sets.items():
                        head = documents(f"{ws}-shared-{p}-{policy}", 1, shared, vocab)[0]
                        docs = [head + d for d in documents(f"{ws}-{p}-{policy}", n, tokens, vocab)]
                        entry[ws] = phase(replicas, model, docs, schedule(n, rounds, f"{ws}-{p}-{policy}"),
                                          args.suffix_tokens, args.concurrency, f"suffix-{ws}-{p}-{policy}",
                                          args.request_timeout)
                        log(f"pass {p} {policy} {ws}: mean {entry[ws]['mean_s']:.3f} s p50 {entry[ws]['p50_s']:.3f}"
                            f" p95 {entry[ws]['p95_s']:.3f}; recomputed {entry[ws]['recomputed_tokens']}, GPU hits "
                            f"{entry[ws]['gpu_hit_tokens']}, CPU hits {entry[ws]['cpu_hit_tokens']}; per replica "
                            f"{[x['requests'] for x in entry[ws]['per_replica']]} requests")
                    if policy == "kv_aware" and p == 0:
                        doc = documents(f"overhead-{p}", 1, args.overhead_tokens, vocab)[0]
                        entry["overhead"] = overhead(replicas[0], model, doc, args.overhead_requests,
                                                     args.request_timeout)
                        log(f"router overhead: +{entry['overhead']['added_p50_ms']} ms p50")
                finally:
                    gpu_bench.stop(proc, grace=10)
                ps["policies"][policy] = entry
                save()
    finally:
        for rep in replicas:
            if rep.proc is not None:
                gpu_bench.stop(rep.proc, grace=30)
        res["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        save()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("--spec", required=True)
    r.add_argument("--out", required=True)
    g = sub.add_parser("run")
    g.add_argument("--rendered", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--work", default="/var/tmp/kvroute")
    g.add_argument("--engine-python", default="python3")
    g.add_argument("--no-image-env", dest="image_env", action="store_false",
                   help="engines without the serving image's environment (gpu_pod.image_env)")
    g.add_argument("--router-python", default="python3")
    g.add_argument("--router-site", default="", help="the router wheel's site (PYTHONPATH)")
    g.add_argument("--router-metrics", type=int, default=29000)
    g.add_argument("--engine-arg", action="append", default=[],
                   help="vLLM arguments added to the rendered ones (split on spaces; listed as changes)")
    g.add_argument("--start-timeout", type=float, default=420)
    g.add_argument("--request-timeout", type=float, default=300)
    g.add_argument("--budget-s", type=float, default=0, help="start no policy later than this minus its estimate")
    g.add_argument("--policy-estimate-s", type=float, default=60)
    g.add_argument("--passes", type=int, default=2)
    g.add_argument("--settle-s", type=float, default=3)
    g.add_argument("--concurrency", type=int, default=8)
    g.add_argument("--doc-tokens", type=int, default=8192)
    g.add_argument("--suffix-tokens", type=int, default=32)
    g.add_argument("--overflow-docs", type=int, default=44)
    g.add_argument("--overflow-rounds", type=int, default=3)
    g.add_argument("--shared-tokens", type=int, default=4096,
                   help="overflow_shared: a prefix every request shares (a long system prompt), then its document")
    g.add_argument("--fit-docs", type=int, default=12)
    g.add_argument("--fit-tokens", type=int, default=4096)
    g.add_argument("--fit-rounds", type=int, default=4)
    g.add_argument("--overhead-tokens", type=int, default=1024)
    g.add_argument("--overhead-requests", type=int, default=60)
    args = ap.parse_args(argv)
    if args.cmd == "render":
        Path(args.out).write_text(json.dumps(render(args.spec), indent=1))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
