"""Scale benchmark of the operator on a real control plane (not part of `make test`).

1,000 KVOffloadServes across 50 namespaces, created at once (parallel API creates) against a
dedicated local cluster (its own state dir, ports and etcd; the shared .cluster/ is never touched)
with 130 kwok GPU nodes of 8 GPUs, the operator running as a subprocess:

    python -m kvoffload.cli run --all-namespaces --liveness '' --operator-config FILE

Targets: every resource has all its children (ConfigMap, 2 Services, StatefulSet, PDB) and a current
status (status.observedGeneration == generation, Ready True: its pod Running on a kwok node) within
120 s of the first create; operator peak RSS (VmHWM) <= 300 MiB; at steady state, zero API writes
apart from deliberate timers.

Request accounting comes from kube-apiserver's own /metrics (apiserver_request_total by verb, resource,
scope), so the operator is measured without changing it. Requests only the operator makes:
  LIST  statefulsets (scope namespace)     one per reconcile (counts reconciles); each also GETs its
                                           KVOffloadServe once
  PATCH kvoffloadserves/status              status writes
  APPLY configmaps|services|statefulsets|poddisruptionbudgets   child writes (server-side apply)
  APPLY the same with dryRun=All           validation before a write (not a write)
  DELETE the same (scope resource)          prunes
  LIST  the same + pods (scope namespace)   child and pod reads
Control-plane components list cluster-wide from informers and the benchmark itself only lists
cluster-wide, so namespace-scoped LISTs are the operator's. kopf's watches are not counted.

Why 130 nodes and not 100: each resource runs one pod that asks for one GPU; 100 nodes x 8 GPUs are
800 GPUs < 1,000 pods, so 200 pods would stay Pending and Ready could never be True. 130 x 8 = 1,040.

    .venv/bin/python benchmarks/scale_bench.py [--resources 1000] [--namespaces 50] [--gpu-nodes 130]
        [--resync-seconds 60] [--steady-seconds 150] [--state-dir DIR] [--keep] [--json FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import kvtest
from kvtest import OperatorProcess

ROOT = Path(__file__).resolve().parents[1]

GROUP, VERSION, PLURAL = "kvoffload.io", "v1alpha1", "kvoffloadserves"
OWNER_LABEL = "kvoffload.io/serve"
CHILD_RESOURCES = ("configmaps", "services", "statefulsets", "poddisruptionbudgets")
CHILD_KINDS = ("ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget")
SPEC = {"replicas": 1, "model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "engine": {"maxModelLen": 4096},
        "offload": {"cpu": {"size": "1Gi"}}, "resources": {"gpuMemory": "141Gi"}}


# ------------------------------------------------------------------------------ measuring
def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (KiB) of a live process."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        pass
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def component_cpu(c: kvtest.Cluster) -> dict[str, float]:
    out = {}
    for comp, rec in c.state().get("processes", {}).items():
        try:
            out[comp] = cpu_seconds(int(rec["pid"]))
        except OSError:
            pass
    return out


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine (every process, other users' included)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    idle = int(fields[3]) + int(fields[4])
    return (sum(int(f) for f in fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


_METRIC = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def request_totals(c: kvtest.Cluster) -> Counter:
    """apiserver_request_total: (verb, resource, subresource, scope, code) -> count; a dry run's verb gets " dry-run"."""
    code, text = c.request("GET", "/metrics", timeout=30)
    if code != 200:
        raise RuntimeError(f"/metrics: {code}")
    out: Counter = Counter()
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
        verb = labels.get("verb", "") + (" dry-run" if labels.get("dry_run") else "")
        out[(verb, labels.get("resource"), labels.get("subresource"), labels.get("scope"),
             labels.get("code"))] += float(m.group("value"))
    return out


