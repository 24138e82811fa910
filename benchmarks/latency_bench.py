"""Single-resource latency of the operator on a real control plane (not part of `make test`).

One KVOffloadServe at a time is created in an otherwise idle dedicated cluster (its own state dir;
8 kwok GPU nodes), with the operator running as a subprocess scoped to the namespace. Watches on the
KVOffloadServe and on its four child kinds timestamp, from the create request:
  first status   the first status the operator writes (conditions present, Ready not yet True)
  children       the ConfigMap, both Services, the StatefulSet and the PDB all exist
  current        status.observedGeneration == metadata.generation and Ready True (the pod runs on a
                 kwok node; observedGeneration only moves once the generation is rolled out)
Then the resource is deleted and the next run waits until its pod and children are gone.
p50/p99 over --runs (default 50).

    .venv/bin/python benchmarks/latency_bench.py [--runs 50] [--state-dir DIR] [--keep] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import scale_bench as sb  # same directory: cluster helpers, the spec

import kvtest
from kvtest import OperatorProcess, sentinel

CHILD_WATCHES = (("ConfigMap", "configmaps"), ("Service", "services"), ("StatefulSet", "statefulsets"),
                 ("PodDisruptionBudget", "poddisruptionbudgets"))
EXPECTED = {"ConfigMap": 1, "Service": 2, "StatefulSet": 1, "PodDisruptionBudget": 1}


class Recorder:
    """Watches that stamp, per resource name, the monotonic time of each milestone."""

    def __init__(self, c: kvtest.Cluster, ns: str) -> None:
        self.ns, self.lock = ns, threading.Lock()
        self.first_status: dict[str, float] = {}
        self.current: dict[str, float] = {}
        self.kids: dict[str, dict[str, set[str]]] = {}
        self.children: dict[str, float] = {}
        self.stop = threading.Event()
        self.client = c.client
        self.threads = [threading.Thread(target=self._serves, daemon=True)]
        self.threads += [threading.Thread(target=self._children, args=spec, daemon=True) for spec in CHILD_WATCHES]
        for t in self.threads:
            t.start()

    def _loop(self, resource: str, handle, labels: str | None = None) -> None:
        while not self.stop.is_set():
            try:
                for kind, obj in self.client.watch(resource, self.ns, labels=labels, timeout=60):
                    handle(kind, obj, time.monotonic())
                    if self.stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - reconnect
                time.sleep(0.1)

    def _serves(self) -> None:
        def handle(_kind: str, obj: dict[str, Any], now: float) -> None:
            name, st = obj["metadata"]["name"], obj.get("status") or {}
            with self.lock:
                if st.get("conditions"):
                    self.first_status.setdefault(name, now)
                if sb.current(obj):
                    self.current.setdefault(name, now)
        self._loop(f"{sb.PLURAL}.{sb.GROUP}", handle)

    def _children(self, kind: str, resource: str) -> None:
        def handle(event: str, obj: dict[str, Any], now: float) -> None:
            owner = (obj["metadata"].get("labels") or {}).get(sb.OWNER_LABEL)
            if not owner or event == "DELETED":
                return
            with self.lock:
                seen = self.kids.setdefault(owner, {}).setdefault(kind, set())
                seen.add(obj["metadata"]["name"])
                if all(len(self.kids[owner].get(k, ())) == n for k, n in EXPECTED.items()):
                    self.children.setdefault(owner, now)
        self._loop(resource, handle, labels=sb.OWNER_LABEL)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of the measured values."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvo-latency-"))
    state_dir = Path(args.state_dir or workdir / "cluster")
    out: dict[str, Any] = {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                           "machine": f"{os.cpu_count()} cores", "params": vars(args), "load_before": sb.loadavg()}
    c = kvtest.Cluster(dir=state_dir)
    op = None
    try:
        c = sb.fresh_cluster(state_dir, args.gpu_nodes)
        ns = "latency"
        sb.make_namespaces(c, [ns])
        sentinel(c.client, ns)
        op = OperatorProcess(c.env, [ns], {"resyncSeconds": 300}, log_path=workdir / "operator.log")
        op.wait_started()
        rec = Recorder(c, ns)
        time.sleep(2)  # watches established
        results = []
        for i in range(args.runs):
            name = f"lat-{i:03d}"
            body = {"apiVersion": f"{sb.GROUP}/{sb.VERSION}", "kind": "KVOffloadServe", "metadata": {"name": name},
                    "spec": sb.SPEC}
            t0 = time.monotonic()
            c.client.create(body, ns)
            kvtest.wait_until(lambda: name in rec.current and name in rec.children, timeout=60, interval=0.01,
                                 message=f"{name} current")
            with rec.lock:
                results.append({"first_status": rec.first_status.get(name, rec.current[name]) - t0,
                                "children": rec.children[name] - t0,
                                "current": max(rec.current[name], rec.children[name]) - t0})
            c.client.delete(f"{sb.PLURAL}.{sb.GROUP}", name, ns)
            kvtest.wait_until(lambda: not c.client.list("pods", ns, labels={sb.OWNER_LABEL: name})
                              and not c.client.list("configmaps", ns, labels={sb.OWNER_LABEL: name}),
                              timeout=60, interval=0.1, message=f"{name} cleaned up")
            if i % 10 == 0:
                print(f"[latency] run {i}: {results[-1]}", flush=True)
        rec.stop.set()
        for key in ("first_status", "children", "current"):
            values = [r[key] for r in results]
            out[key] = {"p50_ms": round(1000 * statistics.median(values)), "p99_ms": round(1000 * pct(values, 99)),
                        "max_ms": round(1000 * max(values)), "min_ms": round(1000 * min(values))}
        out["runs"] = len(results)
        out["load_after"] = sb.loadavg()
    finally:
        if op is not None:
            op.stop()
        if not args.keep:
            c.down()
            if not args.state_dir:
                shutil.rmtree(state_dir, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--gpu-nodes", type=int, default=8)
    ap.add_argument("--state-dir", help="cluster state dir (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="leave the benchmark cluster running")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    out = run(args)
    text = json.dumps(out, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
