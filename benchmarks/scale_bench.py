"""Scale benchmark of the operator on a real control plane, against the floor (not part of `make test`).

1,000 KVOffloadServes across 50 namespaces, created at once (16 parallel API creates) against a
dedicated local cluster (its own state dir, ports and etcd; the shared .cluster/ is never touched)
with 130 kwok GPU nodes of 8 GPUs. Two phases, each on a fresh identical cluster (same nodes,
namespaces, resources, creates), in the order --order gives (default floor first):

  floor     no operator: a plain client applies exactly the children the operator would (rendered by
            the operator's own pure pipeline, server-side apply, the operator's number of worker
            threads) as soon as each create returns, watches StatefulSets and pods, and writes each
            resource's one final status once its pod runs. The least the same end state needs.
  operator  `python -m kvoffload.cli run --all-namespaces --liveness '' --operator-config FILE`
            (resyncSeconds 60), started and caches filled before the first create.

End state (both phases): every resource current (status.observedGeneration == generation, Ready True:
its pod Running on a kwok node), stamped per resource by a watch (time to first / p50 / all Ready),
then exactly its five children (ConfigMap, 2 Services, StatefulSet, PDB). Reported: each phase's
time, the operator's ratio to the floor of the same run, requests, CPU, load. Then, for the
operator, a steady-state window (>= 2 resyncs): requests per no-op reconcile, writes, RSS.

Targets: converged <= 120 s and <= 1.3x the floor; <= 8 requests per resource during the rollout;
0 requests at steady state; operator peak RSS (VmHWM) <= 300 MiB.

Request accounting comes from kube-apiserver's own /metrics (apiserver_request_total by verb, resource,
scope), so the operator is measured without changing it. Requests only the operator (or the floor
client) makes: server-side APPLY of the child kinds (and with dryRun=All), PATCH kvoffloadserves/status,
DELETE of the child kinds, namespace-scoped LISTs of them and pods; and the Events the operator posted
(counted by their source, since the apiserver's counters cannot tell whose an Event is). Reconciles (which, reading the
operator's caches, make no request of their own) come from the operator's log line of its totals.
Its informers' cluster-wide LIST + WATCH happen before the first create.

Why 130 nodes and not 100: each resource runs one pod that asks for one GPU; 100 nodes x 8 GPUs are
800 GPUs < 1,000 pods, so 200 pods would stay Pending and Ready could never be True. 130 x 8 = 1,040.

    .venv/bin/python benchmarks/scale_bench.py [--resources 1000] [--namespaces 50] [--gpu-nodes 130]
        [--order floor,operator] [--resync-seconds 60] [--steady-seconds 150] [--state-dir DIR] [--keep]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import itertools
import json
import os
import platform
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvtest
from kvtest import OperatorProcess, sentinel

ROOT = Path(__file__).resolve().parents[1]

REPORT_SECONDS = 10  # kvoffload.controller.runtime.REPORT_SECONDS: the operator logs its reconcile totals this often

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


def self_cpu() -> float:
    """CPU seconds of this process (all its threads)."""
    t = os.times()
    return t.user + t.system


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


_METRIC = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def request_totals(c: kvtest.Cluster) -> Counter:
    """apiserver_request_total: (verb, resource, subresource, scope, code) -> count.

    A dry run's verb gets " dry-run"."""
    text = c.client.request("GET", "/metrics", timeout=30)
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