def operator_requests(delta: Counter) -> dict[str, Any]:
    """The operator's share of a delta of request_totals (see the module docstring).

    Reconciles are counted by their namespace-scoped LIST of StatefulSets (one per reconcile of a valid
    spec, and no other client makes it); each also GETs its KVOffloadServe once. GETs of
    KVOffloadServes are not counted directly because kube-controller-manager's garbage collector also
    GETs owners it has not seen yet (about one per new resource).
    """
    r = {"reconciles": 0, "status_writes": 0, "applies": 0, "dry_run_applies": 0, "deletes": 0, "lists": 0}
    for (verb, resource, sub, scope, _code), n in delta.items():
        if resource == "statefulsets" and verb == "LIST" and scope == "namespace":
            r["reconciles"] += n
        if resource == PLURAL and verb == "PATCH" and sub == "status":
            r["status_writes"] += n
        elif resource in CHILD_RESOURCES and verb == "APPLY":
            r["applies"] += n
        elif resource in CHILD_RESOURCES and verb == "APPLY dry-run":
            r["dry_run_applies"] += n
        elif resource in CHILD_RESOURCES and verb == "DELETE" and scope == "resource":
            r["deletes"] += n
        elif resource in (*CHILD_RESOURCES, "pods") and verb == "LIST" and scope == "namespace":
            r["lists"] += n
    out: dict[str, Any] = {k: int(v) for k, v in r.items()}
    out["writes"] = out["status_writes"] + out["applies"] + out["deletes"]
    out["requests"] = out["reconciles"] + out["writes"] + out["dry_run_applies"] + out["lists"]  # reconciles: 1 GET each
    detail: Counter = Counter()
    for (verb, resource, sub, scope, code), n in delta.items():
        if resource in (PLURAL, *CHILD_RESOURCES, "pods") and not verb.startswith("WATCH"):
            detail[f"{verb} {resource}{'/' + sub if sub else ''} ({scope})" + ("" if code.startswith("2") else f" {code}")] += int(n)
    out["detail"] = dict(sorted(detail.items()))
    return out


def apiserver_summary(delta: Counter, operator: dict[str, Any]) -> dict[str, int]:
    """All non-watch requests the apiserver served in a window, and the shares that matter."""
    total = sum(n for k, n in delta.items() if not k[0].startswith("WATCH"))
    endpoint_retries = sum(n for (verb, res, _s, _sc, code), n in delta.items()
                           if res in ("endpoints", "endpointslices") and verb == "PUT" and code == "422")
    events = sum(n for (verb, res, *_), n in delta.items() if res == "events" and verb != "WATCH")
    return {"all (non-watch)": int(total), "operator": int(operator["requests"]),
            "endpoints/endpointslices 422 retries": int(endpoint_retries), "events": int(events)}


def diff(after: Counter, before: Counter) -> Counter:
    return Counter({k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)})


# ------------------------------------------------------------------------------ the cluster side
# kube-controller-manager's Endpoints/EndpointSlice controllers cannot write the loopback pod IPs that the
# local cluster uses (the API refuses 127.0.0.0/8 in Endpoints), so they retry every Service forever:
# a control-plane load a real cluster does not have. --without-endpoints-controllers turns them off.
ENDPOINTS_CONTROLLERS = ("endpoints-controller", "endpointslice-controller", "endpointslice-mirroring-controller")


def fresh_cluster(state_dir: Path, gpu_nodes: int, endpoints_controllers: bool = True) -> kvtest.Cluster:
    c = kvtest.Cluster(dir=state_dir)
    c.down()  # a left-over benchmark cluster in this dir: start from an empty etcd
    c.up(kvtest.make_fleet(gpu_nodes=gpu_nodes, workstations=0))
    if not endpoints_controllers:
        off = ",".join(f"-{name}" for name in ENDPOINTS_CONTROLLERS)
        args = [f"--controllers=*,{off}" if a.startswith("--controllers=") else a
                for a in c.component_args("kube-controller-manager")]
        c.restart("kube-controller-manager", sig=15, args=args)
    c.install_crd()
    return c


def make_namespaces(c: kvtest.Cluster, names: list[str]) -> None:
    for ns in names:
        code, body = c.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        if code not in (200, 201, 409):
            raise RuntimeError(f"namespace {ns}: {code} {body}")
    # Pods are admitted only once the serviceaccount controller made `default` in each namespace.
    kvtest.wait_until(lambda: all(c.request("GET", f"/api/v1/namespaces/{ns}/serviceaccounts/default")[0] == 200
                                     for ns in names), timeout=60, message="default ServiceAccounts")


def create_all(c: kvtest.Cluster, items: list[tuple[str, str]], threads: int = 16) -> float:
    """POST every KVOffloadServe from a thread pool; return the seconds it took."""
    def create(item: tuple[str, str]) -> None:
        ns, name = item
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "KVOffloadServe", "metadata": {"name": name}, "spec": SPEC}
        for attempt in range(5):
            code, resp = c.request("POST", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}", body, timeout=60)
            if code in (200, 201, 409):
                return
            time.sleep(0.5 * (attempt + 1))
        raise RuntimeError(f"create {ns}/{name}: {code} {resp}")

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(create, items))
    return time.monotonic() - t0


def current(obj: dict[str, Any]) -> bool:
    st = obj.get("status") or {}
    return (st.get("observedGeneration") == obj["metadata"]["generation"]
            and any(cd["type"] == "Ready" and cd["status"] == "True" for cd in st.get("conditions", [])))


