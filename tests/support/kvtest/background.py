"""The cold builds `make test` runs in the background, and how a test waits for one.

`make test` (Makefile `background-builds`) starts the longest cold builds once `make check` passed, at the
lowest CPU priority: KEDA, Flux's controllers, and the engine chain (`python -m kvtest.background engine`, below:
every offered pair's engine venv, one compiling LMCache; the images; the compatibility matrix's PyPI metadata). The
tests start at once: the ones that
need a background build run last (tests/conftest.py LATE), and under KVO_WAIT_BUILDS=1 (`make test`) they wait
here until that build's lock is free before they look for its result. A build that failed left no result, so
those tests then fail (KVO_REQUIRE_*) and the message names its log. On a warm machine every lock is free at once.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("KVO_CACHE", Path.home() / ".cache" / "kvoffload"))
# name -> the lock its builder holds while it builds (the build scripts' own flocks; the engine chain's, Makefile)
LOCKS = {"keda": "keda.lock", "flux": "flux.lock", "engine": "engine-background.lock"}
TIMEOUT = 90 * 60


def log(name: str) -> Path:
    return CACHE / f"{name}-background.log"


def wait(name: str, timeout: float = TIMEOUT) -> None:
    """Under KVO_WAIT_BUILDS=1, block until the background build `name` is no longer running."""
    path = CACHE / LOCKS[name]
    if os.environ.get("KVO_WAIT_BUILDS") != "1" or not path.exists():
        return
    t0 = time.monotonic()
    with open(path, "a") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(
                        f"the background build {name} still runs after {timeout:.0f}s: {log(name)}") from None
                time.sleep(5)
        fcntl.flock(fh, fcntl.LOCK_UN)
    waited = time.monotonic() - t0
    if waited > 1:
        print(f"[kvtest] waited {waited:.0f}s for the background build {name} ({log(name)})", file=sys.stderr)


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    after: tuple[str, ...] = ()  # steps that must have passed first


def engine_steps(python: str = sys.executable) -> list[Step]:
    """The engine chain's steps and what each needs. The parts run concurrently where nothing orders them: a venv
    build is mostly download and unpacking, LMCache's compile is CPU, the vLLM base of a wheel pair is a disk copy, so
    on 2 cores they overlap instead of queueing (docs/benchmarks.md "Cold .ci/run", 3 Dec). The serving image of a
    pair whose LMCache is compiled installs the wheel its venv compiled (kvtest.images prebuilt): no second compile."""
    from kvoffload.engine import images as engine_images

    from . import images
    from .paths import ROOT

    steps = [Step("images-no-venv", (python, "-m", "kvtest.images", "build", "operator", "standin-slim", "router"))]
    venvs = []
    for k in engine_images.serving_images().values():
        name = f"{k.vllm}-{k.lmcache}"
        venvs.append(f"venv-{name}")
        steps.append(Step(venvs[-1], (str(ROOT / "tests/engine/build-venv.sh"), k.vllm, k.lmcache, k.lmcache_from)))
        builds = ["standin"] if name == images.STANDIN_PAIR else ["serving"]
        steps.append(Step(f"images-{name}", (python, "-m", "kvtest.images", "build", *builds, "--pair", name),
                          (venvs[-1],)))
    steps.append(Step("metadata", (python, str(ROOT / "tests/engine/compatibility.py"), "--fetch"), tuple(venvs)))
    return steps


def run_steps(steps: Sequence[Step], out=sys.stderr) -> bool:
    """Every step once all of its `after` passed, concurrently; each step's wall and CPU seconds (its process tree's,
    as wait4 reports them: what runs under podman's own processes is not in it) go to `out`. True when all passed;
    a step after a failed one does not run."""
    names = {s.name for s in steps}
    unknown = {a for s in steps for a in s.after} - names
    if unknown:
        raise ValueError(f"steps wait for steps that are not there: {sorted(unknown)}")
    done: dict[str, bool] = {}
    cond = threading.Condition()
    t0 = time.monotonic()

    def run(step: Step) -> None:
        with cond:
            cond.wait_for(lambda: all(a in done for a in step.after))
            ok = all(done[a] for a in step.after)
        if ok:
            start = time.monotonic()
            print(f"[background] {step.name}: start at {start - t0:.0f}s: {' '.join(step.argv)}", file=out, flush=True)
            proc = subprocess.Popen(step.argv, stdout=out, stderr=out)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            ok = proc.returncode == 0
            print(f"[background] {step.name}: {'passed' if ok else f'FAILED ({proc.returncode})'} at "
                  f"{time.monotonic() - t0:.0f}s, {time.monotonic() - start:.0f}s wall, "
                  f"{usage.ru_utime + usage.ru_stime:.0f} CPU-s", file=out, flush=True)
        else:
            print(f"[background] {step.name}: not run (a step before it failed)", file=out, flush=True)
        with cond:
            done[step.name] = ok
            cond.notify_all()

    threads = [threading.Thread(target=run, args=(s,)) for s in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return all(done.values())


if __name__ == "__main__":
    if sys.argv[1:] != ["engine"]:
        sys.exit("usage: python -m kvtest.background engine")
    sys.exit(0 if run_steps(engine_steps()) else 1)
