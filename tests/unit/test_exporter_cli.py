"""The `exporter` sub-command (flag contract, validation) and the HTTP server (/metrics, /healthz),
in-process and as a real process on 127.0.0.1."""

from __future__ import annotations

import argparse
import http.client
import importlib
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvoffload.api.errors import ConfigError
from kvoffload.exporter import cli as exporter_cli
from kvoffload.exporter.capacity import GiB
from kvoffload.exporter.collector import ExporterConfig, TierCollector
from kvoffload.exporter.server import parse_listen, start_server
from kvtest.exporter import ExporterProcess, FakeVllm

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VLLM_TEXT = (FIXTURES / "vllm-0.33.0-metrics-sample" / "exposition.txt").read_text()
MULTIPROC = FIXTURES / "lmcache-0.5.6-metrics-sample" / "multiproc"
WITH_LMCACHE = (FIXTURES / "vllm-0.26.0-lmcache-0.5.3-h200" / "vllm-metrics-with-lmcache.txt").read_text()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvoffload")
    exporter_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["exporter", *argv])


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_kvoffload_cli_dispatches_to_this_module() -> None:
    from kvoffload.cli import main as cli

    assert cli.SUBCOMMANDS["exporter"] == "kvoffload.exporter.cli"
    assert callable(importlib.import_module(cli.SUBCOMMANDS["exporter"]).register)


def test_kvoffload_exporter_through_the_full_cli() -> None:
    from kvoffload.cli import main as cli

    try:
        parser = cli.build_parser()
    except ImportError as exc:  # another team's sub-command mid-change: not this module's contract
        if "exporter" in str(exc):
            raise
        pytest.skip(f"another sub-command does not import: {exc}")
    args = parser.parse_args(["exporter", "--tensor-parallel-size", "2"])
    assert args.func is exporter_cli.run and args.tensor_parallel_size == 2


def test_flag_contract_and_defaults() -> None:
    args = parse([])
    assert args.func is exporter_cli.run
    assert args.listen == "127.0.0.1:9400"
    assert args.vllm_metrics_url == "http://127.0.0.1:8000/metrics"
    assert args.scrape_timeout == 2.0
    assert (args.multiproc_dir, args.disk_dir, args.lmcache_config) == (None, None, None)
    assert (args.tensor_parallel_size, args.kv_bytes_per_token) == (1, 0)
    args = parse(["--listen", "127.0.0.1:9500", "--vllm-metrics-url", "http://127.0.0.1:8001/metrics",
                  "--multiproc-dir", "/tmp/mp", "--disk-dir", "/var/lib/kvoffload/d",
                  "--lmcache-config", "/etc/lmcache/lmcache.yaml", "--tensor-parallel-size", "4",
                  "--kv-bytes-per-token", "131072", "--scrape-timeout", "1.5",
                  "--disk-rescan-interval", "60"])
    assert (args.tensor_parallel_size, args.kv_bytes_per_token, args.disk_rescan_interval) == (4, 131072, 60)


@pytest.mark.parametrize("argv, field", [
    (["--listen", "9400"], "--listen"),
    (["--listen", "127.0.0.1:http"], "--listen"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["--kv-bytes-per-token", "-1"], "--kv-bytes-per-token"),
    (["--scrape-timeout", "0"], "--scrape-timeout"),
    (["--disk-rescan-interval", "-5"], "--disk-rescan-interval"),
    (["--lmcache-config", "/nonexistent/lmcache.yaml"], "--lmcache-config"),
    (["--shared-node", "gpu-node-1"], "--shared-node"),  # whose server? (PerNode needs its /status URL)
])
def test_bad_flags_name_the_flag(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        exporter_cli.build(parse(argv))
    assert err.value.field == field


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert parse_listen("[::1]:9400") == ("::1", 9400)


def test_build_uses_the_lmcache_config(tmp_path: Path) -> None:
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text("max_local_cpu_size: 10\nlocal_disk: /d\nmax_local_disk_size: 30\n")
    _, collector, address = exporter_cli.build(parse(["--lmcache-config", str(cfg),
                                                      "--tensor-parallel-size", "2",
                                                      "--disk-dir", str(tmp_path)]))
    assert address == ("127.0.0.1", 9400)
    assert collector.config.capacity.cpu_bytes == 20 * GiB
    assert collector.config.capacity.disk_bytes == 60 * GiB
    assert collector.disk is not None and set(collector.health) == {"vllm", "lmcache", "disk"}


def test_server_endpoints_in_process() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TierCollector(ExporterConfig(
        vllm_metrics_url=f"http://127.0.0.1:{_closed_port()}/metrics", multiproc_dir=str(MULTIPROC))))
    server = start_server(registry, "127.0.0.1", 0)
    try:
        port = server.server_address[1]
        assert get(port, "/healthz") == (200, "ok\n")
        status, body = get(port, "/metrics")
        assert status == 200
        assert 'kvoffload_source_up{source="vllm"} 0.0' in body
        assert 'kvoffload_tier_used_bytes{tier="cpu"} 2.147483648e+10' in body
        assert get(port, "/other")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_exporter_process_end_to_end(tmp_path: Path) -> None:
    mp = tmp_path / "mp"
    shutil.copytree(MULTIPROC, mp)
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "chunk.pt").write_bytes(b"k" * 4096)
    with FakeVllm(WITH_LMCACHE) as vllm, ExporterProcess([
            "--vllm-metrics-url", vllm.url, "--multiproc-dir", str(mp), "--disk-dir", str(disk),
            "--disk-rescan-interval", "0.2"]) as exporter:
        assert get(exporter.port, "/healthz") == (200, "ok\n")
        status, body = get(exporter.port, "/metrics")
        assert status == 200
        assert 'kvoffload_offload_active 1.0' in body
        assert 'kvoffload_tier_hit_tokens_total{tier="external"} 64028.0' in body
        assert "process_resident_memory_bytes" in body
        exporter.proc.send_signal(signal.SIGTERM)
        assert exporter.proc.wait(10) == 0