def serves(c: kvtest.Cluster) -> list[dict[str, Any]]:
    code, body = c.request("GET", f"/apis/{GROUP}/{VERSION}/{PLURAL}", timeout=60)
    if code != 200:
        raise RuntimeError(f"list {PLURAL}: {code}")
    return body["items"]


def children_complete(c: kvtest.Cluster, keys: set[tuple[str, str]]) -> tuple[int, list[str]]:
    """(resources with exactly their 5 children, problems) from cluster-wide LISTs."""
    found: dict[tuple[str, str], Counter] = {k: Counter() for k in keys}
    problems = []
    for res, kind in zip(CHILD_RESOURCES, CHILD_KINDS):
        group = {"statefulsets": "/apis/apps/v1", "poddisruptionbudgets": "/apis/policy/v1"}.get(res, "/api/v1")
        code, body = c.request("GET", f"{group}/{res}?labelSelector={OWNER_LABEL}", timeout=60)
        if code != 200:
            raise RuntimeError(f"list {res}: {code}")
        for item in body["items"]:
            key = (item["metadata"]["namespace"], item["metadata"]["labels"][OWNER_LABEL])
            if key not in found:
                problems.append(f"{kind} {key}: no such resource")
                continue
            found[key][kind] += 1
    want = Counter({"ConfigMap": 1, "Service": 2, "StatefulSet": 1, "PodDisruptionBudget": 1})
    ok = sum(1 for k in keys if found[k] == want)
    problems += [f"{k}: {dict(v)}" for k, v in found.items() if v != want][:10]
    return ok, problems


