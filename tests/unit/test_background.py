"""kvtest.background: a test waits for a background build while its builder holds the lock, and only under
`make test` (KVO_WAIT_BUILDS=1); a build that outlives the timeout is an error naming its log."""

from __future__ import annotations

import re
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


def test_chain_steps_run_at_once_unless_one_needs_another(tmp_path):
    """kvtest.background.run_steps: two steps that each wait for the other's file can only finish side by side; a step
    runs after the ones it names, and not at all after a failed one; the log has each step's wall and CPU seconds."""
    a, b = tmp_path / "a", tmp_path / "b"
    meet = "touch {0}; for i in $(seq 400); do [ -e {1} ] && exit 0; sleep 0.05; done; exit 1"
    steps = [background.Step("a", ("sh", "-c", meet.format(a, b))),
             background.Step("b", ("sh", "-c", meet.format(b, a))),
             background.Step("both", ("sh", "-c", f"test -e {a} && test -e {b}"), ("a", "b")),
             background.Step("fails", ("false",)), background.Step("after-failed", ("touch", str(tmp_path / "x")),
                                                                   ("fails",))]
    with open(tmp_path / "log", "w") as log:
        assert background.run_steps(steps, out=log) is False
    text = (tmp_path / "log").read_text()
    assert all(f"[background] {n}: passed" in text for n in ("a", "b", "both")), text
    assert "[background] fails: FAILED (1)" in text and "after-failed: not run" in text
    assert not (tmp_path / "x").exists()
    assert re.search(r"\[background\] both: passed at \d+s, \d+s wall, \d+ CPU-s", text), text
    with pytest.raises(ValueError, match="not-there"):
        background.run_steps([background.Step("c", ("true",), ("not-there",))])


def test_the_engine_chain_builds_each_pairs_images_after_its_venv():
    from kvoffload.engine import images

    steps = {s.name: s for s in background.engine_steps("python")}
    pairs = [f"{k.vllm}-{k.lmcache}" for k in images.serving_images().values()]
    assert steps["images-no-venv"].after == () and all(steps[f"venv-{p}"].after == () for p in pairs)
    assert all(steps[f"images-{p}"].after == (f"venv-{p}",) for p in pairs)
    assert set(steps["metadata"].after) == {f"venv-{p}" for p in pairs}
