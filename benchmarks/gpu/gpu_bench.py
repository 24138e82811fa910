"""Run a rendered KVOffloadServe on this GPU host: vLLM + LMCache as the pod would, the exporter
beside it, time to first token per tier, host memory, and every kvoffload_* figure vs the engine.

    python benchmarks/gpu/gpu_bench.py --rendered rendered.yaml --out results/ \
        [--runs connector,baseline,disk] [--prompt-tokens 32768] [--reps 3] [--disk-root /var/tmp]

`--rendered` is `kvoffload render -f examples/X.yaml` output, or a KVOffloadServe file (rendered
with `python -m kvoffload.cli render`). Runs, each a fresh engine:
  connector  the rendered command, args, env and LMCache config (changes: gpu_manifests.localize),
             whatever spec.offload.backend rendered: lmcache (in-process LMCache), lmcache-server
             (the `lmcache server` native sidecar starts first, in its own cgroup, and must pass its
             rendered startup probe) or vllm-native (vLLM's OffloadingConnector)
  baseline   the same without the offload flags (--kv-transfer-config, --kv-offloading-*) and sidecars
  disk       the connector run with a CPU tier too small to keep the prompt (--disk-cpu-gib per
             rank) and LMCache O_DIRECT disk I/O (extra_config.use_odirect), LMCACHE_LOG_LEVEL=DEBUG
             so LMCache logs every disk read.
Phases per prompt (fresh random token ids): cold; again (prefix in GPU memory); after POST
/reset_prefix_cache (connector: the CPU tier; baseline: recompute). Each request also records the
token vLLM generated (return_token_ids): after a reload it must equal the token generated with the
prefix still in GPU memory, else what came back from the CPU tier was not the KV that was stored.
The disk run stores the prompt, pushes it out of the CPU tier with other prompts, resets, drops
the page cache and reloads it; proof that bytes came from disk: LMCache's "Disk read size" lines,
/proc/<pid>/io read_bytes of the engine's processes and /sys/block/*/stat sectors read, around that
one request.

Needs vLLM and LMCache importable by --python (default: this interpreter) and the kvoffload package
(PYTHONPATH=operator). Everything binds to 127.0.0.1; every wait has a deadline; engines and
exporters are killed (process group) on exit, also on Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import argparse
import atexit
import glob
import http.client
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_counters  # noqa: E402
import gpu_manifests  # noqa: E402

NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# No network from the benchmark: no hub look-ups, no usage reports (vLLM's and LMCache's).
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "LMCACHE_TRACK_USAGE": "false"}
BASE_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", **NCCL_SAFE, **OFFLINE}
_CHILDREN: list[subprocess.Popen] = []
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- processes

def _kill_all() -> None:
    for p in list(_CHILDREN):
        stop(p, grace=5)
    if "gpu_pod" in sys.modules:  # --runtime crun: the containers are crun's, not our children
        sys.modules["gpu_pod"].stop_all()


def stop(p: subprocess.Popen, grace: float = 30) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
    try:  # whatever the process left in its group (vLLM's engine core and workers)
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if p in _CHILDREN:
        _CHILDREN.remove(p)


def wait_gpus_free(deadline_s: float = 90, below_mib: int = 4096) -> float:
    """After an engine stops, until every GPU's used memory is small again (the next engine asks
    for --gpu-memory-utilization of it at start-up). Returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=20)
            used = [int(x) for x in r.stdout.split()]
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return 0.0
        if not used or max(used) < below_mib:
            break
        time.sleep(1)
    return round(time.monotonic() - t0, 1)


def _on_signal(signum: int, _frame: Any) -> None:
    _kill_all()
    sys.exit(128 + signum)