def client_requests(delta: Counter) -> dict[str, Any]:
    """The operator's (or the floor client's) share of a delta of request_totals (see the module docstring).

    Only these clients server-side apply our child kinds, patch kvoffloadserves/status, or list them and
    pods namespace by namespace. GETs of KVOffloadServes are shown apart: kube-controller-manager's
    garbage collector also GETs owners it has not seen yet (about one per new resource), so the floor's
    count of them is the control plane's.
    """
    r = {"status_writes": 0, "applies": 0, "dry_run_applies": 0, "deletes": 0, "lists": 0}
    gets = 0
    for (verb, resource, sub, scope, _code), n in delta.items():
        if resource == PLURAL and verb == "PATCH" and sub == "status":
            r["status_writes"] += n
        elif resource in CHILD_RESOURCES and verb == "APPLY":
            r["applies"] += n
        elif resource in CHILD_RESOURCES and verb == "APPLY dry-run":
            r["dry_run_applies"] += n
        elif resource in CHILD_RESOURCES and verb == "DELETE" and scope == "resource":
            r["deletes"] += n
        elif resource in (*CHILD_RESOURCES, "pods", PLURAL) and verb == "LIST" and scope == "namespace":
            r["lists"] += n
        elif resource == PLURAL and verb == "GET":
            gets += n
    out: dict[str, Any] = {k: int(v) for k, v in r.items()}
    out["writes"] = out["status_writes"] + out["applies"] + out["deletes"]
    out["requests"] = out["writes"] + out["dry_run_applies"] + out["lists"]
    out["get_kvoffloadserves_any_client"] = int(gets)
    detail: Counter = Counter()
    for (verb, resource, sub, scope, code), n in delta.items():
        if resource in (PLURAL, *CHILD_RESOURCES, "pods") and not verb.startswith("WATCH"):
            detail[f"{verb} {resource}{'/' + sub if sub else ''} ({scope})"
                   + ("" if code.startswith("2") else f" {code}")] += int(n)
    out["detail"] = dict(sorted(detail.items()))
    return out


def apiserver_summary(delta: Counter, operator: dict[str, Any]) -> dict[str, int]:
    """All non-watch requests the apiserver served in a window, and the shares that matter."""
    total = sum(n for k, n in delta.items() if not k[0].startswith("WATCH"))
    endpoint_retries = sum(n for (verb, res, _s, _sc, code), n in delta.items()
                           if res in ("endpoints", "endpointslices") and verb == "PUT" and code == "422")
    events = sum(n for (verb, res, *_), n in delta.items() if res == "events" and verb != "WATCH")
    return {"all (non-watch)": int(total), "ours (operator or floor client)": int(operator["requests"]),
            "endpoints/endpointslices 422 retries": int(endpoint_retries), "events": int(events)}


def operator_events(c: kvtest.Cluster) -> int:
    """Events the operator posted (every namespace), each one request."""
    from kvoffload.controller.events import COMPONENT

    return sum(1 for e in c.client.list("events") if (e.get("source") or {}).get("component") == COMPONENT)


def diff(after: Counter, before: Counter) -> Counter:
    return Counter({k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)})


# ------------------------------------------------------------------------------ the cluster side
# kube-controller-manager's Endpoints/EndpointSlice controllers cannot write the loopback pod IPs that the
# local cluster uses (the API refuses 127.0.0.0/8 in Endpoints), so they retry every Service forever:
# a control-plane load a real cluster does not have. --without-endpoints-controllers turns them off.
ENDPOINTS_CONTROLLERS = ("endpoints-controller", "endpointslice-controller", "endpointslice-mirroring-controller")


def fresh_cluster(state_dir: Path, gpu_nodes: int, endpoints_controllers: bool = True,
                  apiserver_profiling: bool = False) -> kvtest.Cluster:
    c = kvtest.Cluster(dir=state_dir)
    c.down()  # a left-over benchmark cluster in this dir: start from an empty etcd
    c.up(kvtest.make_fleet(gpu_nodes=gpu_nodes, workstations=0))
    if apiserver_profiling:  # the harness runs it with --profiling=false; /debug/pprof needs it on
        args = ["--profiling=true" if a == "--profiling=false" else a for a in c.component_args("kube-apiserver")]
        c.restart("kube-apiserver", sig=15, args=args)
    if not endpoints_controllers:
        off = ",".join(f"-{name}" for name in ENDPOINTS_CONTROLLERS)
        args = [f"--controllers=*,{off}" if a.startswith("--controllers=") else a
                for a in c.component_args("kube-controller-manager")]
        c.restart("kube-controller-manager", sig=15, args=args)
    c.install_crd()
    return c


def make_namespaces(c: kvtest.Cluster, names: list[str]) -> None:
    for ns in names:
        c.client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    # Pods are admitted only once the serviceaccount controller made `default` in each namespace.
    kvtest.wait_until(lambda: all(c.client.exists("serviceaccount", "default", ns) for ns in names),
                      timeout=60, message="default ServiceAccounts")


