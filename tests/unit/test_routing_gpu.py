"""The GPU routing benchmark's parts that need no GPU (benchmarks/gpu/routing_gpu.py, issue 33): its resource is the
routing example's but for what two replicas on one H200 need, each policy's router arguments are the operator's with
only the listed changes, the engines are localized onto their own addresses, and the driver runs every policy and
workload through the real router in front of two stand-in engines."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import yaml

from kvtest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import routing_gpu  # noqa: E402

from kvoffload.engine import router as engine_router  # noqa: E402

BENCH_SPEC = ROOT / "benchmarks" / "gpu" / "routing-qwen25-7b.yaml"
EXAMPLE = ROOT / "examples" / "routing" / "native-qwen25-7b.yaml"


@pytest.fixture(scope="module")
def rendered() -> dict:
    return routing_gpu.render(str(BENCH_SPEC))


def test_the_bench_resource_is_the_routing_example_with_two_replicas_and_a_cpu_tier_that_pins_its_size():
    bench, example = yaml.safe_load(BENCH_SPEC.read_text()), yaml.safe_load(EXAMPLE.read_text())
    want = copy.deepcopy(example)
    want["spec"]["replicas"] = 2
    want["spec"]["offload"]["cpu"]["size"] = "14Gi"
    assert bench == want


def test_each_policy_is_the_operators_rendering_and_kv_aware_constants_drops_only_the_credits(rendered):
    pols = rendered["policies"]
    assert set(pols) == set(routing_gpu.POLICIES)
    for name, p in pols.items():
        args = p["router_args"]
        assert args[args.index("--policy") + 1] == name.removesuffix("_constants")
    kv, const = pols["kv_aware"]["router_args"], pols["kv_aware_constants"]["router_args"]
    credits = {flag: float(kv[kv.index(flag) + 1]) for flag in routing_gpu.PENALTY_FLAGS}
    assert credits == {"--kv-penalty-host": rendered["credits"]["cpu"], "--kv-penalty-disk": 0.0,
                       "--kv-penalty-external": 0.0}
    assert rendered["credits"]["cpu"] != engine_router.DEFAULT_CREDITS["cpu"]  # else the two runs would be one
    assert const == routing_gpu.drop_flags(kv, routing_gpu.PENALTY_FLAGS)
    assert not set(routing_gpu.PENALTY_FLAGS) & set(const)
    # The engines run kv_aware's arguments for every policy: the other renderings differ only in the event flags.
    for policy, diff in rendered["engine_differences"].items():
        assert all(d in ("--kv-events-config", "--kv-transfer-config") or d.startswith("{") for d in diff), (policy,
                                                                                                          diff)


def test_the_router_runs_as_rendered_but_for_discovery_and_its_ports(rendered):
    for policy in routing_gpu.POLICIES:
        src = rendered["policies"][policy]["router_args"]
        args, changes = routing_gpu.router_argv(src, "127.0.0.1", 18000, 29001)
        assert "--service-discovery" not in args and "$(POD_IP)" not in " ".join(args)
        urls = args[args.index("--worker-urls") + 1: args.index("--worker-urls") + 3]
        assert urls == [f"http://{ip}:8000" for ip in routing_gpu.IPS]
        start = src.index("--service-discovery")
        kept = [a.replace("$(POD_IP)", "127.0.0.1") for a in src[:start] + src[src.index("--policy"):]]
        assert args[args.index("--port") + 1] == "18000" and args[args.index("--prometheus-port") + 1] == "29001"
        if "--worker-urls" in src:  # kv_aware: its static workers as rendered, the second replica's sources moved
            moved = {"=tcp://127.0.0.3:5557": "=tcp://127.0.0.3:5567", "=tcp://127.0.0.3:5558": "=tcp://127.0.0.3:5568"}
            want = [next((a.replace(o, n) for o, n in moved.items() if a.endswith(o)), a) for a in kept]
            for flag, value in (("--port", "18000"), ("--prometheus-port", "29001")):
                want[want.index(flag) + 1] = value
            assert args == want
            assert "http://127.0.0.2:8000=tcp://127.0.0.2:5557" in args  # the first replica keeps the rendered ports
            assert "http://127.0.0.3:8000=tcp://127.0.0.3:5567" in args
        else:
            assert any("--worker-urls" in c for c in changes)


def test_each_engine_binds_its_publisher_on_its_own_ports():
    """vLLM binds a KV-event publisher only on a wildcard endpoint (else it connects): the second replica on the host
    moves to other wildcard ports, which the router is then given (event_ports)."""
    cfg = {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}
    argv = ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "/m", "--host", "127.0.0.1", "--port", "18001",
            "--kv-events-config", json.dumps(cfg)]
    first, changes = routing_gpu.engine_argv(argv, "127.0.0.2", 0)
    assert json.loads(first[first.index("--kv-events-config") + 1]) == cfg and len(changes) == 2
    out, changes = routing_gpu.engine_argv(argv, "127.0.0.3", 1)
    assert out[out.index("--host") + 1] == "127.0.0.3" and out[out.index("--port") + 1] == "8000"
    got = json.loads(out[out.index("--kv-events-config") + 1])
    assert (got["endpoint"], got["replay_endpoint"]) == ("tcp://*:5567", "tcp://*:5568")
    assert len(changes) == 4


def test_every_document_is_sent_once_per_round_in_a_shuffled_order():
    order = routing_gpu.schedule(5, 3, "s")
    assert [sorted(d for r, d in order if r == k) for k in range(3)] == [list(range(5))] * 3
    assert order == routing_gpu.schedule(5, 3, "s") and order != routing_gpu.schedule(5, 3, "t")


def test_the_driver_runs_every_policy_through_the_real_router_before_two_stand_ins(rendered, vllm_router, tmp_path):
    """The flow the GPU host runs, with the slim stand-in engine (recorded metrics: the counters do not move) and
    the real router: each policy's router starts from its rendered arguments, every workload's requests are
    answered through it, and the router's overhead is measured."""
    spec = tmp_path / "routing.json"
    spec.write_text(json.dumps(rendered))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (
        ROOT / "operator", ROOT / "tests" / "fixtures" / "fake_vllm", ROOT / "tests" / "support")),
        "KVO_STANDIN_RECORDED": str(ROOT / "tests" / "fixtures")}
    router_python = vllm_router.parent / "python"
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "routing_gpu.py"), "run", "--rendered",
                        str(spec), "--out", str(out), "--work", str(tmp_path / "work"), "--engine-python",
                        sys.executable, "--no-image-env", "--router-python", str(router_python), "--passes", "1",
                        "--settle-s", "0.5", "--overflow-docs", "3", "--doc-tokens", "64", "--shared-tokens", "32",
                        "--fit-docs", "2", "--fit-tokens", "32", "--overhead-requests", "3", "--start-timeout", "60",
                        "--engine-arg", "--gpu-memory-utilization 0.4"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    (ps,) = res["passes"]
    assert ps["order"] == list(routing_gpu.POLICIES)
    for policy in routing_gpu.POLICIES:
        entry = ps["policies"][policy]
        assert entry["overflow"]["requests"] == 3 * 3 and entry["overflow_shared"]["requests"] == 3 * 3
        assert entry["fitting"]["requests"] == 2 * 4
    assert ps["policies"]["kv_aware"]["overhead"]["routed"]["n"] == 3
    assert any("--kv-events-config endpoint" in c for c in res["engines"][1]["changes"])
    for e in res["engines"]:
        assert "vLLM arguments added: --gpu-memory-utilization 0.4" in e["changes"]