def spawn(argv: list[str], env: dict[str, str], logfile: Path, cgroup: str | None = None) -> subprocess.Popen:
    fh = open(logfile, "ab")

    def pre() -> None:
        if cgroup:
            try:
                Path(cgroup, "cgroup.procs").write_text("0")
            except OSError:
                pass
    p = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True, preexec_fn=pre)
    _CHILDREN.append(p)
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_req(port: int, method: str, path: str, body: Any = None, timeout: float = 10,
             host: str = "127.0.0.1") -> tuple[int, str]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def wait_http(port: int, path: str, deadline: float, proc: subprocess.Popen, what: str) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before {path} answered")
        try:
            if http_req(port, "GET", path, timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{what}: no 200 from {path} before the deadline")


def tree_pids(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for st in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(st).read_text()
            ppid = int(text.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(st.split("/")[2]))
        except (OSError, ValueError, IndexError):
            pass
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def proc_read_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("read_bytes:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def rss_bytes(pids: list[int]) -> dict[str, int]:
    rss = pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return {"rss": rss, "pss": pss}


def block_read_bytes() -> dict[str, int]:
    """Bytes read per whole block device (not partitions), from /sys/block/*/stat."""
    out = {}
    for d in glob.glob("/sys/block/*"):
        name = os.path.basename(d)
        if name.startswith(("loop", "ram", "zram")):
            continue
        try:
            out[name] = int(Path(d, "stat").read_text().split()[2]) * 512
        except (OSError, IndexError, ValueError):
            pass
    return out


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        if k in ("MemTotal", "MemFree", "MemAvailable", "Shmem", "Cached", "Mlocked", "Unevictable", "Buffers"):
            out[k] = int(v.split()[0]) * 1024
    return out


def cgroup_make(name: str) -> str | None:
    """A cgroup v2 child for the engine (no limit: we measure its peak). None if not possible."""
    root = Path("/sys/fs/cgroup")
    try:
        if "memory" not in (root / "cgroup.controllers").read_text().split():
            return None
        try:
            (root / "cgroup.subtree_control").write_text("+memory")
        except OSError:
            pass
        cg = root / name
        if cg.exists():
            cg.rmdir()
        cg.mkdir()
        return str(cg) if (cg / "memory.current").exists() else None
    except OSError:
        return None


def cgroup_stat(cg: str | None) -> dict[str, int]:
    if not cg:
        return {}
    out: dict[str, int] = {}
    try:
        out["current"] = int(Path(cg, "memory.current").read_text())
        peak = Path(cg, "memory.peak")
        if peak.exists():
            out["peak"] = int(peak.read_text())
        for line in Path(cg, "memory.stat").read_text().splitlines():
            k, v = line.split()
            if k in ("anon", "file", "shmem", "kernel", "unevictable", "file_dirty", "file_writeback"):
                out[k] = int(v)
    except OSError:
        pass
    return out


class MemSampler(threading.Thread):
    """/proc/meminfo and the engine's cgroup every `period` s; keeps the baseline and the peaks."""

    def __init__(self, cgroup: str | None, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.cgroup, self.period = cgroup, period
        self.base = meminfo()
        self.samples: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.halt.is_set():
            m = meminfo()
            self.samples.append({"t": round(time.monotonic() - t0, 2), **m,
                                 **{f"cg_{k}": v for k, v in cgroup_stat(self.cgroup).items()}})
            self.halt.wait(self.period)

    def summary(self) -> dict[str, Any]:
        b = self.base
        used0 = b["MemTotal"] - b["MemAvailable"]
        out: dict[str, Any] = {"baseline": b, "samples": len(self.samples)}
        if self.samples:
            out["peak_used_rise"] = max(s["MemTotal"] - s["MemAvailable"] - used0 for s in self.samples)
            out["peak_shmem_rise"] = max(s["Shmem"] - b["Shmem"] for s in self.samples)
            out["peak_memtotal"] = max(s["MemTotal"] for s in self.samples)
            for k in ("cg_peak", "cg_current", "cg_anon", "cg_shmem", "cg_file", "cg_kernel"):
                vals = [s[k] for s in self.samples if k in s]
                if vals:
                    out[f"max_{k}"] = max(vals)
            nonrecl = [s.get("cg_anon", 0) + s.get("cg_shmem", 0) + s.get("cg_kernel", 0) for s in self.samples
                       if "cg_anon" in s]
            if nonrecl:
                out["max_cg_anon_shmem_kernel"] = max(nonrecl)
        return out

    def trace(self, every: int = 4) -> list[dict[str, Any]]:
        return self.samples[::every]


# ---------------------------------------------------------------- engine I/O

def prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1000, 100000) for _ in range(n)]


def vllm_page(port: int) -> str:
    status, text = http_req(port, "GET", "/metrics", timeout=20)
    if status != 200:
        raise RuntimeError(f"vLLM /metrics: HTTP {status}")
    return text


def sources(page: gpu_counters.Page) -> dict[str, float]:
    out = {}
    for src in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        out[src] = page.sum("vllm:prompt_tokens_by_source_total", source=src) or 0.0
    out["external_hits"] = page.sum("vllm:external_prefix_cache_hits_total") or 0.0
    out["gpu_hits"] = page.sum("vllm:prefix_cache_hits_total") or 0.0
    # vLLM's native offloading (OffloadingConnector) counts the bytes it moves; absent otherwise.
    out["offload_store_bytes"] = page.sum("vllm:kv_offload_store_bytes_total") or 0.0
    out["offload_load_bytes"] = page.sum("vllm:kv_offload_load_bytes_total") or 0.0
    return out


def server_status(url: str | None) -> dict[str, Any] | None:
    """The LMCache server's /status document (backend lmcache-server), None without one."""
    if not url:
        return None
    m = re.match(r"http://([^:/]+):(\d+)(/.*)", url)
    if not m or m.group(1) != "127.0.0.1":
        raise RuntimeError(f"LMCache server URL {url} is not on 127.0.0.1")
    status, body = http_req(int(m.group(2)), "GET", m.group(3), timeout=10)
    if status != 200:
        raise RuntimeError(f"LMCache server {url}: HTTP {status}")
    return json.loads(body)


def l1_used(doc: dict[str, Any] | None) -> float:
    try:
        return float(doc["storage_manager"]["l1_manager"]["memory_used_bytes"]) if doc else 0.0
    except (KeyError, TypeError, ValueError):
        return 0.0


class Engine:
    def __init__(self, port: int, model: str, proc: subprocess.Popen, logfile: Path,
                 status_url: str | None = None) -> None:
        self.port, self.model, self.proc, self.logfile = port, model, proc, logfile
        self.status_url = status_url  # the LMCache server's /status (lmcache-server), read around each request

    def complete(self, ids: list[int]) -> dict[str, Any]:
        """One request, max_tokens 1: its latency is the time to first token. Token sources from vLLM;
        what LMCache logged meanwhile (did it really retrieve?)."""
        before = sources(gpu_counters.Page(vllm_page(self.port)))
        l1_before = l1_used(server_status(self.status_url))
        off = self.logfile.stat().st_size
        t0 = time.perf_counter()
        status, body = http_req(self.port, "POST", "/v1/completions",
                                {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                 "return_token_ids": True}, timeout=REQUEST_TIMEOUT_S)
        ttft = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"completion: HTTP {status}: {body[:500]}")
        time.sleep(STATS_WAIT_S)  # let the engine publish the request's stats
        after = sources(gpu_counters.Page(vllm_page(self.port)))
        extra: dict[str, Any] = {"output_token_ids": output_tokens(body)}
        if self.status_url:
            extra["l1_used_bytes_delta"] = l1_used(server_status(self.status_url)) - l1_before
        text = log_lines_between(self.logfile, off)
        got = [int(x[0]) for x in RETRIEVED.findall(text)]
        stored = STORED.findall(text)  # LMCache's own split of a store: GPU->CPU copy vs put into the tiers
        extra.update({"lmcache_stored_tokens": sum(int(x[0]) for x in stored),
                      "lmcache_store_ms": round(sum(float(x[1]) for x in stored), 3),
                      "lmcache_offload_ms": round(sum(float(x[2]) for x in stored), 3),
                      "lmcache_put_ms": round(sum(float(x[3]) for x in stored), 3)})
        return {"ttft_s": round(ttft, 5), "tokens": len(ids), **{k: after[k] - before[k] for k in after}, **extra,
                "lmcache_retrieved_tokens": sum(got), "lmcache_retrieve_lines": len(got),
                "lmcache_load_skipped_lines": text.count("start_load_kv, but the attn_metadata is None")}

    def reset_prefix_cache(self, deadline_s: float = 180) -> dict[str, Any]:
        """Until vLLM says the GPU prefix cache is empty. vLLM 0.26.0 answers 200 with
        {"success": false} while blocks are held, e.g. by in-flight asynchronous KV stores (the
        lmcache-server connector holds a prompt's blocks until the server has it): we retry, and the
        time waited is how long the store took to drain."""
        t0 = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            status, body = http_req(self.port, "POST", "/reset_prefix_cache", timeout=60)
            if status != 200:
                raise RuntimeError(f"/reset_prefix_cache: HTTP {status}: {body[:300]}")
            if reset_succeeded(body):
                return {"reset_wait_s": round(time.monotonic() - t0, 3), "reset_attempts": attempts}
            if time.monotonic() - t0 > deadline_s:
                raise RuntimeError(f"/reset_prefix_cache: still {body[:100]} after "
                                   f"{attempts} attempts in {deadline_s:.0f} s")
            time.sleep(0.1)


# vLLM's series the autoscaling targets read (rendering/autoscaling.py), kept from each sampled page.
SERIES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:request_queue_time_seconds", "vllm:prompt_tokens_by_source_total", "vllm:prefix_cache_hits_total",
          "vllm:external_prefix_cache_hits_total")