def create_all(c: kvtest.Cluster, items: list[tuple[str, str]], threads: int = 16,
               on_created: Callable[[dict[str, Any]], None] | None = None) -> float:
    """POST every KVOffloadServe from a thread pool; return the seconds it took.

    `on_created` gets each stored object."""
    def create(item: tuple[str, str]) -> None:
        ns, name = item
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "KVOffloadServe", "metadata": {"name": name}, "spec": SPEC}
        for attempt in range(5):
            try:
                created = c.client.create(body, ns)
            except kvtest.ApiError as exc:
                if exc.status == 409:
                    return
                if attempt == 4:
                    raise
                time.sleep(0.5 * (attempt + 1))
                continue
            if on_created:
                on_created(created)
            return

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(create, items))
    return time.monotonic() - t0


def current(obj: dict[str, Any]) -> bool:
    st = obj.get("status") or {}
    return (st.get("observedGeneration") == obj["metadata"]["generation"]
            and any(cd["type"] == "Ready" and cd["status"] == "True" for cd in st.get("conditions", [])))


def children_complete(c: kvtest.Cluster, keys: set[tuple[str, str]]) -> tuple[int, list[str]]:
    """(resources with exactly their 5 children, problems) from cluster-wide LISTs."""
    found: dict[tuple[str, str], Counter] = {k: Counter() for k in keys}
    problems = []
    for res, kind in zip(CHILD_RESOURCES, CHILD_KINDS):
        for item in c.client.list(res, labels=OWNER_LABEL):
            key = (item["metadata"]["namespace"], item["metadata"]["labels"][OWNER_LABEL])
            if key not in found:
                problems.append(f"{kind} {key}: no such resource")
                continue
            found[key][kind] += 1
    want = Counter({"ConfigMap": 1, "Service": 2, "StatefulSet": 1, "PodDisruptionBudget": 1})
    ok = sum(1 for k in keys if found[k] == want)
    problems += [f"{k}: {dict(v)}" for k, v in found.items() if v != want][:10]
    return ok, problems


# ------------------------------------------------------------------------------ the operator
def reconcile_totals(op: OperatorProcess) -> dict[str, int]:
    """Reconciles by outcome since start, from the operator's last `reconciles so far` line (every 10 s)."""
    lines = [line for line in op.output().splitlines() if "reconciles so far: " in line]
    return json.loads(lines[-1].split("reconciles so far: ", 1)[1]) if lines else {}


