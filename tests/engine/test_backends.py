"""Fidelity of backends lmcache-server and vllm-native against each offered engine pair (the default vLLM 0.33.0 +
LMCache 0.5.6, and 0.26.0 + 0.5.3; their engine venvs of tests/engine/build-venv.sh), the resource pinned to it:
- every rendered vLLM command line through vLLM's own parser, create_engine_config() and its
  KVConnectorFactory (the connector class the workers would build);
- every rendered `lmcache server` command line through LMCache's own server parser and the config
  converters its `server` command runs;
- the rendered server command line started for real (CPU host, loopback ports): its /status shows
  the L1 the Budget asked for and the L2 adapter, read by the exporter's own reader; then LMCache's
  own worker adapter registers with it using the extra config rendered for vLLM (what vLLM's
  LMCacheMPConnector worker does), and the exporter counts the engine and reports offload active.
Skipped without the engine venv, unless KVO_REQUIRE_ENGINE=1 (make test) makes that a failure
(engine_venv.require)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import engine_venv
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.api.fetch import SourceError
from kvoffload.api.quantity import gib
from kvoffload.api.settings import Settings
from kvoffload.controller import pipeline
from kvoffload.engine import images
from kvoffload.exporter.collector import ExporterConfig, TierCollector
from kvoffload.exporter.lmcache_server import fetch_status
from kvoffload.rendering import render
from kvtest.exporter import FakeVllm
from kvtest.specs import LLAMA_CONFIG, spec

ROOT = engine_venv.ROOT
LLAMA = LLAMA_CONFIG
PAIRS = {f"{k.vllm}-{k.lmcache}": (image, k) for image, k in images.serving_images().items()}
# No packet leaves 127.0.0.0/8: LMCache's usage telemetry is off in every engine process started here.
QUIET = {"DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
         "LMCACHE_DISABLE_BANNER": "1"}


CASES = {
    "server": dict(offload__backend="lmcache-server"),
    "server-tp2-nodisk": dict(offload__backend="lmcache-server", offload__disk=None, engine__tensorParallelSize=2),
    "native": dict(offload__backend="vllm-native", offload__disk=None),
    "native-tp2": dict(offload__backend="vllm-native", offload__disk=None, engine__tensorParallelSize=2),
    # spec.routing kv_aware on vllm-native: vLLM's KV events with a replay endpoint, the CPU tier's too.
    "native-kv-aware": dict(offload__backend="vllm-native", offload__disk=None, replicas=2, routing__policy="kv_aware"),
}


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request) -> str:
    return request.param


def desired(patch, pair: str):
    image, k = PAIRS[pair]
    pinned = {"engine__image": image, "engine__vllmVersion": k.vllm, "engine__lmcacheVersion": k.lmcache}
    return pipeline.desired("svc", "team-a", "", spec(**pinned, **patch), Settings())


def containers(d):
    pod = next(c for c in d.children if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"] + pod.get("initContainers", [])}


def server_argv(c: dict, pod_name: str = "svc-0") -> list[str]:
    return [a.replace("$(POD_NAME)", pod_name) for a in render.exec_argv(c)]


@pytest.fixture(scope="module")
def venv(pair) -> Path:
    k = PAIRS[pair][1]
    return engine_venv.require(k.vllm, k.lmcache)


@pytest.fixture(scope="module")
def engine(venv, pair):
    request: dict = {"vllm": [], "server": []}
    for case_id, patch in CASES.items():
        c = containers(desired(patch, pair))
        request["vllm"].append({"id": case_id, "argv": render.vllm_argv(c["vllm"]),
                                "model_config": LLAMA})
        if "lmcache-server" in c:
            request["server"].append({"id": case_id, "argv": server_argv(c["lmcache-server"])})
    out = engine_venv.run(venv, "check", request)
    assert (out["versions"]["vllm"], out["versions"]["lmcache"]) == (PAIRS[pair][1].vllm, PAIRS[pair][1].lmcache)
    return {section: {r["id"]: r for r in out[section]} for section in ("vllm", "server")}


@pytest.mark.parametrize("case_id", [c for c in CASES if c.startswith("server")])
def test_vllm_side_of_server_backend(engine, case_id):
    r = engine["vllm"][case_id]
    assert r["ok"], r
    p = r["parsed"]
    assert p["kv_connector"] == "LMCacheMPConnector" and p["kv_role"] == "kv_both"
    # vLLM prefers the LMCacheMPConnector that LMCache ships (its own is the fallback), on both pairs.
    assert p["connector_class"] == "lmcache.integration.vllm.lmcache_mp_connector.LMCacheMPConnector"
    extra = p["kv_connector_extra_config"]
    assert extra["lmcache.mp.host"] == "tcp://127.0.0.1" and extra["lmcache.mp.mp_transfer_mode"] == "engine_driven"


@pytest.mark.parametrize("case_id", [c for c in CASES if c.startswith("server")])
def test_server_command_line_through_lmcaches_parser(engine, pair, case_id):
    d = desired(CASES[case_id], pair)
    r = engine["server"][case_id]
    assert r["ok"], r
    p = r["parsed"]
    vllm_extra = engine["vllm"][case_id]["parsed"]["kv_connector_extra_config"]
    assert (p["host"], p["port"]) == ("127.0.0.1", vllm_extra["lmcache.mp.port"])  # vLLM dials what the server binds
    assert p["supported_transfer_mode"] == vllm_extra["lmcache.mp.mp_transfer_mode"]
    # On a GPU host LMCache 0.5.3's default lazy L1 disables the /dev/shm transfer and falls back to
    # pickled KV over ZMQ: a 4-GiB cap per message and ~144 MB/s (H200 run, docs/benchmarks.md).
    assert p["l1_use_lazy"] is False and p["shm_name"].startswith("lmcache_l1_pool_")
    assert abs(p["l1_size_bytes"] - d.budget.tier("cpu").bytes) < 1024  # the whole replica's CPU tier, GiB to 6 places
    assert p["eviction_policy"] == "LRU" and p["chunk_size"] == d.spec.offload.chunk_size
    assert (p["http_host"], p["http_port"]) == ("127.0.0.1", 8081)
    if d.spec.offload.disk:
        (l2,) = p["l2_adapters"]
        assert l2["base_path"] == "/kvcache" and abs(l2["max_capacity_gb"] - gib(d.budget.tier("disk").bytes)) < 1e-5
        # An L2 eviction LMCache builds: without one, max_capacity_gb bounds nothing (docs/disk-tier.md).
        (ev,) = p["l2_eviction"]
        assert ev is not None and {k: ev[k] for k in ("eviction_policy", "trigger_watermark", "eviction_ratio")} == {
            "eviction_policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2}, p["l2_eviction"]
    else:
        assert p["l2_adapters"] == []


@pytest.mark.parametrize("case_id", ["native", "native-tp2", "native-kv-aware"])
def test_native_command_line_through_vllms_parser(engine, pair, case_id):
    d = desired(CASES[case_id], pair)
    r = engine["vllm"][case_id]
    assert r["ok"], r
    p = r["parsed"]
    assert p["kv_connector"] == "OffloadingConnector" and p["kv_role"] == "kv_both"
    assert p["connector_class"].endswith(".OffloadingConnector")
    # vLLM turns --kv-offloading-size (GiB over all ranks) into bytes for the whole replica.
    assert abs(p["kv_connector_extra_config"]["cpu_bytes_to_use"] - d.budget.tier("cpu").bytes) < 1024
    assert p["tensor_parallel_size"] == d.spec.engine.tensor_parallel_size
    events = p["kv_events_config"] or {}
    if d.spec.routing is not None:  # kv_aware: vLLM merged the rendered extra config with --kv-offloading-size's
        assert d.spec.routing.policy == "kv_aware"
        assert p["kv_connector_extra_config"]["self_describing_kv_events"] is True
        assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
        assert (events["endpoint"], events["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5558")
    else:
        assert "self_describing_kv_events" not in p["kv_connector_extra_config"]
        assert not events.get("enable_kv_cache_events")


VLLM_PAGE = (ROOT / "tests" / "fixtures" / "vllm-0.26.0-lmcache-0.5.3-h200"
             / "vllm-metrics-with-lmcache.txt").read_text()


def arg_of(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def scrape(collector: TierCollector) -> dict[str, float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return {s.name: s.value for fam in text_string_to_metric_families(generate_latest(registry).decode())
            for s in fam.samples if not s.labels}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rendered_server_starts_and_reports_the_budgeted_tiers(venv, pair, tmp_path):
    """The rendered `lmcache server` line, run for real: only its ports, disk path and size change."""
    d = desired({"offload__backend": "lmcache-server", "offload__cpu__size": "256Mi", "offload__disk__size": "1Gi"},
                pair)
    argv = server_argv(containers(d)["lmcache-server"])
    http_port, zmq_port = free_port(), free_port()
    argv[argv.index("--http-port") + 1] = str(http_port)
    argv[argv.index("--port") + 1] = str(zmq_port)
    i = argv.index("--l2-adapter") + 1
    argv[i] = argv[i].replace('"/kvcache"', json.dumps(str(tmp_path / "kvcache")))
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([str(venv / "bin" / argv[0]), *argv[1:]], env={**os.environ, **QUIET}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url, deadline, snap = f"http://127.0.0.1:{http_port}/status", time.monotonic() + 300, None
        while snap is None:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not answer /status in 300 s"
            try:
                snap = fetch_status(url, 2.0)
            except SourceError:
                time.sleep(2)
        assert snap.healthy and snap.engines == 0 and snap.l1_used_bytes == 0
        assert abs(snap.l1_total_bytes - d.budget.tier("cpu").bytes) < 1024
        status = json.loads(__import__("urllib.request").request.urlopen(url, timeout=5).read())
        (adapter,) = status["storage_manager"]["l2_adapters"]
        assert "fs_native" in json.dumps(adapter).lower() or "native" in json.dumps(adapter).lower(), adapter
        (tmp_path / "status.json").write_text(json.dumps(status, indent=1))

        # vLLM's side, as its LMCacheMPConnector worker does it (LMCache's own adapter, the rendered
        # extra config): once it registers, the exporter counts the engine and proves offloading.
        kv = json.loads(arg_of(containers(d)["vllm"]["args"], "--kv-transfer-config"))
        kv["kv_connector_extra_config"]["lmcache.mp.port"] = zmq_port
        worker = subprocess.Popen([str(venv / "bin" / "python"),
                                   str(ROOT / "tests" / "engine" / "mp_worker_register.py"),
                                   json.dumps(kv), d.spec.model.name], env={**os.environ, **QUIET},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while fetch_status(url, 2.0).engines == 0:
                assert worker.poll() is None, worker.stdout.read()[-3000:]
                assert time.monotonic() < deadline, "no engine registered in 240 s"
                time.sleep(1)
            with FakeVllm(VLLM_PAGE) as vllm:
                got = scrape(TierCollector(ExporterConfig(vllm_metrics_url=vllm.url, backend="lmcache-server",
                                                          server_status_url=url)))
            assert got["kvoffload_lmcache_server_engines"] == 1 and got["kvoffload_offload_active"] == 1
        finally:
            worker.kill()
            worker.wait()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        Path(f"/dev/shm/lmcache_l1_pool_{proc.pid}").unlink(missing_ok=True)  # its L1 segment, if it left it
