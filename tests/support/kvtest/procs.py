"""Processes and ports, read from /proc: liveness by pid + start time, listeners, process groups."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterable

LOOPBACK = "127.0.0.1"
# Popen handles of the processes this Python process started, so that they are reaped (no zombies).
CHILDREN: dict[int, subprocess.Popen] = {}


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgid, starttime) of a live process, None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = raw[raw.rindex(")") + 2:].split()
    return rest[0], int(rest[2]), int(rest[19])


def alive(rec: dict) -> bool:
    """Is the process recorded as {pid, starttime} still the same live process?"""
    st = proc_stat(int(rec["pid"]))
    return bool(st) and st[0] not in ("Z", "X") and st[2] == rec.get("starttime", st[2])


def reap(pid: int) -> None:
    p = CHILDREN.get(pid)
    if p is not None:
        p.poll()


def kill(rec: dict, sig: int) -> None:
    """Signal the recorded process's group (or the process alone if it left its group)."""
    if not alive(rec):
        return
    pgid = int(rec["pgid"])
    s = proc_stat(int(rec["pid"]))
    with contextlib.suppress(ProcessLookupError):
        if s and s[1] == pgid:
            os.killpg(pgid, sig)
        else:
            os.kill(int(rec["pid"]), sig)


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def port_bound(port: int) -> bool:
    """True if something listens on 127.0.0.1:port or on any address:port."""
    return any(p == port for _, p, _ in listening_sockets())


def listening_sockets(pids: Iterable[int] | None = None) -> list[tuple[str, int, int | None]]:
    """(address, port, pid) of TCP listeners (v4 and v6); restricted to pids if given."""
    inode_pid: dict[str, int] = {}
    want = set(int(p) for p in pids) if pids is not None else None
    for pdir in Path("/proc").iterdir():
        if not pdir.name.isdigit() or (want is not None and int(pdir.name) not in want):
            continue
        with contextlib.suppress(OSError):
            for fd in (pdir / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inode_pid[target[8:-1]] = int(pdir.name)
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if parts[3] != "0A":  # LISTEN
                    continue
                hexaddr, hexport = parts[1].split(":")
                raw = bytes.fromhex(hexaddr)
                if v6:
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    addr = str(ipaddress.IPv6Address(raw))
                else:
                    addr = str(ipaddress.IPv4Address(raw[::-1]))
                pid = inode_pid.get(parts[9])
                if want is not None and pid is None:
                    continue
                out.append((addr, int(hexport, 16), pid))
    return out


def wait_until(fn: Callable[[], Any], timeout: float = 60.0, interval: float = 0.2,
               message: str = "condition") -> Any:
    """Poll fn() until it returns a truthy value; raise TimeoutError with the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = fn()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - keep polling, report at the end
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {message}; last: {last!r}")
        time.sleep(interval)