# ------------------------------------------------------------------------------ the floor
class Floor:
    """What the API server alone allows: a plain client that does the least any controller must for the
    same end state. For each KVOffloadServe, as soon as its create returns, it server-side applies the
    five children the operator would (rendered by the operator's own pure pipeline, same field manager,
    same verb), with the operator's number of worker threads (runtime.WORKERS); a watch on
    StatefulSets and pods tells when a resource's pod runs, and then it writes that resource's one
    final status (conditions.status of what it saw: Ready True at its generation). No reads, no dry
    runs, no intermediate status."""

    def __init__(self, c: kvtest.Cluster) -> None:
        from kvoffload.api.settings import Settings
        from kvoffload.controller import conditions, kube, pipeline, runtime
        self.conditions, self.pipeline, self.settings = conditions, pipeline, Settings()
        self.kube = kube.Kube(c.api_client(), timeout=60)
        self.work: queue.PriorityQueue = queue.PriorityQueue()  # (0, status) before (1, children), as the operator
        self.seq = itertools.count()
        self.lock = threading.Lock()
        self.created: dict[tuple[str, str], dict[str, Any]] = {}
        self.desired: dict[tuple[str, str], Any] = {}
        self.sts: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.written: set[tuple[str, str]] = set()
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(runtime.WORKERS)]
        self.threads += [threading.Thread(target=self._watch, args=(c, resource, store), daemon=True)
                         for resource, store in (("statefulsets", self.sts), ("pods", self.pods))]
        for t in self.threads:
            t.start()

    def on_created(self, body: dict[str, Any]) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        with self.lock:
            self.created[key] = body
        self.work.put((1, next(self.seq), "children", key))

    def _worker(self) -> None:
        while not self.stop.is_set():
            try:
                _, _, what, key = self.work.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                if what == "children":
                    body = self.created[key]
                    desired = self.pipeline.desired(key[1], key[0], body["metadata"]["uid"], body["spec"],
                                                    self.settings)
                    with self.lock:
                        self.desired[key] = desired
                    for child in desired.applied:
                        self.kube.apply(child)
                    self._maybe_status(key)
                else:
                    with self.lock:
                        body, desired = self.created[key], self.desired[key]
                        sts, pod = self.sts.get(key), self.pods.get(key)
                    obs = self.conditions.Observed(sts, [pod] if pod else [], None)
                    status = self.conditions.status(body, desired, None, obs)
                    self.kube.replace_status(f"/apis/{GROUP}/{VERSION}/namespaces/{key[0]}/{PLURAL}/{key[1]}", status,
                                             body["metadata"]["resourceVersion"])
            except Exception as exc:  # noqa: BLE001 - reported, and the run then does not converge
                self.errors.append(f"{what} {key}: {exc}")

    def _maybe_status(self, key: tuple[str, str]) -> None:
        """Queue the one status write once the StatefulSet is rolled out and its pod is Running."""
        with self.lock:
            sts, pod = self.sts.get(key), self.pods.get(key)
            if (key in self.written or key not in self.desired or not self.conditions.rolled_out(sts, 1)
                    or not pod or (pod.get("status") or {}).get("phase") != "Running"):
                return
            self.written.add(key)
        self.work.put((0, next(self.seq), "status", key))

    def _watch(self, c: kvtest.Cluster, resource: str, store: dict[tuple[str, str], dict[str, Any]]) -> None:
        """Cluster-wide watch of our labelled objects; keeps the newest of each owner's (one pod per resource)."""
        while not self.stop.is_set():
            try:
                for _, obj in c.client.watch(resource, labels=OWNER_LABEL, timeout=60):
                    key = (obj["metadata"]["namespace"], obj["metadata"]["labels"][OWNER_LABEL])
                    with self.lock:
                        store[key] = obj
                    self._maybe_status(key)
                    if self.stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - reconnect
                time.sleep(0.2)


# ------------------------------------------------------------------------------ readiness, by watch
class Tracker:
    """Watches every KVOffloadServe and stamps, per resource, when it first became current (status at its
    generation, Ready True): time to first Ready, p50, all Ready without polling a thousand objects."""

    def __init__(self, c: kvtest.Cluster, t0: float) -> None:
        self.t0, self.ready, self.lock, self.stop = t0, {}, threading.Lock(), threading.Event()
        self.client = c.client
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                for _, obj in self.client.watch(f"{PLURAL}.{GROUP}", timeout=60):
                    if current(obj):
                        with self.lock:
                            self.ready.setdefault((obj["metadata"]["namespace"], obj["metadata"]["name"]),
                                                  time.monotonic() - self.t0)
                    if self.stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - reconnect
                time.sleep(0.2)

    def times(self) -> list[float]:
        with self.lock:
            return sorted(self.ready.values())


