"""The node janitor's loop on real directory trees: sweeps, dry-run, state, failures, and its metrics."""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvoffload.cli import main as cli_main
from kvoffload.node.disk_cleaner import DELETE
from kvoffload.node.janitor import JanitorMetrics, SweepConfig, loop, read_state, sweep

OLD = time.time() - 3600


def pod_dir(root: Path, ns: str, name: str, pod: int, size: int) -> Path:
    d = root / ns / name / f"{name}-{pod}"
    d.mkdir(parents=True)
    (d / "chunk.pt").write_bytes(b"k" * size)
    os.utime(d, (OLD, OLD))
    return d


def sample(metrics: JanitorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels or None)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "lmcache"
    pod_dir(r, "team-a", "live", 0, 100)
    pod_dir(r, "team-a", "gone", 0, 4096)
    pod_dir(r, "team-a", "gone", 1, 1024)
    return r


def test_dry_run_counts_what_would_go_and_removes_nothing(root, tmp_path):
    state = tmp_path / "state.json"
    live = {("team-a", "live"): DELETE}
    # A first real sweep only learns policies (gone is live then).
    sweep(SweepConfig((str(root),), state=str(state)), {**live, ("team-a", "gone"): DELETE})
    assert read_state(str(state)) == {("team-a", "live"): DELETE, ("team-a", "gone"): DELETE}
    metrics = JanitorMetrics()
    reports = sweep(SweepConfig((str(root),), state=str(state), dry_run=True), live)
    metrics.record(reports, dry_run=True)
    assert (root / "team-a" / "gone" / "gone-0" / "chunk.pt").exists()
    assert sample(metrics, "kvoffload_janitor_reclaimable_bytes", root=str(root)) == 4096 + 1024
    assert sample(metrics, "kvoffload_janitor_reclaimed_bytes_total", root=str(root)) is None
    assert sample(metrics, "kvoffload_janitor_dry_run") == 1
    assert read_state(str(state))[("team-a", "gone")] == DELETE  # dry-run never rewrites the state


def test_sweep_removes_the_orphan_keeps_the_live_and_counts_bytes(root, tmp_path):
    state = tmp_path / "state.json"
    sweep(SweepConfig((str(root),), state=str(state)), {("team-a", "live"): DELETE, ("team-a", "gone"): DELETE})
    metrics = JanitorMetrics()
    metrics.record(sweep(SweepConfig((str(root),), state=str(state)), {("team-a", "live"): DELETE}), dry_run=False)
    assert not (root / "team-a" / "gone").exists()
    assert (root / "team-a" / "live" / "live-0" / "chunk.pt").read_bytes() == b"k" * 100
    assert sample(metrics, "kvoffload_janitor_reclaimed_bytes_total", root=str(root)) == 4096 + 1024
    assert sample(metrics, "kvoffload_janitor_removed_directories_total", root=str(root)) == 2
    assert sample(metrics, "kvoffload_janitor_sweeps_total", result="ok") == 1
    assert ("team-a", "gone") not in read_state(str(state))  # forgotten once its directories are gone


def test_loop_survives_a_failed_live_read_and_removes_nothing_then(root, tmp_path):
    calls = []
    stop = threading.Event()

    def live():
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("API server down")
        if len(calls) >= 3:
            stop.set()
        return {("team-a", "live"): DELETE}

    metrics = JanitorMetrics()
    loop(SweepConfig((str(root),), unknown_policy=DELETE), live, metrics, 0.01, stop)
    assert sample(metrics, "kvoffload_janitor_sweeps_total", result="failed") == 1
    assert sample(metrics, "kvoffload_janitor_sweeps_total", result="ok") == 2
    assert not (root / "team-a" / "gone").exists() and (root / "team-a" / "live").exists()
    assert sample(metrics, "kvoffload_janitor_last_success_timestamp_seconds") > time.time() - 60


def test_cli_interval_serves_metrics_on_the_given_address(root, tmp_path, monkeypatch):
    """`clean-disk --interval --metrics-listen`, as the chart runs it, on 127.0.0.1 with a live JSON file."""
    import json
    import socket

    live = tmp_path / "live.json"
    live.write_text(json.dumps([{"namespace": "team-a", "name": "live", "reclaimPolicy": "Delete"}]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = cli_main.build_parser("clean-disk").parse_args(
        ["clean-disk", "--root", str(root), "--live-json", str(live), "--unknown-policy", "Delete",
         "--interval", "0.05", "--metrics-listen", f"127.0.0.1:{port}"])
    stopper = threading.Timer(2.0, lambda: os.kill(os.getpid(), __import__("signal").SIGTERM))
    got: dict[str, str] = {}

    def scrape():
        deadline = time.time() + 1.8
        while time.time() < deadline:
            try:
                got["text"] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
                if 'kvoffload_janitor_reclaimed_bytes_total{root="' in got["text"]:
                    return
            except OSError:
                pass
            time.sleep(0.05)

    scraper = threading.Thread(target=scrape)
    stopper.start()
    scraper.start()
    assert args.func(args) == 0  # returns on SIGTERM
    scraper.join()
    assert f'kvoffload_janitor_reclaimed_bytes_total{{root="{root}"}} 5120.0' in got["text"], got.get("text")
    assert not (root / "team-a" / "gone").exists()


def test_metrics_need_interval(root, tmp_path):
    from kvoffload.api.errors import ConfigError

    live = tmp_path / "live.json"
    live.write_text("[]")
    args = cli_main.build_parser("clean-disk").parse_args(
        ["clean-disk", "--root", str(root), "--live-json", str(live), "--metrics-listen", "127.0.0.1:0"])
    with pytest.raises(ConfigError, match="--metrics-listen"):
        args.func(args)


def test_metric_names_are_stable():
    text = generate_latest(JanitorMetrics().registry).decode()
    for name in ("kvoffload_janitor_sweeps_total", "kvoffload_janitor_dry_run", "kvoffload_janitor_last_success_timestamp_seconds"):
        assert name in text
