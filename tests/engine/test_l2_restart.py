"""What LMCache's own fs_native L2 does with the files an earlier server wrote (issue 35; docs/disk-tier.md): built from
the --l2-adapter JSON the operator renders for backend lmcache-server, in the engine venv of each pair the operator
offers (its C++ FS connector, on this CPU host). A second adapter over the same directory, as a restarted server
is, finds the chunk by its file name and loads its bytes, but counts none of it: the reason the disk-tier init
step keeps such files only up to a share of the budget. And the whole path, with the rendered `lmcache server` line
and vLLM's side as LMCache's own LMCacheMPConnector adapters do it: what a killed server stored, its successor over the
kept directory serves to a new vLLM process.

Skipped without the engine venv, unless KVO_REQUIRE_ENGINE=1 (make test) makes that a failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import engine_venv
import pytest

from kvoffload.api.fetch import SourceError
from kvoffload.api.settings import Settings
from kvoffload.backends import lmcache_server
from kvoffload.controller import pipeline
from kvoffload.engine import images
from kvoffload.exporter.lmcache_server import fetch_status
from kvoffload.rendering import render
from kvtest.fidelity import for_image
from kvtest.procs import free_ports
from kvtest.specs import spec

SCRIPT = engine_venv.HERE / "l2_restart_check.py"
RELOAD = engine_venv.HERE / "l2_reload_check.py"
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


def rendered_adapter() -> dict:
    d = pipeline.desired("svc", "ns", "uid-1", spec(offload__backend="lmcache-server", offload__disk__size="1Gi"),
                         Settings())
    sts = next(c for c in d.children if c["kind"] == "StatefulSet")
    (server,) = [c for c in sts["spec"]["template"]["spec"]["initContainers"] if c["name"] == "lmcache-server"]
    return json.loads(server["args"][server["args"].index("--l2-adapter") + 1])


def run(venv, adapter: dict, base, phase: str) -> dict:
    cp = subprocess.run([engine_venv.python(venv), str(SCRIPT), json.dumps(adapter), str(base), phase],
                        capture_output=True, text=True, timeout=300,
                        env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"})
    assert cp.returncode == 0, cp.stderr[-3000:]
    return json.loads(cp.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pair", engine_venv.PAIRS, ids=lambda p: f"{p.vllm}-{p.lmcache}")
def test_a_restarted_servers_fs_native_l2_reads_the_kept_chunk_but_does_not_count_it(pair, tmp_path):
    venv = engine_venv.require(pair.vllm, pair.lmcache)
    adapter = rendered_adapter()
    assert adapter["type"] == "fs_native" and adapter["eviction"]["eviction_policy"] == "LRU"
    base = tmp_path / "kvcache"
    base.mkdir()
    stored = run(venv, adapter, base, "store")
    assert stored["stored"] and stored["usage_bytes"] > 0, stored  # what it stored itself, it counts
    (chunk,) = stored["files"]
    assert chunk.endswith(".data") and chunk.startswith("meta-llama-SEP-Llama-3.1-8B-Instruct@"), chunk
    again = run(venv, adapter, base, "reload")  # a new process: as after a server restart
    assert (again["found"], again["loaded"], again["bytes_match"]) == (1, 1, True), again
    assert again["usage_bytes"] == 0, again  # read, but never counted: it would never be evicted either
    assert again["files"] == [chunk]


def start_server(venv, argv: list[str], log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([str(venv / "bin" / argv[0]), *argv[1:]], env={**os.environ, **QUIET},
                            stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)
    port = int(argv[argv.index("--port") + 1])
    deadline = time.monotonic() + 300
    while True:  # vLLM's connector asks the chunk size over ZMQ: the port must be bound
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the server did not listen in 300 s"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(1)


def registered(http_port: int) -> bool:
    try:
        return fetch_status(f"http://127.0.0.1:{http_port}/status", 5.0).engines > 0
    except SourceError:
        return False


def vllm_side(venv, kv: dict, model: str, tokens: int, phase: str) -> dict:
    cp = subprocess.run([engine_venv.python(venv), str(RELOAD), json.dumps(kv), model, str(tokens), phase],
                        capture_output=True, text=True, timeout=300, env={**os.environ, **QUIET})
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-3000:]
    return json.loads(cp.stdout.strip().splitlines()[-1])


def rendered_server(pair, tmp_path: Path) -> tuple[list[str], dict, int, Path, str]:
    """The pair's rendered `lmcache server` line and vLLM connector config, with PerNode's mq_timeout: Sidecar's
    rendering, which differs from PerNode's only in the address it listens on (and PerNode is refused on a pair
    whose connector cannot recover: engine/images.SHARED_SERVER_MIN_LMCACHE). Its ports, L2 directory and
    shared-memory name are this test's."""
    image = next(i for i, p in images.serving_images().items() if p == pair)
    s = for_image(spec(offload__backend="lmcache-server", offload__cpu__size="256Mi", offload__disk__size="1Gi"),
                  image)
    pod = next(c for c in pipeline.desired("svc", "ns", "uid-1", s, Settings()).children
               if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"] + pod["initContainers"]}
    argv = [a.replace("$(POD_NAME)", "svc-0") for a in render.exec_argv(containers["lmcache-server"])]
    (zmq_port, http), base = free_ports(2), tmp_path / "kvcache"
    base.mkdir()
    shm = f"lmcache_l1_pool_kvtest{os.getpid()}"
    for flag, value in (("--port", str(zmq_port)), ("--http-port", str(http)), ("--shm-name", shm)):
        argv[argv.index(flag) + 1] = value
    i = argv.index("--l2-adapter") + 1
    argv[i] = argv[i].replace('"/kvcache"', json.dumps(str(base)))
    args = containers["vllm"]["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    kv["kv_connector_extra_config"].update({"lmcache.mp.port": zmq_port,
                                            "lmcache.mp.mq_timeout": lmcache_server.SHARED_MQ_TIMEOUT_S})
    return argv, kv, http, base, shm