# ------------------------------------------------------------------------------ profiles
def profile(c: kvtest.Cluster, op: OperatorProcess | None, seconds: float, out_dir: Path, mode: str) -> None:
    """CPU profiles over `seconds` of the rollout: kube-apiserver's own pprof (`go tool pprof -top`) and,
    in the operator phase, py-spy of the operator (collapsed stacks of the thread holding the GIL: where its Python
    CPU goes, not where it waits). Files go to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spy = None
    if op is not None and shutil.which("py-spy"):
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(op.proc.pid), "--rate", "20", "--duration",
                                str(int(seconds)), "--gil", "--threads", "--format", "raw",
                                "-o", str(out_dir / "operator.pyspy.txt")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pki = c.dir / "pki"
    pprof = out_dir / f"kube-apiserver.{mode}.pprof"
    subprocess.run(["curl", "-sS", "--cacert", str(pki / "ca.crt"), "--cert", str(pki / "admin.crt"),
                    "--key", str(pki / "admin.key"), "-o", str(pprof),
                    f"{c.state()['server']}/debug/pprof/profile?seconds={int(seconds)}"],
                   check=False, timeout=seconds + 60)
    top = subprocess.run(["go", "tool", "pprof", "-top", "-nodecount=60", str(pprof)], capture_output=True,
                         text=True, check=False)
    (out_dir / f"kube-apiserver.{mode}.top.txt").write_text(top.stdout + top.stderr)
    if spy is not None:
        spy.wait(seconds + 60)


# ------------------------------------------------------------------------------ the run
def rollout(c: kvtest.Cluster, mode: str, keys: list[tuple[str, str]], args: argparse.Namespace,
            op: OperatorProcess | None, out: dict[str, Any]) -> None:
    """Create every resource and wait for the end state; the same for both modes (`mode`: operator | floor)."""
    floor = Floor(c) if mode == "floor" else None
    # The idle control plane's own CPU rate (130 nodes' heartbeats, controllers' resyncs): it grows with
    # wall time, so a rollout slowed by other users costs more of it; "above idle" takes it out.
    idle0, t_idle = component_cpu(c), time.monotonic()
    time.sleep(args.idle_seconds)
    idle1 = component_cpu(c)
    idle_rate = sum(idle1[k] - idle0.get(k, 0) for k in idle1) / (time.monotonic() - t_idle)
    m0 = request_totals(c)
    cpu0, cp0, all0, me0 = (cpu_seconds(op.proc.pid) if op else 0.0), component_cpu(c), machine_cpu(), self_cpu()
    out["load_before"] = loadavg()
    t0 = time.monotonic()
    tracker = Tracker(c, t0)
    out["create_s"] = round(create_all(c, keys, on_created=floor.on_created if floor else None), 1)
    print(f"[{mode}] {len(keys)} created in {out['create_s']} s", flush=True)
    if args.profile:
        threading.Thread(target=profile, args=(c, op, args.profile, Path(args.profile_dir), mode), daemon=True).start()
    samples, loads = [], []
    converged = None
    while time.monotonic() - t0 < args.timeout:
        times = tracker.times()
        mem = proc_status(op.proc.pid) if op else {}
        samples.append((round(time.monotonic() - t0, 1), len(times), mem.get("VmRSS", 0) // 1024))
        loads.append(os.getloadavg()[0])
        if op and op.proc.poll() is not None:
            raise RuntimeError("operator exited:\n" + op.output()[-3000:])
        if floor and floor.errors:
            raise RuntimeError(f"floor client failed: {floor.errors[:5]}")
        if len(times) == len(keys):
            converged = times[-1]
            break
        if len(samples) % 10 == 1:
            print(f"[{mode}] t={samples[-1][0]:6.1f}s ready {len(times)}/{len(keys)}"
                  + (f" operator RSS {samples[-1][2]} MiB" if op else "") + f" load {loads[-1]:.1f}", flush=True)
        time.sleep(0.5)
    m1 = request_totals(c)
    cpu1, cp1, all1, me1 = (cpu_seconds(op.proc.pid) if op else 0.0), component_cpu(c), machine_cpu(), self_cpu()
    tracker.stop.set()
    if floor:
        floor.stop.set()
    ok, problems = children_complete(c, set(keys))
    if ok != len(keys) and converged is not None:
        raise RuntimeError(f"{mode}: {len(keys) - ok} resources without exactly their children: {problems}")
    out["children_complete"] = ok
    times = tracker.times()
    out["converged_s"] = round(converged, 1) if converged is not None else None
    out["ready_s"] = {"first": round(times[0], 1) if times else None,
                      "p50": round(times[len(times) // 2], 1) if times else None,
                      "p90": round(times[int(len(times) * 0.9)], 1) if times else None,
                      "all": round(times[-1], 1) if len(times) == len(keys) else None}
    out["ready_curve"] = samples[::4]
    out["load_during_max"] = round(max(loads), 2)
    out["load_after"] = loadavg()
    ours = {**({"operator": round(cpu1 - cpu0, 1)} if op else {}), **{k: round(cp1[k] - cp0.get(k, 0), 1) for k in cp1},
            "benchmark (creates, watches, floor client)": round(me1 - me0, 1)}
    cp_total = sum(cp1[k] - cp0.get(k, 0) for k in cp1)
    out["cpu_s"] = {**ours, "control plane": round(cp_total, 1),
                    "control plane above idle": round(cp_total - idle_rate * (time.monotonic() - t0), 1),
                    "idle control plane per second": round(idle_rate, 3),
                    "other users": round(all1 - all0 - sum(ours.values()), 1),
                    "whole machine": round(all1 - all0, 1),
                    "wall x cores": round((time.monotonic() - t0) * (os.cpu_count() or 1), 1)}
    reqs = client_requests(diff(m1, m0))
    # The operator's Events are its requests too (one POST each; the apiserver's counters cannot tell
    # whose they are): count the Events it wrote, by their source.
    reqs["events"] = operator_events(c) if op else 0
    reqs["requests"] += reqs["events"]
    reqs["per_resource"] = round(reqs["requests"] / len(keys), 2)
    if op:
        reqs["reconciles"] = reconcile_totals(op)
        log_text = op.output()
        reqs["apply_log_lines"] = log_text.count("kvoffload.reconcile: apply ")
        reqs["reconcile_failures_logged"] = log_text.count("failed (retry in")
    out["requests"] = reqs
    out["apiserver_requests"] = apiserver_summary(diff(m1, m0), reqs)
    print(f"[{mode}] converged in {out['converged_s']} s, ready {out['ready_s']}, requests {reqs}", flush=True)


def steady(c: kvtest.Cluster, op: OperatorProcess, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Steady state: let the last pod events settle, then watch a window holding >= 2 resync timers."""
    time.sleep(args.settle_seconds)
    time.sleep(REPORT_SECONDS + 1)  # the operator's reconcile totals are logged every 10 s
    m2, cpu2, t2, rec2 = request_totals(c), cpu_seconds(op.proc.pid), time.monotonic(), reconcile_totals(op)
    applies_before = op.output().count("kvoffload.reconcile: apply ")
    time.sleep(args.steady_seconds)
    m3, cpu3, t3 = request_totals(c), cpu_seconds(op.proc.pid), time.monotonic()
    time.sleep(REPORT_SECONDS + 1)
    rec3 = reconcile_totals(op)
    minutes = (t3 - t2) / 60
    st = client_requests(diff(m3, m2))
    st["window_s"] = round(t3 - t2)
    st["reconciles"] = {k: rec3.get(k, 0) - rec2.get(k, 0) for k in rec3 if rec3.get(k, 0) != rec2.get(k, 0)}
    n = sum(st["reconciles"].values())
    st["writes_per_minute"] = round(st["writes"] / minutes, 2)
    st["requests_per_reconcile"] = round(st["requests"] / max(n, 1), 3)
    st["operator_cpu_percent"] = round(100 * (cpu3 - cpu2) / (t3 - t2), 1)
    st["apply_log_lines"] = op.output().count("kvoffload.reconcile: apply ") - applies_before
    out["steady"] = st
    out["steady_apiserver_requests"] = apiserver_summary(diff(m3, m2), st)
    mem = proc_status(op.proc.pid)
    out["operator_rss_mib"] = {"peak_VmHWM": round(mem.get("VmHWM", 0) / 1024),
                               "now_VmRSS": round(mem.get("VmRSS", 0) / 1024)}
    print(f"[operator] steady: {st}; operator RSS {out['operator_rss_mib']}", flush=True)


