"""benchmarks/gpu/autoscaling_eval.py on sampled pages of a known shape: the backfill keeps every sample with the
PodMonitor's labels, and the rendered KEDA queries, run by the real Prometheus, give the values put in."""

from __future__ import annotations

import json
import shutil
import sys
import time

import pytest

from kvtest import ROOT
from kvtest.prometheus import PROMETHEUS

sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import autoscaling_eval  # noqa: E402

pytestmark = pytest.mark.skipif(not PROMETHEUS.exists() or not shutil.which("promtool"),
                                reason="/usr/bin/prometheus and promtool are absent (make system-deps)")
LAB = 'engine="0",model_name="m"'
BOUNDS = (0.3, 0.5, 0.8, 1.0)


def page(waiting: float, usage: float, counts: list[float]) -> str:
    lines = [f"vllm:num_requests_waiting{{{LAB}}} {waiting}", f"vllm:kv_cache_usage_perc{{{LAB}}} {usage}"]
    lines += [f'vllm:request_queue_time_seconds_bucket{{{LAB},le="{le}"}} {c}'
              for le, c in zip([*map(str, BOUNDS), "+Inf"], counts)]
    return "\n".join(lines)


def test_the_backfilled_pages_give_each_query_the_load_put_in(tmp_path):
    t0 = time.time() - 3600  # an hour ago, as a run brought back from the GPU host is
    pages, steps, counts = [], [], [0.0] * 5
    # 16 in flight: 8 waiting, 90 % KV, each request waited 0.9 s; 8 in flight: 2 waiting, 50 %, 0.4 s; then idle.
    for k, (conc, waiting, usage, wait) in enumerate(((16, 8, 0.9, 0.9), (8, 2, 0.5, 0.4), (0, 0, 0.0, None))):
        start = t0 + 200 * k
        for i in range(0, 400):  # 200 s at 0.5 s: the rendered 2m rate window fills inside each step
            if wait is not None:
                counts = [c + (4 if wait <= le else 0) for c, le in zip(counts, [*BOUNDS, float("inf")])]
            pages.append({"t": round(start + i / 2, 3), "page": page(waiting, usage, counts)})
        if conc:
            steps.append({"cold": {"concurrency": conc, "requests": 400}, "t_start": start + 130, "t_end": start + 199})
    run = tmp_path / "run"
    (run / "series").mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"runs": {"connector-tp1-x": {"load": {"steps": steps}}}}))
    (run / "series" / "connector-tp1-x.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pages))
    targets = {"waitingRequestsPerReplica": 4, "kvCacheUsagePercent": 85, "queueTimeP90Milliseconds": 500}
    rows = autoscaling_eval.evaluate(run, targets, tmp_path / "work")
    got = {(r["target"], r["step"]): r for r in rows}
    w = [got[("waitingRequestsPerReplica", k)] for k in (0, 1, "after")]
    assert [r["at_end"] for r in w] == [8, 2, 0] and [r["replicas"] for r in w[:2]] == [2, 1]
    assert [got[("kvCacheUsagePercent", k)]["median"] for k in (0, 1)] == [pytest.approx(90), pytest.approx(50)]
    # 0.9 s lies in (0.8, 1.0]: p90 = 0.8 + 0.9 x 0.2 = 0.98 s; 0.4 s in (0.3, 0.5]: 0.48 s
    q = [got[("queueTimeP90Milliseconds", k)] for k in (0, 1, "after")]
    assert [r["at_end"] for r in q] == [pytest.approx(980), pytest.approx(480), 0]  # idle reads 0, not NaN
    assert q[0]["replicas"] == 2  # ceil(980 / 500)
    assert "| connector-tp1-x | queueTimeP90Milliseconds (500) |" in autoscaling_eval.report(rows)
