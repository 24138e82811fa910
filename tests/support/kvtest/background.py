"""The cold builds `make test` runs in the background, and how a test waits for one.

`make test` (Makefile `background-builds`) starts the longest cold builds once `make check` passed, at the
lowest CPU and I/O priority: KEDA, Flux's controllers, and the engine chain (every offered pair's engine venv, one
compiling LMCache; the images; the compatibility matrix's PyPI metadata). The tests start at once: the ones that
need a background build run last (tests/conftest.py LATE), and under KVO_WAIT_BUILDS=1 (`make test`) they wait
here until that build's lock is free before they look for its result. A build that failed left no result, so
those tests then fail (KVO_REQUIRE_*) and the message names its log. On a warm machine every lock is free at once.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
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