def phase(mode: str, args: argparse.Namespace, workdir: Path, state_dir: Path) -> dict[str, Any]:
    """One fresh cluster (same nodes, namespaces and resources for both modes), one rollout."""
    out: dict[str, Any] = {"mode": mode}
    t = time.monotonic()
    c = kvtest.Cluster(dir=state_dir)
    op: OperatorProcess | None = None
    try:
        c = fresh_cluster(state_dir, args.gpu_nodes, not args.without_endpoints_controllers, bool(args.profile))
        out["cluster_start_s"] = round(time.monotonic() - t, 1)
        namespaces = [f"scale-{i:02d}" for i in range(args.namespaces)]
        make_namespaces(c, namespaces)
        keys = [(namespaces[i % len(namespaces)], f"serve-{i:04d}") for i in range(args.resources)]
        # both phases: the same cluster; the operator's "caches filled" comes after it
        sentinel(c.client, namespaces[0])
        if mode == "operator":
            op = OperatorProcess(c.env, None, {"resyncSeconds": args.resync_seconds}, log_path=workdir / "operator.log")
            op.wait_started()
        rollout(c, mode, keys, args, op, out)
        if op is not None:
            if args.steady_seconds > 0:
                steady(c, op, args, out)
            else:
                mem = proc_status(op.proc.pid)
                out["operator_rss_mib"] = {"peak_VmHWM": round(mem.get("VmHWM", 0) / 1024)}
        out["control_plane_rss_mib"] = {k: round(v / 1024) for k, v in c.memory_kib().items()}
    finally:
        if op is not None:
            op.stop()
        if not args.keep:
            c.down()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvo-scale-"))
    state_dir = Path(args.state_dir or workdir / "cluster")
    out: dict[str, Any] = {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                           "machine": f"{os.cpu_count()} cores, {_mem_gib():.0f} GiB, "
                                      f"{platform.python_implementation()} {platform.python_version()}",
                           "params": vars(args), "order": args.order, "load_before": loadavg()}
    print(f"[scale] workdir {workdir}; load {out['load_before']}; order {args.order}", flush=True)
    try:
        for mode in args.order.split(","):
            out[mode] = phase(mode, args, workdir, state_dir)
    finally:
        if not args.keep and not args.state_dir:
            shutil.rmtree(state_dir, ignore_errors=True)  # etcd's WAL alone is 100+ MB; the operator log stays
    o, f = out.get("operator", {}), out.get("floor", {})
    if o.get("converged_s") and f.get("converged_s"):
        out["ratio_to_floor"] = round(o["converged_s"] / f["converged_s"], 2)
        # The same comparison in work rather than time (less sensitive to other users of the machine):
        # CPU seconds of the control plane during each rollout.
        out["control_plane_cpu_ratio"] = round(o["cpu_s"]["control plane"] / max(f["cpu_s"]["control plane"], 0.1), 2)
        out["control_plane_cpu_above_idle_ratio"] = round(o["cpu_s"]["control plane above idle"]
                                                          / max(f["cpu_s"]["control plane above idle"], 0.1), 2)
    out["targets"] = {
        "converged <= 120 s": o.get("converged_s") is not None and o["converged_s"] <= 120,
        "<= 1.3x the floor": out.get("ratio_to_floor", 1e9) <= 1.3,
        "requests per resource <= 8": o.get("requests", {}).get("per_resource", 1e9) <= 8,
        "peak RSS <= 300 MiB": o.get("operator_rss_mib", {}).get("peak_VmHWM", 1e9) <= 300,
        "steady requests 0": o.get("steady", {}).get("requests") == 0,
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
    ap.add_argument("--idle-seconds", type=float, default=15, help="idle control plane CPU sampled before the creates")
    ap.add_argument("--order", default="floor,operator",
                    help="phases, in order, each on a fresh identical cluster: floor (no operator), operator")
    ap.add_argument("--state-dir", help="cluster state dir (default: a new temp dir)")
    ap.add_argument("--without-endpoints-controllers", action="store_true",
                    help="turn off kube-controller-manager's Endpoints/EndpointSlice "
                         "controllers (see ENDPOINTS_CONTROLLERS)")
    ap.add_argument("--keep", action="store_true", help="leave the benchmark cluster running")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--profile", type=float, default=0, metavar="SECONDS",
                    help="profile kube-apiserver (pprof, profiling turned on) and the operator (py-spy, if on PATH) "
                         "for SECONDS from the first create")
    ap.add_argument("--profile-dir", default="benchmarks/results/scale-profiles", help="where the profiles go")
    args = ap.parse_args()
    out = run(args)
    text = json.dumps(out, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0 if all(out["targets"].values()) else 1  # noqa: RET504


if __name__ == "__main__":
    sys.exit(main())