# ------------------------------------------------------------------------------ the run
def measure(c: kvtest.Cluster, op: OperatorProcess, keys: list[tuple[str, str]], args: argparse.Namespace,
            out: dict[str, Any]) -> None:
    op.wait_started()
    m0 = request_totals(c)
    cpu0, cp0, all0 = cpu_seconds(op.proc.pid), component_cpu(c), machine_cpu()
    t0 = time.monotonic()
    out["create_s"] = round(create_all(c, keys), 1)
    print(f"[scale] {len(keys)} created in {out['create_s']} s", flush=True)
    samples, loads = [], []
    ready_at = None
    while time.monotonic() - t0 < args.timeout:
        items = serves(c)
        n_ready = sum(1 for o in items if current(o))
        mem = proc_status(op.proc.pid)
        samples.append((round(time.monotonic() - t0, 1), n_ready, mem.get("VmRSS", 0) // 1024))
        loads.append(os.getloadavg()[0])
        if op.proc.poll() is not None:
            raise RuntimeError("operator exited:\n" + op.output()[-3000:])
        if n_ready == len(keys):
            ok, problems = children_complete(c, set(keys))
            if ok == len(keys):
                ready_at = time.monotonic() - t0
                break
            print(f"[scale] all Ready but children incomplete: {problems}", flush=True)
        if len(samples) % 5 == 1:
            print(f"[scale] t={samples[-1][0]:6.1f}s ready {n_ready}/{len(keys)} operator RSS {samples[-1][2]} MiB "
                  f"load {loads[-1]:.1f}", flush=True)
        time.sleep(args.poll)
    m1 = request_totals(c)
    cpu1, cp1, all1 = cpu_seconds(op.proc.pid), component_cpu(c), machine_cpu()
    out["rollout_cpu_s"] = {"operator": round(cpu1 - cpu0, 1),
                            **{k: round(cp1[k] - cp0.get(k, 0), 1) for k in cp1},
                            "whole machine": round(all1 - all0, 1),
                            "wall x cores": round((time.monotonic() - t0) * (os.cpu_count() or 1), 1)}
    out["converged_s"] = round(ready_at, 1) if ready_at is not None else None
    out["ready_curve"] = samples
    out["load_during_max"] = round(max(loads), 2)
    rollout = operator_requests(diff(m1, m0))
    rollout["requests_per_reconcile"] = round(rollout["requests"] / max(rollout["reconciles"], 1), 2)
    rollout["reconciles_per_resource"] = round(rollout["reconciles"] / len(keys), 2)
    rollout["operator_cpu_s"] = round(cpu1 - cpu0, 1)
    out["rollout"] = rollout
    out["rollout_apiserver_requests"] = apiserver_summary(diff(m1, m0), rollout)
    log_text = op.output()
    out["rollout"]["apply_log_lines"] = log_text.count("kvoffload.reconcile: apply ")
    out["rollout"]["reconcile_failures_logged"] = log_text.count("failed (retry in")
    print(f"[scale] converged in {out['converged_s']} s: {rollout}", flush=True)

    # Steady state: let the last pod events settle, then watch a window holding >= 2 resync timers.
    time.sleep(args.settle_seconds)
    m2, cpu2, t2 = request_totals(c), cpu_seconds(op.proc.pid), time.monotonic()
    applies_before = op.output().count("kvoffload.reconcile: apply ")
    time.sleep(args.steady_seconds)
    m3, cpu3, t3 = request_totals(c), cpu_seconds(op.proc.pid), time.monotonic()
    minutes = (t3 - t2) / 60
    steady = operator_requests(diff(m3, m2))
    steady["window_s"] = round(t3 - t2)
    steady["writes_per_minute"] = round(steady["writes"] / minutes, 2)
    steady["requests_per_reconcile"] = round(steady["requests"] / max(steady["reconciles"], 1), 2)
    steady["requests_per_minute"] = round(steady["requests"] / minutes)
    steady["operator_cpu_percent"] = round(100 * (cpu3 - cpu2) / (t3 - t2), 1)
    steady["apply_log_lines"] = op.output().count("kvoffload.reconcile: apply ") - applies_before
    out["steady"] = steady
    out["steady_apiserver_requests"] = apiserver_summary(diff(m3, m2), steady)
    mem = proc_status(op.proc.pid)
    out["operator_rss_mib"] = {"peak_VmHWM": round(mem.get("VmHWM", 0) / 1024), "now_VmRSS": round(mem.get("VmRSS", 0) / 1024)}
    out["control_plane_rss_mib"] = {k: round(v / 1024) for k, v in c.memory_kib().items()}
    out["load_after"] = loadavg()
    print(f"[scale] steady: {steady}; operator RSS {out['operator_rss_mib']}", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvo-scale-"))
    state_dir = Path(args.state_dir or workdir / "cluster")
    out: dict[str, Any] = {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                           "machine": f"{os.cpu_count()} cores, {_mem_gib():.0f} GiB, {platform.python_implementation()} "
                                      f"{platform.python_version()}",
                           "params": vars(args), "load_before": loadavg()}
    print(f"[scale] workdir {workdir}; load {out['load_before']}", flush=True)
    t = time.monotonic()
    c = kvtest.Cluster(dir=state_dir)
    op: OperatorProcess | None = None
    try:
        c = fresh_cluster(state_dir, args.gpu_nodes, not args.without_endpoints_controllers)
        out["cluster_start_s"] = round(time.monotonic() - t, 1)
        namespaces = [f"scale-{i:02d}" for i in range(args.namespaces)]
        make_namespaces(c, namespaces)
        keys = [(namespaces[i % len(namespaces)], f"serve-{i:04d}") for i in range(args.resources)]
        op = OperatorProcess(c.env, None, {"resyncSeconds": args.resync_seconds}, log_path=workdir / "operator.log")
        measure(c, op, keys, args, out)
    finally:
        if op is not None:
            op.stop()
        if not args.keep:
            c.down()
            if not args.state_dir:
                shutil.rmtree(state_dir, ignore_errors=True)  # etcd's WAL alone is 100+ MB; the operator log stays
    out["targets"] = {
        "converged <= 120 s": out.get("converged_s") is not None and out["converged_s"] <= 120,
        "peak RSS <= 300 MiB": out.get("operator_rss_mib", {}).get("peak_VmHWM", 1e9) <= 300,
        "steady writes 0": out.get("steady", {}).get("writes") == 0,
    }
    return out


def _mem_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1024 / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--resources", type=int, default=1000)
    ap.add_argument("--namespaces", type=int, default=50)
    ap.add_argument("--gpu-nodes", type=int, default=130)
    ap.add_argument("--resync-seconds", type=int, default=60, help="operator resyncSeconds (the deliberate timer)")
    ap.add_argument("--settle-seconds", type=float, default=20)
    ap.add_argument("--steady-seconds", type=float, default=150, help="steady-state window (>= 2 resyncs)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--poll", type=float, default=2.0)
    ap.add_argument("--state-dir", help="cluster state dir (default: a new temp dir)")
    ap.add_argument("--without-endpoints-controllers", action="store_true",
                    help="turn off kube-controller-manager's Endpoints/EndpointSlice controllers (see ENDPOINTS_CONTROLLERS)")
    ap.add_argument("--keep", action="store_true", help="leave the benchmark cluster running")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    out = run(args)
    text = json.dumps(out, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0 if all(out["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
