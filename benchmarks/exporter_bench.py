"""Benchmark of `kvoffload exporter` against its budget: scrape p50 <= 20 ms with 100,000 chunk
files in the disk-tier directory, RSS <= 60 MiB, <= 1 % of a core at one scrape every 15 s.

It creates N small files in a temp dir, serves the real vLLM 0.33.0 sample on 127.0.0.1, copies
the real LMCache 0.5.6 multiprocess files, runs the exporter as a subprocess
(`python -m kvoffload.exporter`, or `kvoffload exporter` with --via-cli; on 127.0.0.1), then measures
  - scrape latency: sequential GET /metrics, a new TCP connection each (Prometheus-like worst case);
  - RSS of the exporter process (VmRSS now, VmHWM peak since start);
  - CPU: the exporter's utime+stime over a window with one scrape every --cpu-interval seconds
    (background disk rescans included), optionally while files churn in the directory.
Files are made an hour old (settled, as in a serving pod) unless --fresh-files.

    .venv/bin/python benchmarks/exporter_bench.py [--files 100000] [--scrapes 200]
        [--cpu-window 60] [--cpu-interval 15] [--churn 0] [--rescan-interval 30] [--fresh-files]
        [--via-cli]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from kvtest.exporter import ExporterProcess, FakeVllm

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
CACHE_CONFIG_INFO = ('# TYPE vllm:cache_config_info gauge\n'
                     'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n')
TICKS = os.sysconf("SC_CLK_TCK")


def scrape(port: int) -> tuple[float, str]:
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    return time.perf_counter() - start, body


def metric(body: str, name: str) -> float | None:
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def rss_mib(pid: int) -> tuple[float, float]:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024


def machine() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor())
    return (f"{os.cpu_count()} CPU ({model}), Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}")


def churn(directory: Path, per_second: float, stop: threading.Event) -> None:
    """LMCache-like activity: write a new chunk file and evict an old one, `per_second` times a second."""
    i = 0
    while not stop.wait(1 / per_second):
        (directory / f"churn-{i}.pt").write_bytes(b"k" * 64)
        if i >= 10:
            (directory / f"churn-{i - 10}.pt").unlink()
        i += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--file-size", type=int, default=64)
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--cpu-window", type=float, default=60.0)
    ap.add_argument("--cpu-interval", type=float, default=15.0)
    ap.add_argument("--churn", type=float, default=0.0, help="files written+evicted per second during the CPU window")
    ap.add_argument("--fresh-files", action="store_true",
                    help="leave the files' mtimes at 'just written' (default: an hour old, as in a "
                         "serving pod): the exporter then lists and stats them all once more")
    ap.add_argument("--via-cli", action="store_true",
                    help="run `python -m kvoffload.cli exporter` (imports every sub-command) instead "
                         "of `python -m kvoffload.exporter`")
    ap.add_argument("--rescan-interval", type=float, default=30.0,
                    help="--disk-rescan-interval (default: the exporter's)")
    opts = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvoffload-bench-"))
    try:
        disk = tmp / "disk"
        disk.mkdir()
        payload = b"k" * opts.file_size
        t0 = time.monotonic()
        old = time.time() - 3600
        for i in range(opts.files):
            chunk = disk / f"vllm@llama-8b@2@0@{i:016x}@bfloat16.pt"
            chunk.write_bytes(payload)
            if not opts.fresh_files:
                os.utime(chunk, (old, old))
        if not opts.fresh_files:
            os.utime(disk, (old, old))
        print(f"created {opts.files} files in {time.monotonic() - t0:.1f}s")
        mp = tmp / "multiproc"
        shutil.copytree(FIXTURES / "lmcache-0.5.6-metrics-sample" / "multiproc", mp)
        vllm_text = (FIXTURES / "vllm-0.33.0-metrics-sample" / "exposition.txt").read_text() + CACHE_CONFIG_INFO

        with FakeVllm(vllm_text) as vllm, ExporterProcess([
                "--vllm-metrics-url", vllm.url, "--multiproc-dir", str(mp), "--disk-dir", str(disk),
                "--tensor-parallel-size", "1", "--kv-bytes-per-token", "131072",
                "--disk-rescan-interval", str(opts.rescan_interval)], via_cli=opts.via_cli) as exporter:
            pid, port = exporter.proc.pid, exporter.port
            t0 = time.monotonic()
            while metric(scrape(port)[1], "kvoffload_disk_files") != opts.files:  # first full scan
                time.sleep(0.2)
            first_scan = time.monotonic() - t0
            for _ in range(5):
                scrape(port)  # warm-up

            latencies = []
            for _ in range(opts.scrapes):
                elapsed, body = scrape(port)
                latencies.append(elapsed * 1000)
            assert metric(body, "kvoffload_disk_files") == opts.files
            assert 'kvoffload_source_up{source="vllm"} 1.0' in body
            latencies.sort()
            p50 = statistics.median(latencies)
            p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
            rss_after_scrapes, peak = rss_mib(pid)

            stop = threading.Event()
            if opts.churn:
                threading.Thread(target=churn, args=(disk, opts.churn, stop), daemon=True).start()
            cpu0, wall0 = cpu_seconds(pid), time.monotonic()
            next_scrape = wall0
            while (now := time.monotonic()) < wall0 + opts.cpu_window:
                if now >= next_scrape:
                    scrape(port)
                    next_scrape += opts.cpu_interval
                time.sleep(min(0.5, max(0.0, next_scrape - time.monotonic())))
            cpu_pct = 100 * (cpu_seconds(pid) - cpu0) / (time.monotonic() - wall0)
            stop.set()
            rss_end, peak = rss_mib(pid)

        result = {
            "machine": machine(),
            "files": opts.files,
            "first_full_scan_s": round(first_scan, 2),
            "scrapes": opts.scrapes,
            "scrape_ms_p50": round(p50, 2),
            "scrape_ms_p99": round(p99, 2),
            "scrape_ms_max": round(latencies[-1], 2),
            "rss_mib_after_scrapes": round(rss_after_scrapes, 1),
            "rss_mib_end": round(rss_end, 1),
            "rss_mib_peak": round(peak, 1),
            "cpu_window_s": opts.cpu_window,
            "cpu_scrape_interval_s": opts.cpu_interval,
            "disk_rescan_interval_s": opts.rescan_interval,
            "churn_files_per_s": opts.churn,
            "fresh_files": opts.fresh_files,
            "entry_point": "python -m kvoffload.cli exporter" if opts.via_cli else "python -m kvoffload.exporter",
            "cpu_percent_of_one_core": round(cpu_pct, 3),
        }
        print(json.dumps(result, indent=2))
        ok = p50 <= 20 and peak <= 60 and cpu_pct <= 1
        print("targets (p50 <= 20 ms, RSS <= 60 MiB, CPU <= 1 %):", "MET" if ok else "NOT MET")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
