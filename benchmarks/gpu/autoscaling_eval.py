"""Issue 36: each autoscaling target's PromQL, as the operator renders it for KEDA (rendering/autoscaling.py), evaluated
by a REAL Prometheus (/usr/bin/prometheus) on vLLM's own /metrics pages sampled every 0.5 s while gpu_bench's --load
ran on the H200 (series/<tag>.jsonl). The pages are backfilled with `promtool tsdb create-blocks-from openmetrics`,
each sample carrying the labels the chart's PodMonitor gives (namespace, pod, kvoffload_io_serve), so the queries run
unchanged; Prometheus answers each at every second of the run.

What it reports, per run, target and load step: the value's median over the step and at its end, the replicas the
HPA controller would ask for at the median (its formula, 10 % tolerance) against the example's
targets, and the value after the load (it must read 0, not NaN). 8 in flight on one engine is what each of two
replicas sees when a router spreads 16 (AverageValue divides the service's sum by its replicas; the queue-time
quantile of two such replicas is theirs). A step shorter than the queue-time query's rate window (2m) still
holds the step before it.

    python benchmarks/gpu/autoscaling_eval.py RESULTS_DIR... --out benchmarks/gpu/results/h200-autoscaling-signals
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "tests" / "support")]
from kvoffload.rendering import autoscaling  # noqa: E402
from kvtest.keda import hpa_replicas  # noqa: E402
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
    """The HPA's count for one KEDA trigger, at least the example's minReplicas 1."""
    return max(1, hpa_replicas(autoscaling.TARGETS[target].per_replica, value, replicas, want))


def evaluate(run_dir: Path, targets: dict[str, float], work: Path) -> list[dict[str, Any]]:
    path = run_dir / "results.json"  # or results.json.xz, as kept in the repository
    text = path.read_text() if path.exists() else lzma.decompress(path.with_suffix(".json.xz").read_bytes()).decode()
    results = json.loads(text)["runs"]
    rows = []
    for tag, run in results.items():
        series = run_dir / "series" / f"{tag}.jsonl"
        packed = series.with_suffix(".jsonl.xz")  # as kept in the repository
        if "load" not in run or not (series.exists() or packed.exists()):
            continue
        text = series.read_text() if series.exists() else lzma.decompress(packed.read_bytes()).decode()
        pages = [json.loads(line) for line in text.splitlines() if line.strip()]
        serve = tag.replace(".", "-")
        d = work / serve
        d.mkdir(parents=True)
        (d / "input.om").write_text(openmetrics(pages, serve))
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(d / "input.om"), str(d / "tsdb")],
                       check=True, capture_output=True)
        with Prometheus(d, []) as prom:  # it returns once Prometheus is ready, the backfilled blocks loaded
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

                for k, st in enumerate(steps):
                    a, b = st["t_start"], st["t_end"]
                    vals = [v for t, v in points if a <= t <= b and not math.isnan(v)]
                    end = [v for t, v in points if t <= b and not math.isnan(v)]
                    rows.append({"run": tag, "target": field, "want": want, "query": q, "step": k,
                                 "load": f"{st['cold']['concurrency']} in flight, {st['cold']['requests']} requests",
                                 "seconds": round(b - a, 1), "at_end": end[-1] if end else None,
                                 "median": statistics.median(vals) if vals else None,
                                 "replicas": hpa_desired(field, statistics.median(vals), 1, want) if vals else None})
                rows.append({"run": tag, "target": field, "want": want, "query": q, "step": "after",
                             "load": "idle", "at_end": points[-1][1] if points else None})
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    f = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    out = ["| run | target (example's value) | step | s | median over "
           "the step | at its end | HPA asks (1 replica, median) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['run']} | {r['target']} ({r['want']:g}) | {r['load']} | {r.get('seconds', '-')} | "
                   f"{f(r.get('median'))} | {f(r['at_end'])} | {r.get('replicas') or '-'} |")
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