def _series_name(line: str) -> str:
    """The metric an exposition line is about ('# TYPE name counter', 'name{...} 1')."""
    words = line.split(maxsplit=3)
    return words[2] if line.startswith("#") and len(words) > 2 else line


class PageSampler(threading.Thread):
    """vLLM's /metrics every `period` s while a load runs, cut to SERIES: (unix time, exposition text) pairs that a
    real Prometheus ingests afterwards (promtool tsdb create-blocks-from openmetrics) to evaluate the queries."""

    def __init__(self, port: int, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.port, self.period, self.halt = port, period, threading.Event()
        self.pages: list[tuple[float, str]] = []

    def run(self) -> None:
        while not self.halt.wait(self.period):
            try:
                text = vllm_page(self.port)
            except (OSError, RuntimeError):
                continue
            keep = [ln for ln in text.splitlines() if _series_name(ln).startswith(SERIES)]
            self.pages.append((time.time(), "\n".join(keep)))


def load_phase(eng: Engine, prompts: list[list[int]], concurrency: int) -> dict[str, Any]:
    """`prompts` with `concurrency` requests in flight (max_tokens 1: each latency is a time to first token, queueing
    included), and the engine's token sources over the phase."""
    before = sources(gpu_counters.Page(vllm_page(eng.port)))
    t0 = time.perf_counter()

    def one(ids: list[int]) -> tuple[float, float, int]:
        start = time.perf_counter()
        status, body = http_req(eng.port, "POST", "/v1/completions",
                                {"model": eng.model, "prompt": ids, "max_tokens": 1, "temperature": 0},
                                timeout=REQUEST_TIMEOUT_S)
        if status != 200:
            raise RuntimeError(f"completion: HTTP {status}: {body[:300]}")
        return round(start - t0, 4), round(time.perf_counter() - start, 5), status

    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    time.sleep(STATS_WAIT_S)
    after = sources(gpu_counters.Page(vllm_page(eng.port)))
    ttft = sorted(r[1] for r in rows)
    return {"concurrency": concurrency, "requests": len(prompts), "tokens": len(prompts[0]), "wall_s": round(wall, 3),
            "ttft_s": [r[1] for r in rows], "started_s": [r[0] for r in rows],
            "ttft_mean_s": round(sum(ttft) / len(ttft), 5), "ttft_p50_s": ttft[len(ttft) // 2],
            "ttft_p95_s": ttft[min(len(ttft) - 1, math.ceil(0.95 * len(ttft)) - 1)],
            **{k: after[k] - before[k] for k in after}}


LOAD_MODES = ("repeat", "again")


def load_steps(spec: str) -> list[tuple[int, int, tuple[str, ...]]]:
    """--load C:N[:repeat][:again],...: (concurrency, prompts, modes) per step, modes in the order they run."""
    steps = []
    for part in spec.split(","):
        c, n, *modes = part.split(":")
        bad = [m for m in modes if m not in LOAD_MODES]
        if bad or len(set(modes)) != len(modes):
            raise ValueError(f"--load {part!r}: modes are {', '.join(LOAD_MODES)}, each at most once")
        steps.append((int(c), int(n), tuple(m for m in LOAD_MODES if m in modes)))
    return steps


def run_load(eng: Engine, spec: str, tokens: int, seed: int, out_dir: Path, tag: str) -> dict[str, Any]:
    """--load C:N[:repeat][:again],...: each step N cold prompts at C in flight; with `repeat`, the same prompts again
    at once (no reset: those the GPU tier evicted while the step ran come back from the offload tiers, the eager or
    the lazy store's test); with `again`, then a reset of the GPU prefix cache and its prompts again (hits from the
    offload tiers, or recomputed); then 5 s idle. vLLM's pages over all of it go to out_dir/series/<tag>.jsonl."""
    steps = load_steps(spec)
    sampler = PageSampler(eng.port)
    sampler.start()
    res: dict[str, Any] = {"steps": []}
    try:
        for k, (conc, n, modes) in enumerate(steps):
            prompts = [prompt(seed + 7919 * (k + 1) + i, tokens) for i in range(n)]
            t_start = time.time()
            step = {"cold": load_phase(eng, prompts, conc), "t_start": t_start, "t_end": time.time()}
            if "repeat" in modes:
                step["repeat"] = load_phase(eng, prompts, conc)
            if "again" in modes:
                step["reset"] = eng.reset_prefix_cache()
                step["again"] = load_phase(eng, prompts, conc)
            res["steps"].append(step)
            log(f"{tag}: load {conc}x{n}: cold mean {step['cold']['ttft_mean_s']:.3f}s p95 "
                f"{step['cold']['ttft_p95_s']:.3f}s"
                + "".join(f"; {m} mean {step[m]['ttft_mean_s']:.3f}s, external "
                          f"{step[m]['external_kv_transfer']:.0f}, GPU hit {step[m]['local_cache_hit']:.0f} "
                          f"of {n * tokens} tokens" for m in modes))
        time.sleep(5)
    finally:
        sampler.halt.set()
        sampler.join(5)
        (out_dir / "series").mkdir(parents=True, exist_ok=True)
        with open(out_dir / "series" / f"{tag}.jsonl", "w") as f:
            for ts, text in sampler.pages:
                f.write(json.dumps({"t": round(ts, 3), "page": text}) + "\n")
        res["pages"] = len(sampler.pages)
    return res


def reset_succeeded(body: str) -> bool:
    """vLLM's answer to POST /reset_prefix_cache: {"success": bool} (0.26.0); an empty body (older
    vLLM, no verdict) counts as success."""
    try:
        return bool(json.loads(body).get("success", True)) if body.strip() else True
    except (ValueError, AttributeError):
        return True


def output_tokens(body: str) -> list[int] | None:
    """The generated token ids of a /v1/completions answer (return_token_ids), None if absent."""
    try:
        ids = json.loads(body)["choices"][0].get("token_ids")
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return [int(x) for x in ids] if isinstance(ids, list) else None


def lmcache_text(multiproc_dir: str | None) -> str:
    if not multiproc_dir or not os.path.isdir(multiproc_dir) or not glob.glob(f"{multiproc_dir}/*.db"):
        return ""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=multiproc_dir)
    text = generate_latest(reg).decode()
    return "\n".join(ln for ln in text.splitlines() if "lmcache:" in ln) + "\n"


def scan_disk(path: str) -> tuple[int, int, int]:
    total = files = 0
    for dirpath, _dirs, names in os.walk(path):
        for n in names:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            if not os.path.islink(os.path.join(dirpath, n)) and os.path.isfile(os.path.join(dirpath, n)):
                total += st.st_size
                files += 1
    vfs = os.statvfs(path)
    return total, files, vfs.f_bavail * vfs.f_frsize


QUIET_S = 2.0  # the disk dir counts as quiet after this long without a change (--quiet-s)
REQUEST_TIMEOUT_S = 300.0  # one completion (--request-timeout)
STATS_WAIT_S = 0.3  # after a response, for vLLM to publish the request's counters (--stats-wait-s)


def wait_disk_quiet(path: str, deadline_s: float = 60, still_s: float | None = None) -> float:
    """Until the disk dir stops changing (LMCache writes chunks asynchronously). Returns the wall-clock
    time of the last change on disk (newest mtime of the directory and its files)."""
    end = time.monotonic() + deadline_s
    last, since = None, time.monotonic()
    while time.monotonic() < end:
        now = scan_disk(path)[:2]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= (QUIET_S if still_s is None else still_s):
            break
        time.sleep(0.5)
    newest = 0.0
    for dirpath, _dirs, names in os.walk(path):
        for n in [None, *names]:
            try:
                newest = max(newest, os.lstat(dirpath if n is None else os.path.join(dirpath, n)).st_mtime)
            except OSError:
                pass
    return newest


def engine_read(port: int, multiproc_dir: str | None, disk_dir: str | None,
                status_url: str | None = None) -> gpu_counters.EngineRead:
    v = vllm_page(port)
    lm = lmcache_text(multiproc_dir)
    srv = server_status(status_url)
    if disk_dir and os.path.isdir(disk_dir):
        b, f, free = scan_disk(disk_dir)
        return gpu_counters.EngineRead(v, lm, b, f, free, server=srv)
    return gpu_counters.EngineRead(v, lm, server=srv)


def start_sidecar(sc: gpu_manifests.Sidecar, tag: str, logdir: Path,
                  deadline_s: float) -> tuple[subprocess.Popen, str | None, float]:
    """A native sidecar as its own process group and cgroup; ready when its startup probe passes."""
    cg = cgroup_make(f"kvbench-{tag}-{sc.name}")
    p = spawn(sc.argv, {**os.environ, **BASE_ENV, **sc.env}, logdir / f"{tag}-{sc.name}.log", cg)
    t0 = time.monotonic()
    while sc.probe:
        if p.poll() is not None:
            raise RuntimeError(f"sidecar {sc.name} exited with {p.returncode} before its startup probe passed")
        if subprocess.run(sc.probe, capture_output=True, timeout=30).returncode == 0:
            break
        if time.monotonic() - t0 > deadline_s:
            raise RuntimeError(f"sidecar {sc.name}: startup probe still failing after {deadline_s:.0f} s")
        time.sleep(0.5)
    return p, cg, round(time.monotonic() - t0, 1)


def log_lines_between(logfile: Path, start: int) -> str:
    with open(logfile, "rb") as fh:
        fh.seek(start)
        return fh.read().decode("utf-8", "replace")


DISK_READ = re.compile(r"Disk read size: (\d+) bytes")
RETRIEVED = re.compile(r"Retrieved (\d+) out of (\d+) required tokens.*?size: ([\d.]+) gb, cost ([\d.]+) ms, "
                       r"throughput: ([\d.]+) GB/s")
STORED = re.compile(r"Stored (\d+) out of total \d+ tokens.*?cost ([\d.]+) "
                    r"ms.*?offload_time: ([\d.]+) ms, put_time: ([\d.]+) ms")
PREFETCH = re.compile(r"Prefetching (\d+) keys from disk")
HIT = re.compile(r"LMCache hit tokens: (\d+), need to load: (\d+)")


def lmcache_log_facts(text: str) -> dict[str, Any]:
    reads = [int(x) for x in DISK_READ.findall(text)]
    retrieved = [{"tokens": int(a), "required": int(b), "gb": float(c), "ms": float(d), "gbps": float(e)}
                 for a, b, c, d, e in RETRIEVED.findall(text)]
    return {"disk_read_lines": len(reads), "disk_read_bytes": sum(reads), "retrieved": retrieved,
            "disk_prefetch_keys": sum(int(x) for x in PREFETCH.findall(text)),
            "hits": [{"hit": int(a), "load": int(b)} for a, b in HIT.findall(text)]}


SERVER_STRATEGY = re.compile(r"Using (\w+) non-GPU transfer strategy")
SERVER_STORED = re.compile(r"Stored (\d+) tokens in ([\d.]+) seconds")
SERVER_RETRIEVED = re.compile(r"Retrieved (\d+) tokens in ([\d.]+) seconds")


def server_log_facts(text: str) -> dict[str, Any]:
    """What the LMCache server (lmcache-server backend) logged: how KV travels (shm or pickle) and
    its store/retrieve times."""
    def rows(rx: re.Pattern) -> list[dict[str, float]]:
        return [{"tokens": int(a), "s": float(b)} for a, b in rx.findall(text)]
    return {"transfer": SERVER_STRATEGY.findall(text), "stored": rows(SERVER_STORED),
            "retrieved": rows(SERVER_RETRIEVED),
            "errors": len(re.findall(r"LMCache ERROR", text))}


def per_worker(text: str) -> dict[str, dict[str, float]]:
    """LMCache's own per-rank figures (worker_id label): the split of the tiers over TP ranks."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in gpu_counters.parse_text(text):
        short = name.removeprefix("lmcache:")
        if short in ("local_cache_usage", "local_storage_usage", "num_stored_tokens_total",
                     "local_cpu_evict_keys_count_total", "num_hit_tokens_total", "num_requested_tokens_total"):
            w = out.setdefault(labels.get("worker_id", "?"), {})
            w[short] = w.get(short, 0.0) + value
    return out


def disk_by_worker(path: str) -> dict[str, dict[str, int]]:
    """Chunk files per TP rank: LMCache names them <model>@<world_size>@<worker_id>@<hash>@<dtype>.pt."""
    out: dict[str, dict[str, int]] = {}
    for dirpath, _dirs, names in os.walk(path):
        for n in names:
            parts = n.split("@")
            w = parts[2] if len(parts) >= 4 else "?"
            d = out.setdefault(w, {"files": 0, "bytes": 0})
            d["files"] += 1
            try:
                d["bytes"] += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return out


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- one engine run

def engine_additions(args: argparse.Namespace) -> dict[str, Any]:
    """What a measurement adds to the rendered vLLM (gpu_manifests.engine_args; each a listed change)."""
    return {"extra_args": [w for a in args.engine_arg for w in a.split()],
            "kv_extra": json.loads(args.kv_extra) if args.kv_extra else None}


def overrides_for(kind: str, args: argparse.Namespace) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The disk run's LMCache overrides and every run's extra engine env."""
    extra = dict(kv.split("=", 1) for kv in args.engine_env)
    overrides = json.loads(args.lmcache_overrides) if args.lmcache_overrides else None
    if kind == "disk":
        overrides = {**(overrides or {}), "max_local_cpu_size": args.disk_cpu_gib,
                     "extra_config": {**((overrides or {}).get("extra_config") or {}), "use_odirect": True}}
        extra["LMCACHE_LOG_LEVEL"] = "DEBUG"
    return overrides, extra


class HostTarget:
    """The rendered pod's containers as local processes on this host (gpu_manifests.localize)."""

    def __init__(self, kind: str, rendered: gpu_manifests.Rendered, cfg: dict[str, Any], args: argparse.Namespace,
                 tag: str) -> None:
        work = Path(args.work)
        self.args, self.tag = args, tag
        self.disk_dir = f"{args.disk_root}/kvbench-{tag}/{rendered.namespace}/{rendered.name}/{rendered.name}-0"
        self.disk_root = f"{args.disk_root}/kvbench-{tag}"
        self.layout = gpu_manifests.Layout(root=str(work / tag), model_dir=str(work / "model"), disk_dir=self.disk_dir,
                                           port=free_port(), exporter_port=free_port(), python=args.python)
        self.connector = kind != "baseline"
        overrides, extra = overrides_for(kind, args)
        self.run = run = gpu_manifests.localize(rendered, self.layout, connector=self.connector, model_config=cfg,
                                                lmcache_overrides=overrides, extra_env=extra,
                                                **engine_additions(args))
        self.port, self.exporter_port = self.layout.port, self.layout.exporter_port
        self.multiproc_dir = run.multiproc_dir
        self.lmcache = run.lmcache
        self.status_url = gpu_manifests.flag(run.exporter_argv or [], "--lmcache-server-url") if run.sidecars else None
        self.engine_argv = run.engine_argv
        self.served_model = gpu_manifests.flag(run.engine_argv, "--served-model-name") or self.layout.model_dir
        self.describe = {"changes": run.changes, "argv": run.engine_argv, "env": run.engine_env,
                         "lmcache": run.lmcache if self.connector else None, "exporter_argv": run.exporter_argv,
                         "sidecars": [{"name": sc.name, "argv": sc.argv, "memory_limit": sc.memory_limit}
                                      for sc in run.sidecars]}
        self.proc: subprocess.Popen | None = None
        self.exporter: subprocess.Popen | None = None
        self.side: list[tuple[gpu_manifests.Sidecar, subprocess.Popen, str | None, MemSampler]] = []
        self.engine_cgroup: str | None = None
        self.logdir = Path(args.out) / "logs"
        self.elog = self.logdir / f"{tag}-engine.log"

    def prepare(self, res: dict[str, Any]) -> None:
        for d in self.run.fresh_dirs:
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d, exist_ok=True)
        for path, text in self.run.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        res["init"] = []
        for argv in self.run.init_argvs:
            r = subprocess.run(argv, env={**os.environ, **BASE_ENV}, capture_output=True, text=True, timeout=300)
            res["init"].append({"argv0": argv[:3], "rc": r.returncode, "output": (r.stdout + r.stderr)[-500:]})
            log(f"{self.tag}: init {r.returncode}: {(r.stdout + r.stderr).strip()[-200:]}")
        self.engine_cgroup = cgroup_make(f"kvbench-{self.tag}")
        res["cgroup"] = self.engine_cgroup

    def start_sidecars(self, res: dict[str, Any]) -> None:
        for sc in self.run.sidecars:
            log(f"{self.tag}: starting sidecar {sc.name}")
            p, scg, ready = start_sidecar(sc, self.tag, self.logdir, self.args.start_timeout / 2)
            ms = MemSampler(scg)
            ms.start()
            self.side.append((sc, p, scg, ms))
            res.setdefault("sidecar_ready_s", {})[sc.name] = ready
            log(f"{self.tag}: sidecar {sc.name} ready after {ready} s")

    def start_engine(self) -> subprocess.Popen:
        self.proc = spawn(self.run.engine_argv, {**os.environ, **BASE_ENV, **self.run.engine_env}, self.elog,
                          self.engine_cgroup)
        return self.proc

    def engine_pids(self) -> list[int]:
        return tree_pids(self.proc.pid) if self.proc else []

    def start_exporter(self) -> subprocess.Popen | None:
        if not self.run.exporter_argv:
            return None
        self.exporter = spawn(self.run.exporter_argv, {**os.environ, **self.run.exporter_env},
                              self.logdir / f"{self.tag}-exporter.log")
        return self.exporter

    def stop_exporter(self) -> None:
        if self.exporter is not None:
            stop(self.exporter, grace=5)
        self.exporter = None

    def sidecar_facts(self) -> dict[str, Any]:
        return {sc.name: {"cgroup": cgroup_stat(scg), **rss_bytes(tree_pids(p.pid))} for sc, p, scg, _ms in self.side}

    def stop(self, res: dict[str, Any]) -> None:
        self.stop_exporter()
        if self.proc is not None:
            stop(self.proc, grace=30)
        for sc, p, scg, ms in self.side:
            stop(p, grace=10)
            ms.halt.set()
            ms.join(5)
            res.setdefault("sidecar_memory", {})[sc.name] = {"limit": sc.memory_limit, **ms.summary()}

    def cleanup(self) -> None:
        for c in [self.engine_cgroup, *(scg for _sc, _p, scg, _ms in self.side)]:
            if c:
                try:
                    os.rmdir(c)
                except OSError:
                    pass
        shutil.rmtree(self.disk_root, ignore_errors=True)