def wait_l2(base: Path, chunks: int) -> None:
    deadline = time.monotonic() + 60
    while len(list(base.rglob("*.data"))) < chunks:
        assert time.monotonic() < deadline, f"the L2 holds {sorted(base.rglob('*'))}"
        time.sleep(0.5)


@pytest.mark.parametrize("pair", engine_venv.PAIRS, ids=lambda p: f"{p.vllm}-{p.lmcache}")
def test_what_a_killed_server_stored_its_successor_serves_to_a_new_vllm_from_the_kept_l2(pair, tmp_path):
    """A store through vLLM's side (LMCache's own adapters), the server SIGKILLed once its L2 holds every chunk, a new
    server over the same directory (its L1 empty), and a new vLLM process (a replica started after the restart):
    every chunk is found in the L2 and loads the stored bytes."""
    venv = engine_venv.require(pair.vllm, pair.lmcache)
    argv, kv, _, base, shm = rendered_server(pair, tmp_path)
    tokens, model, log = 1024, "meta-llama/Llama-3.1-8B-Instruct", tmp_path / "server.log"
    server = start_server(venv, argv, log)
    try:
        stored = vllm_side(venv, kv, model, tokens, "store")
        assert stored["stored"] and stored["found_before"] == 0, stored
        wait_l2(base, tokens // 256)
        os.killpg(server.pid, signal.SIGKILL)  # a crash: no clean-up of its own
        server.wait()
        Path("/dev/shm", shm).unlink(missing_ok=True)  # what the rendered prelude does before the next server
        server = start_server(venv, argv, log)
        got = vllm_side(venv, kv, model, tokens, "lookup")
        assert got == {"phase": "lookup", "found_tokens": tokens, "loaded": True}, (got, log.read_text()[-4000:])
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        Path("/dev/shm", shm).unlink(missing_ok=True)


@pytest.mark.parametrize("pair", engine_venv.PAIRS, ids=lambda p: f"{p.vllm}-{p.lmcache}")
def test_a_running_vllm_looks_the_kept_l2_up_after_an_outage_only_where_pernode_is_offered(pair, tmp_path):
    """The same with the vLLM that stored: a request during the outage (its lookup times out), the server back over
    the kept L2, the connector's heartbeat registering again. LMCache 0.5.6's connector then finds every chunk; 0.5.3's
    scheduler side never looks up again (its heartbeat never starts), the reason PerNode is refused there."""
    venv = engine_venv.require(pair.vllm, pair.lmcache)
    argv, kv, http, base, shm = rendered_server(pair, tmp_path)
    tokens, model, log = 1024, "meta-llama/Llama-3.1-8B-Instruct", tmp_path / "server.log"
    offered = images.takes_shared_server(pair.lmcache)
    server = start_server(venv, argv, log)
    client = subprocess.Popen([engine_venv.python(venv), str(RELOAD), json.dumps(kv), model, str(tokens), "restart"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **QUIET},
                              stderr=(tmp_path / "vllm.log").open("w"))

    def until(word: str) -> None:
        for line in client.stdout:  # vLLM's imports print to stdout too
            if line.strip() == word:
                return
        raise AssertionError((tmp_path / "vllm.log").read_text()[-3000:])

    try:
        until("STORED")
        wait_l2(base, tokens // 256)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        Path("/dev/shm", shm).unlink(missing_ok=True)
        client.stdin.write("down\n")
        client.stdin.flush()
        until("LOOKED")  # after mq_timeout; the worker's heartbeat (a PING every 10 s) has noticed too
        server = start_server(venv, argv, log)
        deadline = time.monotonic() + 120
        while not registered(http):  # the worker's heartbeat registers its KV caches again
            assert client.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        out, _ = client.communicate("up\n", timeout=300)
        got = json.loads(out.strip().splitlines()[-1])
        assert got["stored"] and got["found_before"] == 0 and got["found_in_outage"] == 0 and got["worker_healthy"]
        if offered:
            assert got["scheduler_healthy"] and (got["found_tokens"], got["loaded"]) == (tokens, True), got
        else:
            assert not got["scheduler_healthy"] and got["found_tokens"] == 0, got
    finally:
        if client.poll() is None:
            client.kill()
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        Path("/dev/shm", shm).unlink(missing_ok=True)
