"""Issue 36: each autoscaling target's PromQL, as the operator renders it for KEDA (rendering/autoscaling.py), evaluated
by a REAL Prometheus (/usr/bin/prometheus) on vLLM's own /metrics pages sampled every 0.5 s while gpu_bench's --load
ran on the H200 (series/<tag>.jsonl). The pages are backfilled with `promtool tsdb create-blocks-from openmetrics`,
each sample carrying the labels the chart's PodMonitor gives (namespace, pod, kvoffload_io_serve), so the queries run
unchanged; Prometheus answers each at every second of the run.

What it reports, per run and target: the value while 16 requests were in flight on the engine and while 8 were (what
each of two replicas sees when a router spreads the same 16: AverageValue divides the service's sum by its replicas,
and the queue-time quantile of two such replicas is theirs), after the load (it must read 0, not NaN), and the
replicas the HPA controller would ask for at each (its formula, 10 % tolerance) against the example's targets.

    python benchmarks/gpu/autoscaling_eval.py RESULTS_DIR... --out benchmarks/gpu/results/h200-autoscaling-signals
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "tests" / "support")]
from kvoffload.rendering import autoscaling  # noqa: E402
from kvtest.prometheus import Prometheus  # noqa: E402

NAMESPACE = "bench"
EXAMPLE = ROOT / "examples" / "autoscaling" / "llama31-8b.yaml"


def openmetrics(pages: list[dict[str, Any]], serve: str) -> str:
    """The sampled pages as one OpenMetrics exposition with timestamps: every sample name its own gauge family (so
    histogram buckets and counters keep their names, as Prometheus stores them), in time order, # EOF last."""
    extra = {"namespace": NAMESPACE, "pod": f"{serve}-0", autoscaling.SERVE_LABEL: serve}
    families: dict[str, list[str]] = {}
    for p in pages:
        for fam in text_string_to_metric_families(p["page"] + "\n"):
            for s in fam.samples:
                labels = {**s.labels, **extra}
                text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                families.setdefault(s.name, []).append(f"{s.name}{{{text}}} {s.value} {p['t']:.3f}")
    out = []
    for name, lines in families.items():
        out += [f"# TYPE {name} gauge", *lines]
    return "\n".join(out + ["# EOF"]) + "\n"


def hpa_desired(target: str, value: float, replicas: int, want: float) -> int:
    """kube-controller-manager's count for one KEDA trigger: AverageValue divides the service's value by the
    replicas, Value takes it whole; within 10 % of the target it holds."""
    ratio = (value / replicas if autoscaling.TARGETS[target].per_replica else value) / want
    return replicas if abs(ratio - 1) <= 0.1 else max(1, math.ceil(ratio * replicas))


def evaluate(run_dir: Path, targets: dict[str, float], work: Path) -> list[dict[str, Any]]:
    results = json.loads((run_dir / "results.json").read_text())["runs"]
    rows = []
    for tag, run in results.items():
        series = run_dir / "series" / f"{tag}.jsonl"
        if "load" not in run or not series.exists():
            continue
        pages = [json.loads(line) for line in series.read_text().splitlines() if line.strip()]
        serve = tag.replace(".", "-")
        d = work / serve
        d.mkdir(parents=True)
        (d / "input.om").write_text(openmetrics(pages, serve))
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(d / "input.om"), str(d / "tsdb")],
                       check=True, capture_output=True)
        prom = Prometheus(d, [])
        try:
            deadline = time.monotonic() + 30
            while not prom.api.ready() and time.monotonic() < deadline:
                time.sleep(0.2)
            t0, t1 = pages[0]["t"], pages[-1]["t"]
            sel = f'namespace="{NAMESPACE}",{autoscaling.SERVE_LABEL}="{serve}"'
            steps = run["load"]["steps"]
            for field, want in targets.items():
                q = autoscaling.TARGETS[field].query(sel)
                status, body = prom.api.get("/api/v1/query_range", query=q, start=f"{t0:.3f}", end=f"{t1:.3f}",
                                            step="1")
                doc = json.loads(body)
                assert status == 200 and doc["status"] == "success", body
                points = [(float(t), float(v)) for r in doc["data"]["result"] for t, v in r["values"]]

                def during(k: int) -> list[float]:
                    a, b = steps[k]["t_start"], steps[k]["t_end"]
                    return [v for t, v in points if a <= t <= b and not math.isnan(v)]

                by_step = {steps[k]["cold"]["concurrency"]: during(k) for k in range(len(steps))}
                row: dict[str, Any] = {"run": tag, "target": field, "want": want, "query": q,
                                       "after": points[-1][1] if points else None}
                for conc, vals in by_step.items():
                    row[f"max_at_{conc}"] = max(vals) if vals else None
                    row[f"median_at_{conc}"] = statistics.median(vals) if vals else None
                    row[f"replicas_at_{conc}"] = hpa_desired(field, max(vals), 1, want) if vals else None
                rows.append(row)
        finally:
            prom.stop()
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    f = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    out = ["| run | target (example's value) | at 16 in flight: median / max | HPA asks | at 8 in flight (each of 2 "
           "replicas): median / max | HPA asks | after the load |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['run']} | {r['target']} ({r['want']:g}) | {f(r.get('median_at_16'))} / {f(r.get('max_at_16'))} "
                   f"| {r.get('replicas_at_16') or '-'} | {f(r.get('median_at_8'))} / {f(r.get('max_at_8'))} | "
                   f"{r.get('replicas_at_8') or '-'} | {f(r['after'])} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="gpu_bench --out directories of --load runs")
    ap.add_argument("--out", required=True, type=Path, help="writes OUT.json and OUT.md")
    args = ap.parse_args(argv)
    import yaml
    targets = yaml.safe_load(EXAMPLE.read_text())["spec"]["autoscaling"]["targets"]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for d in args.runs for r in evaluate(d, targets, Path(tmp) / d.name)]
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(report(rows))
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
