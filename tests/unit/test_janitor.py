"""The node janitor's loop on real directory trees: sweeps, dry-run, state, failures, and its metrics."""

from __future__ import annotations

import os
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvoffload.api.errors import ConfigError
from kvoffload.cli import main as cli_main
from kvoffload.node import owner_marker
from kvoffload.node.disk_cleaner import DELETE, RETAIN
from kvoffload.node.janitor import Incarnations, JanitorMetrics, Listed, SweepConfig, View, loop, read_state, sweep

OLD = time.time() - 3600


def pod_dir(root: Path, ns: str, name: str, pod: int, size: int, uid: str | None = None) -> Path:
    """<root>/lmcache/<ns>/<name>/<name>-<pod> as the init container leaves it: marked with the owner's uid."""
    d = root / "lmcache" / ns / name / f"{name}-{pod}"
    d.mkdir(parents=True)
    fd = os.open(d.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        owner_marker.write(fd, owner_marker.Owner(ns, name, d.name, uid or f"uid-{name}"))
    finally:
        os.close(fd)
    (d / "chunk.pt").write_bytes(b"k" * size)
    os.utime(d, (OLD, OLD))
    return d


def sample(metrics: JanitorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels or None)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "nvme"
    pod_dir(r, "team-a", "live", 0, 100)
    pod_dir(r, "team-a", "gone", 0, 4096)
    pod_dir(r, "team-a", "gone", 1, 1024)
    return r


LIVE = {("team-a", "live"): "uid-live"}


def test_dry_run_counts_what_would_go_and_removes_nothing(root):
    metrics = JanitorMetrics()
    reports = sweep(SweepConfig((str(root),), dry_run=True), View(LIVE, {"uid-gone": DELETE}))
    metrics.record(reports, dry_run=True)
    assert (root / "lmcache" / "team-a" / "gone" / "gone-0" / "chunk.pt").exists()
    assert sample(metrics, "kvoffload_janitor_reclaimable_bytes", root=str(root)) == 4096 + 1024
    assert sample(metrics, "kvoffload_janitor_reclaimed_bytes_total", root=str(root)) is None
    assert sample(metrics, "kvoffload_janitor_dry_run") == 1


def test_sweep_removes_the_deleted_keeps_the_live_and_counts_bytes(root):
    metrics = JanitorMetrics()
    metrics.record(sweep(SweepConfig((str(root),)), View(LIVE, {"uid-gone": DELETE})), dry_run=False)
    assert not (root / "lmcache" / "team-a" / "gone").exists()
    assert (root / "lmcache" / "team-a" / "live" / "live-0" / "chunk.pt").read_bytes() == b"k" * 100
    assert sample(metrics, "kvoffload_janitor_reclaimed_bytes_total", root=str(root)) == 4096 + 1024
    assert sample(metrics, "kvoffload_janitor_removed_directories_total", root=str(root)) == 2
    assert sample(metrics, "kvoffload_janitor_sweeps_total", result="ok") == 1


def ev(kind: str, name: str, uid: str, policy: str) -> tuple[str, dict]:
    return kind, {"metadata": {"namespace": "team-a", "name": name, "uid": uid},
                  "spec": {"offload": {"disk": {"path": "/x/lmcache", "reclaimPolicy": policy}}}}


def test_the_final_spec_decides_a_policy_changed_just_before_the_deletion(root, tmp_path):
    """Delete -> Retain, then deleted within one interval: the DELETED event's spec (Retain) keeps the files,
    and it is in the state file before any sweep runs."""
    state = tmp_path / "janitor" / "state.json"
    state.parent.mkdir()
    store = Incarnations(str(state))
    with pytest.raises(ConfigError, match="not in sync"):
        store.view()  # before the first listing: no sweep
    store.relisted([ev("ADDED", "gone", "uid-gone", DELETE)[1], ev("ADDED", "live", "uid-live", DELETE)[1]])
    store.event(*ev("MODIFIED", "gone", "uid-gone", RETAIN))
    store.event(*ev("DELETED", "gone", "uid-gone", RETAIN))
    assert read_state(str(state)) == {"uid-gone": RETAIN}
    view = store.view()
    assert view.live == LIVE
    reports = sweep(SweepConfig((str(root),), unknown_policy=DELETE), view)
    store.swept(view, reports)
    assert (root / "lmcache" / "team-a" / "gone" / "gone-0" / "chunk.pt").exists()
    assert read_state(str(state)) == {"uid-gone": RETAIN}  # still named by markers on disk: remembered


def test_a_later_incarnation_of_the_same_name_never_decides_for_an_earlier_one(root, tmp_path):
    """gone (uid-gone, Retain) deleted; a new gone (uid-new, Delete) runs one pod here, then is deleted too: only
    the new incarnation's pod directory goes."""
    store = Incarnations(str(tmp_path / "state.json"))
    store.relisted([ev("ADDED", "gone", "uid-gone", RETAIN)[1]])
    store.event(*ev("DELETED", "gone", "uid-gone", RETAIN))
    shutil.rmtree(root / "lmcache" / "team-a" / "gone" / "gone-0")
    pod_dir(root, "team-a", "gone", 0, 10, uid="uid-new")  # the new incarnation's init container re-marked gone-0
    store.event(*ev("ADDED", "gone", "uid-new", DELETE))
    assert sweep(SweepConfig((str(root),)), store.view())[0].removed == []  # uid-new is live
    store.event(*ev("DELETED", "gone", "uid-new", DELETE))
    view = store.view()
    reports = sweep(SweepConfig((str(root),)), view)
    store.swept(view, reports)
    gone = root / "lmcache" / "team-a" / "gone"
    assert not (gone / "gone-0").exists() and (gone / "gone-1" / "chunk.pt").stat().st_size == 1024
    assert read_state(str(tmp_path / "state.json")) == {"uid-gone": RETAIN}  # uid-new forgotten: nothing names it


def test_a_deletion_the_watch_missed_gets_the_unknown_policy(root, tmp_path):
    store = Incarnations(str(tmp_path / "state.json"))
    store.relisted([ev("ADDED", "gone", "uid-gone", DELETE)[1]])
    store.relisted([])  # relisted after a gap (410): gone vanished without a DELETED event
    sweep(SweepConfig((str(root),)), store.view())
    assert (root / "lmcache" / "team-a" / "gone" / "gone-0").exists()  # Retain when unsure
    sweep(SweepConfig((str(root),), unknown_policy=DELETE), store.view())
    assert not (root / "lmcache" / "team-a" / "gone").exists()  # unless the admin says Delete


def test_loop_survives_a_failed_live_read_and_removes_nothing_then(root):
    calls = []
    stop = threading.Event()

    def live():
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("API server down")
        if len(calls) >= 3:
            stop.set()
        return LIVE

    metrics = JanitorMetrics()
    loop(SweepConfig((str(root),), unknown_policy=DELETE), Listed(live), metrics, 0.01, stop)
    assert sample(metrics, "kvoffload_janitor_sweeps_total", result="failed") == 1
    assert sample(metrics, "kvoffload_janitor_sweeps_total", result="ok") == 2
    assert not (root / "lmcache" / "team-a" / "gone").exists() and (root / "lmcache" / "team-a" / "live").exists()
    assert sample(metrics, "kvoffload_janitor_last_success_timestamp_seconds") > time.time() - 60


def test_cli_interval_serves_metrics_on_the_given_address(root, tmp_path, monkeypatch):
    """`clean-disk --interval --metrics-listen`, as the chart runs it, on 127.0.0.1 with a live JSON file."""
    import json
    import socket

    live = tmp_path / "live.json"
    live.write_text(json.dumps([{"namespace": "team-a", "name": "live", "uid": "uid-live"}]))
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
    assert not (root / "lmcache" / "team-a" / "gone").exists()


def test_the_state_file_must_lie_outside_every_root(root):
    args = cli_main.build_parser("clean-disk").parse_args(
        ["clean-disk", "--root", str(root), "--live-json", "-", "--state", str(root / "lmcache" / "state.json")])
    with pytest.raises(ConfigError, match="--state.*where a tenant's spec.offload.disk.path can reach it"):
        args.func(args)


def test_metrics_need_interval(root, tmp_path):
    live = tmp_path / "live.json"
    live.write_text("[]")
    args = cli_main.build_parser("clean-disk").parse_args(
        ["clean-disk", "--root", str(root), "--live-json", str(live), "--metrics-listen", "127.0.0.1:0"])
    with pytest.raises(ConfigError, match="--metrics-listen"):
        args.func(args)


def test_metric_names_are_stable():
    text = generate_latest(JanitorMetrics().registry).decode()
    for name in ("kvoffload_janitor_sweeps_total", "kvoffload_janitor_dry_run",
                 "kvoffload_janitor_last_success_timestamp_seconds"):
        assert name in text