def run_engine(kind: str, rendered: gpu_manifests.Rendered, cfg: dict[str, Any], args: argparse.Namespace,
               out: dict[str, Any]) -> None:
    tag = f"{kind}-tp{rendered.tp}{args.tag_suffix}"
    if args.runtime == "crun":
        import gpu_pod
        target = gpu_pod.PodTarget(kind, rendered, cfg, args, tag, BASE_ENV, sys.modules[__name__])
    else:
        target = HostTarget(kind, rendered, cfg, args, tag)
    connector = kind != "baseline"
    disk_dir, status_url = target.disk_dir, target.status_url
    res: dict[str, Any] = {"kind": kind, "tp": rendered.tp, "backend": rendered.backend, "runtime": args.runtime,
                           "memory_limit": rendered.vllm.memory_limit, **target.describe}
    out["runs"][tag] = res
    kv_bpt = gpu_manifests.kv_bytes_per_token(cfg, gpu_manifests.flag(target.engine_argv, "--kv-cache-dtype") or "auto")
    res["kv_bytes_per_token"] = kv_bpt
    t0 = time.monotonic()
    sampler: MemSampler | None = None
    try:
        target.prepare(res)
        sampler = MemSampler(target.engine_cgroup)
        sampler.start()
        target.start_sidecars(res)
        if status_url:
            res["server_status_start"] = server_status(status_url)
        log(f"{tag}: starting vLLM on 127.0.0.1:{target.port}")
        proc = target.start_engine()
        wait_http(target.port, "/health", time.monotonic() + args.start_timeout, proc, f"vLLM ({tag})")
        res["start_s"] = round(time.monotonic() - t0, 1)
        log(f"{tag}: healthy after {res['start_s']} s")
        exporter = target.start_exporter()
        if exporter is not None:
            try:  # an exporter that fails is a finding; the engine's figures are still measured
                wait_http(target.exporter_port, "/metrics", time.monotonic() + 60, exporter, "exporter")
            except RuntimeError as exc:
                res["exporter_error"] = str(exc)
                log(f"{tag}: EXPORTER ERROR {exc}")
                target.stop_exporter()
                exporter = None
        eng = Engine(target.port, target.served_model, proc, target.elog, status_url)
        res["memory_healthy"] = {"meminfo": meminfo(), "cgroup": cgroup_stat(target.engine_cgroup),
                                 **rss_bytes(target.engine_pids())}
        eng.complete(prompt(1, 512))  # warm-up, not measured
        n, reps = args.prompt_tokens, args.reps
        seed = {"connector": 100, "baseline": 200, "disk": 300}[kind] + 1000 * rendered.tp
        phases: dict[str, list[dict[str, Any]]] = {}
        res["phases"] = phases  # filled as it goes: what was measured before an error is kept
        if kind in ("connector", "baseline"):
            for r in range(reps):
                p = prompt(seed + r, n)
                phases.setdefault("cold", []).append(eng.complete(p))
                time.sleep(args.gpu_after_s)  # > 0: the cold request's store has time to end first
                phases.setdefault("gpu", []).append(eng.complete(p))
                reset = eng.reset_prefix_cache()
                phases.setdefault("after_reset", []).append({**eng.complete(p), **reset})
                log(f"{tag}: rep {r}: " + ", ".join(f"{k} {v[-1]['ttft_s']:.3f}s (LMCache retrieved "
                                                    f"{v[-1]['lmcache_retrieved_tokens']}, load skipped "
                                                    f"{v[-1]['lmcache_load_skipped_lines']}x)"
                                                    for k, v in phases.items()))
            if args.load:
                res["load"] = run_load(eng, args.load, args.load_tokens, seed, Path(args.out), tag)
        else:
            per_prompt = n * kv_bpt
            cpu_total = float((target.lmcache or {}).get("max_local_cpu_size", 5.0)) * 2**30 * rendered.tp
            n_flush = math.ceil(cpu_total / per_prompt) + 1
            res["flush_prompts"] = n_flush
            proofs = []
            for r in range(reps):
                a = prompt(seed + 10 * r, n)
                phases.setdefault("cold", []).append(eng.complete(a))
                for k in range(n_flush):
                    eng.complete(prompt(seed + 10 * r + 1 + k, n))
                wait_disk_quiet(disk_dir)
                eng.reset_prefix_cache()
                pre = gpu_counters.Page(lmcache_text(target.multiproc_dir))
                dropped = drop_page_cache()
                pids = target.engine_pids()
                io0, blk0, off = proc_read_bytes(pids), block_read_bytes(), target.elog.stat().st_size
                one = eng.complete(a)
                time.sleep(0.5)
                io1, blk1 = proc_read_bytes(target.engine_pids()), block_read_bytes()
                facts = lmcache_log_facts(log_lines_between(target.elog, off))
                phases.setdefault("disk", []).append(one)
                eng.reset_prefix_cache()
                phases.setdefault("after_disk_reset", []).append(eng.complete(a))
                proofs.append({"page_cache_dropped": dropped, "proc_read_bytes": io1 - io0,
                               "block_read_bytes": {k: blk1.get(k, 0) - v for k, v in blk0.items()
                                                    if blk1.get(k, 0) - v},
                               "prompt_kv_bytes": per_prompt, "lmcache_log": facts,
                               "cpu_used_before": pre.sum("lmcache:local_cache_usage"),
                               "cpu_evicted_before": pre.sum("lmcache:local_cpu_evict_keys_count_total"),
                               "disk_used_before": pre.sum("lmcache:local_storage_usage")})
                log(f"{tag}: rep {r}: disk {one['ttft_s']:.3f}s, external {one['external_kv_transfer']:.0f} tok, "
                    f"proc read {(io1 - io0) / 1e9:.2f} GB, LMCache disk reads {facts['disk_read_bytes'] / 1e9:.2f} GB")
            res["disk_proof"] = proofs
        res["phases"] = phases
        res["per_worker"] = per_worker(lmcache_text(target.multiproc_dir))
        if disk_dir and os.path.isdir(disk_dir):
            wait_disk_quiet(disk_dir, deadline_s=20)
            res["disk_by_worker"] = disk_by_worker(disk_dir)
        res["memory_after_phases"] = {"meminfo": meminfo(), "cgroup": cgroup_stat(target.engine_cgroup),
                                      **rss_bytes(target.engine_pids()), "sidecars": target.sidecar_facts()}

        # Exporter vs engine, once the disk tier is quiet and the exporter has rescanned it.
        if exporter is not None:
            quiet = wait_disk_quiet(disk_dir) if disk_dir and os.path.isdir(disk_dir) else time.time()
            end = time.monotonic() + args.rescan_wait
            xtext = ""
            while time.monotonic() < end:
                xtext = http_req(target.exporter_port, "GET", "/metrics")[1]
                ts = gpu_counters.Page(xtext).get("kvoffload_disk_last_rescan_timestamp_seconds")
                if ts is None or ts >= quiet + 0.5:
                    break
                time.sleep(1)
            before = engine_read(target.port, target.multiproc_dir, disk_dir, status_url)
            xtext = http_req(target.exporter_port, "GET", "/metrics")[1]
            after = engine_read(target.port, target.multiproc_dir, disk_dir, status_url)
            checks = gpu_counters.compare(xtext, before, after, kv_bytes_per_token=kv_bpt,
                                          lmcache_config=target.lmcache if connector else None, tp=rendered.tp,
                                          connector=connector, served=True, backend=rendered.backend)
            res["checks"] = [c.to_dict() for c in checks]
            res["per_worker"] = per_worker(after.lmcache)  # after LMCache's stats logger has flushed
            res["disagreements"] = [c.to_dict() for c in gpu_counters.disagreements(checks)]
            (Path(args.out) / "pages").mkdir(exist_ok=True)
            for name, text in (("exporter", xtext), ("vllm", after.vllm), ("lmcache", after.lmcache)):
                Path(args.out, "pages", f"{tag}-{name}.txt").write_text(text)
            if after.server is not None:
                Path(args.out, "pages", f"{tag}-server-status.json").write_text(json.dumps(after.server, indent=1))
                res["server_status_end"] = after.server
            log(f"{tag}: exporter checks: {sum(c.ok is True for c in checks)} agree, "
                f"{len(res['disagreements'])} disagree: " + ", ".join(f"{c['metric']}{{{c['labels']}}}"
                                                                      for c in res["disagreements"]))
    except Exception as exc:  # recorded, then the next run (or the caller) decides
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{tag}: ERROR {res['error']}")
    finally:
        target.stop(res)
        res["gpu_free_wait_s"] = wait_gpus_free()
        if sampler is not None:
            sampler.halt.set()
            sampler.join(5)
            res["memory"] = sampler.summary()
            res["memory_trace"] = sampler.trace()
        target.cleanup()
        res["wall_s"] = round(time.monotonic() - t0, 1)
        save(out, args)
        try:
            res["engine_log_tail"] = target.elog.read_text(errors="replace").splitlines()[-40:]
        except OSError:
            pass


