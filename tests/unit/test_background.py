"""kvtest.background: a test waits for a background build while its builder holds the lock, and only under
`make test` (KVO_WAIT_BUILDS=1); a build that outlives the timeout is an error naming its log."""

from __future__ import annotations

import subprocess
import time

import pytest

from kvtest import background


@pytest.fixture
def held(tmp_path, monkeypatch):
    """A builder holding the keda lock for `seconds` (flock(1), as the Makefile's chains and build scripts take it)."""
    monkeypatch.setattr(background, "CACHE", tmp_path)
    procs = []

    def hold(seconds: float) -> None:
        procs.append(subprocess.Popen(["flock", str(tmp_path / background.LOCKS["keda"]), "sleep", str(seconds)]))
        lock = tmp_path / background.LOCKS["keda"]
        for _ in range(100):  # until flock(1) holds it
            if lock.exists() and subprocess.run(["flock", "-n", str(lock), "true"]).returncode == 1:
                return
            time.sleep(0.05)
        raise AssertionError("flock(1) never took the lock")

    yield hold
    for p in procs:
        p.kill()
        p.wait()


def test_under_make_test_a_test_waits_until_the_builder_lets_go(held, monkeypatch):
    monkeypatch.setenv("KVO_WAIT_BUILDS", "1")
    held(2)
    t0 = time.monotonic()
    background.wait("keda")
    assert 1.5 < time.monotonic() - t0 < 15


def test_elsewhere_a_test_does_not_wait(held, monkeypatch):
    monkeypatch.delenv("KVO_WAIT_BUILDS", raising=False)
    held(30)
    t0 = time.monotonic()
    background.wait("keda")
    assert time.monotonic() - t0 < 1


def test_a_build_past_the_timeout_is_an_error_naming_its_log(held, monkeypatch):
    monkeypatch.setenv("KVO_WAIT_BUILDS", "1")
    held(30)
    with pytest.raises(TimeoutError, match="keda-background.log"):
        background.wait("keda", timeout=1)


def test_no_lock_means_no_background_build(tmp_path, monkeypatch):
    monkeypatch.setattr(background, "CACHE", tmp_path)
    monkeypatch.setenv("KVO_WAIT_BUILDS", "1")
    background.wait("engine")  # returns at once: the lock file was never made