def test_a_sigterm_the_kernel_gives_another_thread_still_stops_the_exporter() -> None:
    """kubelet's SIGTERM is process-wide; the kernel may hand it to any thread (here the HTTP thread, by its tid).
    Python runs the handler in the main thread only when that thread wakes: the exporter must not sleep through it."""
    import os
    import time

    with ExporterProcess(["--vllm-metrics-url", f"http://127.0.0.1:{_closed_port()}/metrics"]) as exporter:
        assert get(exporter.port, "/healthz")[0] == 200
        pid = exporter.proc.pid
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
        assert tids, "the HTTP server runs in a thread of its own"
        os.kill(tids[0], signal.SIGTERM)  # kill(2) on a tid: the signal goes to the process, preferably that thread
        t0 = time.monotonic()
        assert exporter.proc.wait(10) == 0
        assert time.monotonic() - t0 < 5


def test_exporter_process_survives_every_source_failing(tmp_path: Path) -> None:
    with ExporterProcess(["--vllm-metrics-url", f"http://127.0.0.1:{_closed_port()}/metrics",
                          "--multiproc-dir", str(tmp_path / "empty"),
                          "--disk-dir", str(tmp_path / "missing"),
                          "--scrape-timeout", "0.5", "--disk-rescan-interval", "0.1"]) as exporter:
        for _ in range(3):
            status, body = get(exporter.port, "/metrics")
            assert status == 200
        assert 'kvoffload_scrape_errors_total{source="vllm"} 3.0' in body
        assert 'kvoffload_source_up{source="disk"} 0.0' in body
        assert get(exporter.port, "/healthz")[0] == 200
        assert exporter.proc.poll() is None
        log = "".join(exporter.log_lines)
        assert log.count("source vllm failing") == 1
        assert log.count("source disk failing") == 1


def test_exporter_process_refuses_a_busy_port() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "kvoffload.exporter", "--listen", f"127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "--listen" in done.stderr


def test_the_rendered_sidecar_arguments_are_flags_the_exporter_accepts() -> None:
    """The flag names are a contract between the operator's render and this parser."""
    import yaml

    from kvoffload.api.settings import Settings
    from kvoffload.controller import pipeline
    from kvoffload.engine.versions import VERSIONS_FILE

    doc = yaml.safe_load((FIXTURES.parents[1] / "examples" / "workstation-llama31-8b.yaml").read_text())
    children = pipeline.desired("svc", "ns", "u", doc["spec"], Settings()).children
    pod = next(c for c in children if c["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    exporter = next(c for c in pod["containers"] if c["name"] == "exporter")
    assert exporter["args"][0] == "exporter"
    args = parse([a.replace("$(POD_IP)", "127.0.0.1") for a in exporter["args"][1:]])
    assert args.engine_versions_file == VERSIONS_FILE
    assert args.multiproc_dir == "/var/run/kvoffload/prometheus"
    mounts = {m["mountPath"] for m in exporter["volumeMounts"]}
    assert VERSIONS_FILE.rsplit("/", 1)[0] in mounts