# ---------------------------------------------------------------- host probe

def probe(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Pinned host->GPU copy and O_DIRECT disk read on this host (the plan's two bandwidths)."""
    res: dict[str, Any] = {}
    code = ("import torch,time,json;n=4<<30;h=torch.empty(n,dtype=torch.uint8).pin_memory();"
            "d=torch.empty(n,dtype=torch.uint8,device='cuda');"
            "d.copy_(h);torch.cuda.synchronize();t=time.perf_counter();[d.copy_(h,non_blocking=True) for _ in "
            "range(3)];torch.cuda.synchronize();print(json.dumps({'h2d_pinned_Bps':3*n/(time.perf_counter()-t),"
            "'gpus':torch.cuda.device_count(),'name':torch.cuda.get_device_name(0),'torch':torch.__version__}))")
    try:
        r = subprocess.run([args.python, "-c", code], capture_output=True, text=True, timeout=120)
        res.update(json.loads(r.stdout.strip().splitlines()[-1]))
    except Exception as exc:
        res["h2d_error"] = str(exc)
    f = f"{args.disk_root}/kvbench-probe.bin"
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=16M", "count=128", "oflag=direct"],
                       capture_output=True, timeout=120, check=True)
        t = time.perf_counter()
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"], capture_output=True, timeout=120,
                       check=True)
        res["disk_read_odirect_Bps"] = (128 << 24) / (time.perf_counter() - t)
    except Exception as exc:
        res["disk_error"] = str(exc)
    finally:
        try:
            os.remove(f)
        except OSError:
            pass
    try:
        res["df"] = subprocess.run(["df", "-T", args.disk_root], capture_output=True, text=True, timeout=10).stdout
        res["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                            "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout
    except Exception:
        pass
    res["cpus"] = os.cpu_count()
    res["meminfo"] = meminfo()
    res["uname"] = " ".join(os.uname())
    for mod in ("vllm", "lmcache", "torch"):
        r = subprocess.run([args.python, "-c", f"import importlib.metadata as m;print(m.version('{mod}'))"],
                           capture_output=True, text=True, timeout=60)
        res[f"{mod}_version"] = r.stdout.strip() or r.stderr.strip()[-200:]
    out["host"] = res
    log(f"host: {json.dumps({k: v for k, v in res.items() if k not in ('meminfo', 'df')})}")


def smoke(args: argparse.Namespace) -> None:
    """Cheap checks before any engine start: imports of vllm, LMCache's CUDA ops, the exporter."""
    code = ("import torch,vllm,lmcache;import lmcache.c_ops;from lmcache.integration.vllm import vllm_v1_adapter;"
            "import kvoffload.exporter.cli;print('smoke "
            "ok',vllm.__version__,torch.__version__,torch.cuda.device_count())")
    r = subprocess.run([args.python, "-c", code], capture_output=True, text=True, timeout=300)
    log((r.stdout + r.stderr).strip()[-1500:])
    if r.returncode != 0:
        raise SystemExit("smoke failed")


# ---------------------------------------------------------------- main

def save(out: dict[str, Any], args: argparse.Namespace) -> None:
    p = Path(args.out) / "results.json"
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1, sort_keys=True, default=str))
    tmp.replace(p)


def pack_logs(args: argparse.Namespace) -> None:
    """logs/ and pages/ -> one logs.tar.gz (the transport returns few files)."""
    o = Path(args.out)
    with tarfile.open(o / "logs.tar.gz", "w:gz") as tar:
        for sub in ("logs", "pages"):
            if (o / sub).is_dir():
                tar.add(o / sub, arcname=sub)
    for sub in ("logs", "pages"):
        shutil.rmtree(o / sub, ignore_errors=True)


def load_rendered(path: str, python: str) -> gpu_manifests.Rendered:
    text = Path(path).read_text()
    if "kind: KVOffloadServe" in text:
        text = subprocess.run([python, "-m", "kvoffload.cli", "render", "-f", path], capture_output=True, text=True,
                              check=True, timeout=120).stdout
    return gpu_manifests.parse_rendered(text)


def catalog_config(model: str) -> dict[str, Any]:
    try:
        from kvoffload.planning.catalog import resolve_model  # after the layout move
    except ImportError:
        from kvoffload.catalog import resolve_model
    m = resolve_model(model)
    return gpu_manifests.model_config(m.hf_id, m.layers, m.attention_heads, m.kv_heads, m.head_dim, m.max_context,
                                      m.params)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rendered", action="append", default=[],
                    help="rendered manifests (repeatable: one engine set each)")
    ap.add_argument("--runs", default="connector,baseline,disk")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/kvbench")
    ap.add_argument("--disk-root", default="/var/tmp", help="a directory on a real disk (O_DIRECT needs one)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gpu-after-s", type=float, default=0.0, help="pause between the cold and the GPU-hit request")
    ap.add_argument("--disk-cpu-gib", type=float, default=5.0, help="disk run: LMCache max_local_cpu_size per rank")
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--rescan-wait", type=float, default=40, help="max wait for the exporter's disk rescan")
    ap.add_argument("--config-json", help="model config.json to use instead of the catalog's")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="start no engine run later than this many s minus --run-estimate-s")
    ap.add_argument("--run-estimate-s", type=float, default=150)
    ap.add_argument("--quiet-s", type=float, default=2.0, help="disk dir quiet after this long unchanged")
    ap.add_argument("--request-timeout", type=float, default=300, help="longest wait for one completion")
    ap.add_argument("--stats-wait-s", type=float, default=0.3, help="wait after a response before reading counters")
    ap.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for every engine (recorded as a change)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="ARGS",
                    help="vLLM arguments added to the rendered ones (split on spaces; recorded as a change)")
    ap.add_argument("--kv-extra", metavar="JSON",
                    help="merged into the rendered --kv-transfer-config's kv_connector_extra_config (recorded)")
    ap.add_argument("--load", metavar="C:N[:repeat][:again][,...]",
                    help="after the phases: for each C:N, N cold requests of --load-tokens with C in flight "
                         "(:repeat: the same prompts again at once; :again: after a reset of the GPU prefix cache), "
                         "vLLM's /metrics sampled")
    ap.add_argument("--load-tokens", type=int, default=8192)
    ap.add_argument("--tag-suffix", default="", help="appended to run names (e.g. -v1runner)")
    ap.add_argument("--lmcache-overrides", help="JSON merged into the rendered LMCache config (recorded as a change)")
    ap.add_argument("--runtime", choices=("host", "crun"), default="host",
                    help="host: local processes; crun: each container under crun with its captured OCI spec (gpu_pod)")
    ap.add_argument("--oci", action="append", default=[], metavar="DIR",
                    help="--runtime crun: the captured specs of each --rendered pod, in the same order")
    ap.add_argument("--crun", default="crun", help="the crun binary (--runtime crun)")
    ap.add_argument("--oci-template", metavar="FILE",
                    help="--runtime crun, no capture of these pods: each "
                         "container's spec derived from this captured spec")
    ap.add_argument("--oci-other-shape", action="store_true",
                    help="--runtime crun: the captures are of pods of another backend (mounts added/dropped, listed)")
    ap.add_argument("--oci-alias", action="append", default=[], metavar="RENDERED=CAPTURED",
                    help="--runtime crun: use the captured spec of container "
                         "CAPTURED for the rendered container RENDERED")
    ap.add_argument("--keep-volume", action="append", default=[], metavar="VOLUME",
                    help="--runtime crun: an emptyDir kept across runs "
                         "(home: vLLM's compile cache; recorded as a change)")
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--probe-only", action="store_true", help="host facts and bandwidths only, no engine")
    ap.add_argument("--no-smoke", action="store_true")
    args = ap.parse_args(argv)
    global QUIET_S, STATS_WAIT_S, REQUEST_TIMEOUT_S
    QUIET_S, STATS_WAIT_S, REQUEST_TIMEOUT_S = args.quiet_s, args.stats_wait_s, args.request_timeout
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    atexit.register(_kill_all)
    Path(args.out, "logs").mkdir(parents=True, exist_ok=True)
    os.makedirs(args.disk_root, exist_ok=True)
    out: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args),
                           "runs": {}}
    try:
        if not args.no_smoke and not args.probe_only:
            smoke(args)
        if not args.no_probe:
            probe(args, out)
            save(out, args)
        if args.probe_only:
            return 0
        if args.runtime == "crun":
            import gpu_pod
            if len(args.oci) != len(args.rendered) and not args.oci_template:
                raise SystemExit("--runtime crun: one --oci DIR per --rendered file, or --oci-template")
            gpu_pod.SANDBOX.update(gpu_pod.enter_sandbox("kvbench"))
            out["oci_host"] = gpu_pod.host_facts().__dict__
        for i, path in enumerate(args.rendered):
            args.oci_dir = args.oci[i] if args.oci else None
            rendered = load_rendered(path, args.python)
            cfg = json.loads(Path(args.config_json).read_text()) if args.config_json else catalog_config(
                gpu_manifests.flag(gpu_manifests.exec_argv(rendered.vllm)[0], "--served-model-name")
                or gpu_manifests.exec_argv(rendered.vllm)[0][2])
            for kind in args.runs.split(","):
                if args.budget_s and time.monotonic() - T0 + args.run_estimate_s > args.budget_s:
                    log(f"{kind}-tp{rendered.tp}{args.tag_suffix}: skipped, not enough of --budget-s left")
                    out.setdefault("skipped", []).append(f"{kind}-tp{rendered.tp}{args.tag_suffix}")
                    continue
                run_engine(kind, rendered, cfg, args, out)
                if "start_s" not in out["runs"][f"{kind}-tp{rendered.tp}{args.tag_suffix}"]:
                    log("engine did not start: skipping the remaining runs")
                    return 1
    finally:
        out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        save(out, args)
        pack_logs(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
