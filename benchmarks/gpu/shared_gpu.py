"""Issue 35 on the GPU host: spec.offload.server PerNode as rendered, under crun from the real node's captures.
One node's shared LMCache server pod and two serving pods of the resource, each container with the OCI spec the
real node's containerd generated for it (gpu_pod), on one GPU:

    python benchmarks/gpu/shared_gpu.py --rendered rendered/shared-llama31-8b.yaml \
        --oci-serving oci/shared --oci-server oci/shared-server --out OUT [--budget-s 540]

`--rendered` is `kvoffload render --node NODE` of a PerNode resource (its StatefulSet and NODE's server Deployment).
Phases, each saved to OUT/results.json as it ends:
  start      the server pod (init steps, then `lmcache server` until its startup probe passes), then replicas A and B
             (their init steps wait for the server, as on a node), both vLLMs starting at once;
  share      per prompt (fresh random ids, --prompt-tokens): A cold (computes and stores), then B's first request
             for it (the second replica: served from the node's server?) and B cold on another prompt (recompute);
  restart    replica A's pod deleted and recreated (new emptyDirs except the compile cache, its init steps again),
             then its first request for each prompt stored before;
  outage     requests to both replicas all along (--load-threads each, a shared prefix + a new suffix); the
             server's container killed (SIGKILL, as an OOM kill or a crash), its pod replaced after --outage-s (the
             Deployment's new pod: init steps again, the L2 kept by the disk fingerprint), the load kept on until
             both replicas are registered again; every request's status and time;
  reload     after A's GPU prefix cache is reset, A's first request for each prompt stored before the outage: from
             the new server's L2 (the kept disk tier) into its empty L1; A cold on a new prompt beside it.
Every token generated from a shared-tier hit is compared with the one generated from the GPU (the same KV).
`--plan reload` runs replica A alone: stores, the server's pod replaced, a new pod of A, its first requests from the
kept L2 (reload_plan says why a new pod).

What differs from a node, each listed in results.json `changes`: the three pods share this process's network
namespace (loopback): the Service's DNS name -> 127.0.0.1 (on a node, kube-proxy's internalTrafficPolicy Local
sends each replica to its own node's server), replica B's vLLM port 8000 -> 8001 and its exporter's 9400 -> 9401
(two pods cannot bind one port in one namespace); both vLLMs --gpu-memory-utilization 0.4 (two on one GPU); the
admin's tmpfs root is a tmpfs mounted here, the disk root a directory of the host's disk; the model is
config.json + --load-format dummy (gpu_manifests); vLLM's compile cache (home) is one directory for every
replica's pod, B starting once A's KV cache is allocated (start-up time only). The rest is gpu_pod's, as for
gpu_bench --runtime crun.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gpu_bench as gb
import gpu_manifests as gm
import gpu_pod
import yaml

from kvoffload.rendering import shared_cache

SERVER_NODE = "gpu-host"  # the node name the rendering was made for (stage.sh: kvoffload render --node gpu-host)
PORTS = {"A": (8000, 9400), "B": (8001, 9401)}
KV_ALLOCATED = "GPU KV cache size"  # vLLM's log line once the KV cache is sized (after profiling and compiling)
SEEDS = {"share": 3500, "cold": 3600, "load": 3700, "reload": 3800}
DISK_INIT = "prepare-disk-tier"
OWNER_UID = "35353535-0000-4000-8000-000000000035"  # the resource's metadata.uid, as the operator would pass it
T0 = time.monotonic()


def log(msg: str) -> None:
    gb.log(msg)


def retag(specs: dict[str, dict[str, Any]], pod: str) -> dict[str, dict[str, Any]]:
    """The captured specs with a pod cgroup of their own: each replica here is another pod of one capture."""
    out = copy.deepcopy(specs)
    for s in out.values():
        lx = s.setdefault("linux", {})
        path = lx.get("cgroupsPath", "")
        parent, _, leaf = path.rpartition("/")
        lx["cgroupsPath"] = f"{parent}-{pod}/{leaf}"
    return out


def rewrite_argv(run: gm.PodRun, old: str, new: str) -> None:
    for i, c in enumerate(run.containers):
        run.containers[i] = dataclasses.replace(c, argv=[a.replace(old, new) for a in c.argv])


def set_flag(argv: list[str], name: str, value: str) -> list[str]:
    out = list(argv)
    i = out.index(name)
    out[i + 1] = value
    return out


def prepare_and_init(pod: gpu_pod.Pod, run: gm.PodRun, tag: str, out: dict[str, Any]) -> None:
    """A pod laid out (its changes recorded under `tag`) and its init steps run to completion, in order, as kubelet
    runs them; one that fails stops the run."""
    pod.prepare()
    out.setdefault("oci_changes", {})[tag] = pod.changes
    out.setdefault("run_changes", {})[tag] = run.changes
    inits = out.setdefault("init", {})[tag] = []
    for b in pod.of_role("init"):
        res = b.run_to_completion(300)
        inits.append(res)
        log(f"{tag}: init {b.pc.name} rc {res['rc']} in {res['s']} s: {res['output'].strip()[-200:]}")
        if res["rc"] != 0:
            raise RuntimeError(f"{tag}: init {b.pc.name} exited {res['rc']}")


class Replica:
    """One serving pod of the resource: its containers under crun, its vLLM as a gpu_bench.Engine."""

    def __init__(self, key: str, ordinal: int, r: gm.Rendered, specs: dict[str, dict[str, Any]], cfg: dict[str, Any],
                 args: argparse.Namespace, shm_root: str) -> None:
        self.key, self.ordinal, self.r, self.args, self.cfg = key, ordinal, r, args, cfg
        self.specs, self.shm_root = specs, shm_root
        self.pod: gpu_pod.Pod | None = None
        self.eng: gb.Engine | None = None
        self.incarnation = 0

    def make(self) -> gm.PodRun:
        a = self.args
        port, xport = PORTS[self.key]
        run = gm.containerize(self.r, f"{a.work}/{self.key}", "", connector=True, model_config=self.cfg,
                              serving_env=gb.BASE_ENV, kept={"home": f"{a.work}/kept-home"},
                              extra_args=["--gpu-memory-utilization", str(a.gpu_memory_utilization)],
                              host_paths={"dshm": self.shm_root}, pod_name=f"{self.r.name}-{self.ordinal}")
        rewrite_argv(run, shared_cache.dns_address(self.r.name, self.r.namespace), gm.POD_IP)
        main = run.container("main")
        x = run.container("exporter")
        if port != 8000:
            for i, c in enumerate(run.containers):
                if c is main:
                    run.containers[i] = dataclasses.replace(c, argv=set_flag(c.argv, "--port", str(port)))
                elif c is x:
                    argv = set_flag(c.argv, "--listen", f"{gm.POD_IP}:{xport}")
                    argv = set_flag(argv, "--vllm-metrics-url", f"http://127.0.0.1:{port}/metrics")
                    run.containers[i] = dataclasses.replace(c, argv=argv)
            run.port, run.exporter_port = port, xport
        return run

    def start_pod(self, out: dict[str, Any]) -> None:
        """A new pod of this replica: init steps to completion, then vLLM and the exporter (not waited for)."""
        self.incarnation += 1
        run = self.make()
        name = f"{self.r.name}-{self.ordinal}"
        self.pod = gpu_pod.Pod(run, retag(self.specs, f"{self.key}{self.incarnation}"), name=name,
                               tag=f"{self.key}{self.incarnation}", work=f"{self.args.work}/{self.key}",
                               logdir=str(Path(self.args.out, "logs")), namespaces=gpu_pod.SANDBOX,
                               python=self.args.python, crun=self.args.crun, host=gpu_pod.HOST,
                               other_shape=self.args.oci_other_shape)
        prepare_and_init(self.pod, run, f"{self.key}{self.incarnation}", out)
        self.t_start = time.monotonic()
        proc = self.pod.box(run.container("main").name).start()
        self.eng = gb.Engine(run.port, gm.flag(run.container("main").argv, "--served-model-name") or gm.MODEL_DIR,
                             proc, self.pod.box(run.container("main").name).log, self.args.status_url)
        self.run = run

    def wait_kv_allocated(self) -> float:
        """Until vLLM logs its KV cache's size (its memory profiling is over and its compile cache written), so
        that the next engine's start-up memory check and profiling see this one's allocation settled."""
        end = time.monotonic() + self.args.start_timeout
        while time.monotonic() < end and self.eng.proc.poll() is None:
            try:
                if KV_ALLOCATED in self.eng.logfile.read_text(errors="replace"):
                    break
            except OSError:
                pass
            time.sleep(1)
        return round(time.monotonic() - self.t_start, 1)

    def wait_ready(self) -> float:
        gb.wait_http(self.run.port, "/health", time.monotonic() + self.args.start_timeout, self.eng.proc,
                     f"vLLM {self.key}")
        x = self.run.container("exporter")
        if x:
            self.pod.box(x.name).start()
        return round(time.monotonic() - self.t_start, 1)

    def delete(self) -> None:
        if self.pod is not None:
            self.pod.cleanup()
            self.pod = None


def with_owner_uid(run: gm.PodRun) -> gm.PodRun:
    """The server's disk-tier init step with the resource's uid, which the operator writes and offline rendering
    cannot (without one the step empties the L2 at every start: it cannot tell whose the files are)."""
    for i, c in enumerate(run.containers):
        if c.name == DISK_INIT and "--owner-uid" not in c.argv:
            run.containers[i] = dataclasses.replace(c, argv=[*c.argv, "--owner-uid", OWNER_UID])
    return run


class Server:
    """The node's server pod (the Deployment's): a new pod at each start, its L2 directory kept."""

    def __init__(self, doc: dict[str, Any], specs: dict[str, dict[str, Any]], args: argparse.Namespace,
                 host_paths: dict[str, str], image: str) -> None:
        self.doc, self.specs, self.args, self.host_paths, self.image = doc, specs, args, host_paths, image
        self.pod: gpu_pod.Pod | None = None
        self.incarnation = 0

    def start(self, out: dict[str, Any]) -> float:
        self.incarnation += 1
        tag = f"server{self.incarnation}"
        name = f"{self.doc['metadata']['name']}-{self.incarnation}"
        run = with_owner_uid(gm.plain_pod(self.doc, f"{self.args.work}/server", self.host_paths, name, self.image,
                                          gb.BASE_ENV))
        self.pod = gpu_pod.Pod(run, retag(self.specs, tag), name=name, tag=tag, work=f"{self.args.work}/server",
                               logdir=str(Path(self.args.out, "logs")), namespaces=gpu_pod.SANDBOX,
                               python=self.args.python, crun=self.args.crun, host=gpu_pod.HOST,
                               other_shape=self.args.oci_other_shape)
        t0 = time.monotonic()
        prepare_and_init(self.pod, run, tag, out)
        main = self.pod.box(run.container("main").name)
        main.start()
        self.main = main
        self.sampler = gb.MemSampler(main.cgroup)
        self.sampler.start()
        while main.pc.probe and main.exec(main.pc.probe) != 0:
            if main.proc.poll() is not None:
                raise RuntimeError(f"{tag}: lmcache server exited {main.proc.returncode} before its startup probe")
            if time.monotonic() - t0 > self.args.start_timeout:
                raise RuntimeError(f"{tag}: startup probe still failing")
            time.sleep(0.5)
        return round(time.monotonic() - t0, 1)

    def kill(self) -> None:
        """SIGKILL to every process of the container (crun kill -a): a crash, no clean-up of its own."""
        import subprocess
        subprocess.run(self.main._crun("kill", "-a", self.main.id, "KILL"), capture_output=True, timeout=30)

    def delete(self, out: dict[str, Any]) -> None:
        if self.pod is None:
            return
        self.sampler.halt.set()
        self.sampler.join(5)
        out.setdefault("server_memory", {})[self.pod.tag] = {"limit": self.main.pc.memory_limit,
                                                             **self.sampler.summary()}
        out.setdefault("server_events", {})[self.pod.tag] = self.main.events()
        self.pod.cleanup()
        self.pod = None


def shm_facts(root: str, cgroups: dict[str, str | None]) -> dict[str, Any]:
    """The admin's tmpfs after a server's restart: its room (LMCache 0.5.3 wants a whole L1 free, else it pickles),
    its files, and how many processes of each cgroup still map an unlinked L1 segment (an engine that keeps its map of
    the killed server's segment keeps its pages in the tmpfs until it lets go)."""
    du = shutil.disk_usage(root)
    files = {str(f.relative_to(root)): f.stat().st_size for f in Path(root).rglob("*") if f.is_file()}
    mapped: dict[str, int] = {}
    for key, cg in cgroups.items():
        n = 0
        for pid in Path(cg, "cgroup.procs").read_text().split() if cg else []:
            try:
                n += any("lmcache_l1_pool" in line and "(deleted)" in line
                         for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
            except OSError:
                continue
        mapped[key] = n
    return {"used_bytes": du.used, "free_bytes": du.free, "files": files, "unlinked_segment_mapped_by": mapped}


def status(url: str) -> dict[str, Any] | None:
    try:
        return gb.server_status(url)
    except (OSError, RuntimeError, ValueError):
        return None


def registered(doc: dict[str, Any] | None) -> int:
    if not doc:
        return 0
    return len(doc.get("registered_gpu_ids") or []) + len(doc.get("registered_non_cuda_instance_ids") or [])


def wait_stored(url: str, before: float, deadline_s: float = 30) -> float:
    """Until the server's L1 stops growing after a store (the cold request's KV arrives after its answer)."""
    t0 = time.monotonic()
    last, since = gb.l1_used(status(url)), time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        time.sleep(0.25)
        now = gb.l1_used(status(url))
        if now != last:
            last, since = now, time.monotonic()
        elif now > before and time.monotonic() - since > 1.0:
            break
    return round(time.monotonic() - t0, 2)


class Load(threading.Thread):
    """Requests to one replica, one after another, until stopped: a prefix shared by all (GPU hits) and a new
    suffix each (a lookup through the server, a compute, and a store when the suffix is a full chunk). Every
    request's start, end and status."""

    def __init__(self, key: str, port: int, model: str, seed: int, tokens: int, suffix: int, timeout: float) -> None:
        super().__init__(daemon=True)
        self.key, self.port, self.model, self.seed, self.tokens, self.timeout = key, port, model, seed, tokens, timeout
        self.suffix = suffix
        self.halt = threading.Event()
        self.records: list[dict[str, Any]] = []

    def run(self) -> None:
        prefix = gb.prompt(SEEDS["load"], self.tokens)
        i = 0
        while not self.halt.is_set():
            ids = prefix + gb.prompt(self.seed * 100000 + i, self.suffix)
            t = time.monotonic()
            try:
                code, body = gb.http_req(self.port, "POST", "/v1/completions",
                                         {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0},
                                         timeout=self.timeout)
                err = "" if code == 200 else body[:200]
            except OSError as exc:
                code, err = 0, f"{type(exc).__name__}: {exc}"
            self.records.append({"replica": self.key, "t0": round(t - T0, 3), "s": round(time.monotonic() - t, 3),
                                 "status": code, **({"error": err} if err else {})})
            i += 1


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def save(out: dict[str, Any], args: argparse.Namespace) -> None:
    p = Path(args.out) / "results.json"
    p.with_suffix(".tmp").write_text(json.dumps(out, indent=1, sort_keys=True, default=str))
    p.with_suffix(".tmp").replace(p)


def left(args: argparse.Namespace) -> float:
    return args.budget_s - (time.monotonic() - T0) if args.budget_s else 1e9


def first_requests(eng: gb.Engine, stored: list[Any], gpu: list[dict[str, Any]], cold_seed: int,
                   tokens: int) -> dict[str, Any]:
    """Each stored prompt's first request on `eng` (a hit from the shared tier, or not), its token against the one
    generated from the GPU's KV (`gpu`, per prompt), and a cold request for a new prompt beside them."""
    rows = []
    for k, p in enumerate(stored):
        x = eng.complete(p)
        x["token_same"] = x["output_token_ids"] == gpu[k]["output_token_ids"]
        rows.append(x)
    out: dict[str, Any] = {"first": rows, "cold_other": eng.complete(gb.prompt(cold_seed, tokens)),
                           "first_median_s": median([x["ttft_s"] for x in rows])}
    out["speedup"] = round(out["cold_other"]["ttft_s"] / out["first_median_s"], 2)
    return out


def reload_plan(args: argparse.Namespace, server: Server, a: Replica, l2: str, out: dict[str, Any]) -> None:
    """--plan reload: the server's pod replaced (killed, its successor over the kept L2, its L1 empty), then a new pod
    of replica A: its first requests for the prompts stored before come from the L2 only. A new pod because LMCache
    0.5.3's connector in a running vLLM never looks anything up again once a lookup timed out during an outage (its
    scheduler-side heartbeat never starts; 0.5.6 starts it): the full plan's reload phase measured that, not the L2."""
    ph = out["phases"]
    ph["start"] = {"server_ready_s": server.start(out)}
    a.start_pod(out)
    ph["start"]["A_ready_s"] = a.wait_ready()
    a.eng.complete(gb.prompt(1, 512))  # warm-up, not measured
    stored, rows = [], []
    for k in range(args.reps):
        p = gb.prompt(SEEDS["share"] + k, args.prompt_tokens)
        l1 = gb.l1_used(status(args.status_url))
        row: dict[str, Any] = {"A_cold": a.eng.complete(p)}
        row["store_wait_s"] = wait_stored(args.status_url, l1)
        row["A_gpu"] = a.eng.complete(p)
        rows.append(row)
        stored.append(p)
    ph["store"] = rows
    log(f"stored {len(stored)} prompts: cold {[x['A_cold']['ttft_s'] for x in rows]} s")
    save(out, args)
    r = ph["server_restart"] = {"l2_quiet_at": gb.wait_disk_quiet(l2, deadline_s=30), "l2_before": gb.scan_disk(l2)}
    server.kill()
    time.sleep(args.outage_s)
    server.delete(out)
    r["server_ready_s"] = server.start(out)
    a.delete()
    a.start_pod(out)
    r["A_ready_s"] = a.wait_ready()
    r["registered"] = registered(status(args.status_url))
    log(f"server and replica A replaced: server ready {r['server_ready_s']} s, A {r['A_ready_s']} s")
    ph["reload"] = {"status_before": status(args.status_url)}
    ph["reload"].update(first_requests(a.eng, stored, [x["A_gpu"] for x in rows], SEEDS["reload"], args.prompt_tokens))
    ph["reload"]["status_after"] = status(args.status_url)
    log(f"reload: from L2 {[x['ttft_s'] for x in ph['reload']['first']]} s "
        f"({[round(x['external_kv_transfer']) for x in ph['reload']['first']]} tokens), cold "
        f"{ph['reload']['cold_other']['ttft_s']} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rendered", required=True)
    ap.add_argument("--oci-serving", required=True, help="the captured specs of the serving pod")
    ap.add_argument("--oci-server", required=True, help="the captured specs of the node's server pod")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/var/tmp/kvshared")
    ap.add_argument("--shm-root", default="/var/tmp/kvshared-shm", help="a tmpfs is mounted here (the admin's root)")
    ap.add_argument("--shm-bytes", type=int, default=96 * 2**30,
                    help="two L1s and room to spare: a server's restart while the engines may still map the killed "
                    "one's segment (shm_facts records whether they do)")
    ap.add_argument("--disk-root", default="/var/tmp/kvshared-disk", help="the node's NVMe root (kept)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--crun", default="crun")
    ap.add_argument("--prompt-tokens", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--load-tokens", type=int, default=4096)
    ap.add_argument("--load-threads", type=int, default=2)
    ap.add_argument("--load-suffix-tokens", type=int, default=128,
                    help="each load request's new suffix: under a chunk, so the load stores nothing past its prefix "
                    "(a full chunk each, ~70 requests/s, writes ~2 GB/s to the L2, whose newest 20%% the init keeps)")
    ap.add_argument("--outage-s", type=float, default=15, help="from the kill to the new server pod")
    ap.add_argument("--budget-s", type=float, default=0, help="skip a phase that would not end within this")
    ap.add_argument("--plan", choices=("full", "reload"), default="full",
                    help="reload: replica A only, the server's pod replaced, then a new pod of A (reload_plan)")
    ap.add_argument("--dry-run", action="store_true", help="lay out the pods' bundles only")
    ap.add_argument("--oci-other-shape", action="store_true",
                    help="the captures are of pods of another shape (mounts added/dropped, listed): a check only")
    args = ap.parse_args(argv)
    gb.REQUEST_TIMEOUT_S = args.request_timeout
    Path(args.out, "logs").mkdir(parents=True, exist_ok=True)
    docs = [d for d in yaml.safe_load_all(Path(args.rendered).read_text()) if d]
    r = gm.parse_rendered(Path(args.rendered).read_text())
    server_doc = next(d for d in docs if d["kind"] == "Deployment"
                      and (d["metadata"].get("annotations") or {}).get(shared_cache.NODE_ANNOTATION) == SERVER_NODE)
    http_port = gm.flag(server_doc["spec"]["template"]["spec"]["containers"][0]["args"], "--http-port")
    args.status_url = f"http://127.0.0.1:{http_port}/status"
    cfg = gb.catalog_config(gm.flag(gm.exec_argv(r.vllm)[0], "--served-model-name") or gm.exec_argv(r.vllm)[0][2])
    changes = [f"the Service's address {shared_cache.dns_address(r.name, r.namespace)} -> {gm.POD_IP}: the pods share "
               "this process's network namespace (on a node kube-proxy sends each replica to its node's server)",
               f"replica B: vLLM --port {PORTS['B'][0]}, exporter --listen {gm.POD_IP}:{PORTS['B'][1]} (one namespace)",
               f"both vLLMs: --gpu-memory-utilization {args.gpu_memory_utilization} (two replicas on one GPU)",
               f"the admin's tmpfs root: a tmpfs of {args.shm_bytes} bytes at {args.shm_root}; the disk root "
               f"{args.disk_root} on the host's disk, kept across the server's pods",
               f"the server's {DISK_INIT}: --owner-uid {OWNER_UID} (the operator passes the resource's uid; "
               "offline rendering has none)",
               "vLLM's compile cache (home): one directory for both replicas and all their pods, B started once A's "
               "KV cache was allocated (start-up time only)"]
    out: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args),
                           "changes": changes, "phases": {}}
    if args.dry_run:
        gpu_pod.SANDBOX.update(gpu_pod.NS_FILES)
    else:
        gpu_pod.SANDBOX.update(gpu_pod.enter_sandbox(SERVER_NODE))
        for d in (args.shm_root, args.disk_root):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        gpu_pod._mount("tmpfs", args.shm_root, f"mode=0755,size={args.shm_bytes}")
    gpu_pod.HOST = gpu_pod.host_facts()
    serving_specs = gpu_pod.load_specs(args.oci_serving)
    server = Server(server_doc, gpu_pod.load_specs(args.oci_server), args,
                    {"dshm": args.shm_root, "kv-disk": args.disk_root}, r.vllm.image)
    reps = {k: Replica(k, i, r, serving_specs, cfg, args, args.shm_root) for i, k in enumerate(PORTS)}

    def stop_everything(*_: Any) -> None:
        for x in reps.values():
            x.delete()
        server.delete(out)
        gpu_pod.stop_all()
        gpu_pod._umount(args.shm_root)

    signal.signal(signal.SIGTERM, lambda *a: (stop_everything(), sys.exit(143)))
    ph = out["phases"]
    try:
        if args.dry_run:
            for x in reps.values():
                run = x.make()
                pod = gpu_pod.Pod(run, retag(serving_specs, x.key), name=f"{r.name}-{x.ordinal}", tag=x.key,
                                  work=f"{args.work}/{x.key}", logdir=str(Path(args.out, "logs")),
                                  namespaces=gpu_pod.SANDBOX, python=args.python, crun=args.crun,
                                  host=gpu_pod.HOST, dry_run=True, other_shape=args.oci_other_shape)
                pod.prepare()
                out.setdefault("dry", {})[x.key] = {"changes": pod.changes, "argv": {c.name: c.argv
                                                                                     for c in run.containers}}
            run = with_owner_uid(gm.plain_pod(server_doc, f"{args.work}/server", server.host_paths, "server-1",
                                              r.vllm.image, gb.BASE_ENV))
            pod = gpu_pod.Pod(run, retag(server.specs, "server"), name="server-1", tag="server",
                              work=f"{args.work}/server", logdir=str(Path(args.out, "logs")),
                              namespaces=gpu_pod.SANDBOX, python=args.python, crun=args.crun, host=gpu_pod.HOST,
                              dry_run=True, other_shape=args.oci_other_shape)
            pod.prepare()
            out.setdefault("dry", {})["server"] = {"changes": pod.changes,
                                                   "argv": {c.name: c.argv for c in run.containers}}
            return 0

        l2 = f"{args.disk_root}/lmcache/{r.namespace}/{r.name}/{shared_cache.server_dir(r.name)}"
        if args.plan == "reload":
            reload_plan(args, server, reps["A"], l2, out)
            return 0
        # start
        ph["start"] = {"server_ready_s": server.start(out), "server_status": status(args.status_url)}
        log(f"server ready after {ph['start']['server_ready_s']} s")
        # One after the other: B starts once A's memory is settled (routing_gpu found two engines profiling at once
        # unreliable) and A's compile cache is written, which B reads from the shared home (start-up time only).
        reps["A"].start_pod(out)
        ph["start"]["A_kv_allocated_s"] = reps["A"].wait_kv_allocated()
        reps["B"].start_pod(out)
        for x in reps.values():
            ph["start"][f"{x.key}_ready_s"] = x.wait_ready()
            log(f"replica {x.key} healthy after {ph['start'][f'{x.key}_ready_s']} s")
        for x in reps.values():
            x.eng.complete(gb.prompt(1 + x.ordinal, 512))  # warm-up, not measured
        ph["start"]["registered"] = registered(status(args.status_url))
        save(out, args)

        # share
        a, b = reps["A"].eng, reps["B"].eng
        stored = []
        rows = ph["share"] = []
        for k in range(args.reps):
            p = gb.prompt(SEEDS["share"] + k, args.prompt_tokens)
            l1 = gb.l1_used(status(args.status_url))
            row: dict[str, Any] = {"A_cold": a.complete(p)}
            row["store_wait_s"] = wait_stored(args.status_url, l1)
            row["B_first"] = b.complete(p)
            row["B_cold_other"] = b.complete(gb.prompt(SEEDS["cold"] + k, args.prompt_tokens))
            row["A_gpu"] = a.complete(p)
            row["token_same"] = row["B_first"]["output_token_ids"] == row["A_gpu"]["output_token_ids"]
            rows.append(row)
            stored.append(p)
            log(f"share {k}: A cold {row['A_cold']['ttft_s']:.3f} s, B first {row['B_first']['ttft_s']:.3f} s "
                f"({row['B_first']['external_kv_transfer']:.0f} tokens from the server), B cold "
                f"{row['B_cold_other']['ttft_s']:.3f} s, same token {row['token_same']}")
            save(out, args)
        ph["share_summary"] = {
            "B_first_median_s": median([x["B_first"]["ttft_s"] for x in rows]),
            "recompute_median_s": median([x["B_cold_other"]["ttft_s"] for x in rows]),
            "A_cold_median_s": median([x["A_cold"]["ttft_s"] for x in rows])}
        s = ph["share_summary"]
        s["speedup"] = round(s["recompute_median_s"] / s["B_first_median_s"], 2) if s["B_first_median_s"] else None
        log(f"share: {s}")
        # Who pays for the L1 (tmpfs pages are charged to the cgroup that first touched them): each vLLM's cgroup and
        # the server's, with the host's Shmem.
        ph["cgroups_after_share"] = {"server": gb.cgroup_stat(server.main.cgroup), "meminfo": gb.meminfo(),
                                     **{x.key: gb.cgroup_stat(x.pod.box(x.run.container("main").name).cgroup)
                                        for x in reps.values()}}
        save(out, args)

        # restart: A's pod deleted and recreated
        if left(args) > 230:  # its ~110 s, and the outage's after it
            t0 = time.monotonic()
            reps["A"].delete()
            reps["A"].start_pod(out)
            ph["restart"] = {"ready_s": reps["A"].wait_ready()}
            a = reps["A"].eng
            ph["restart"]["registered"] = registered(status(args.status_url))
            ph["restart"].update(first_requests(a, stored, [x["A_gpu"] for x in ph["share"]], SEEDS["cold"] + 50,
                                                args.prompt_tokens))
            ph["restart"]["wall_s"] = round(time.monotonic() - t0, 1)
            log(f"restart: ready {ph['restart']['ready_s']} s, first {ph['restart']['first_median_s']} s, cold "
                f"{ph['restart']['cold_other']['ttft_s']} s")
            save(out, args)
        else:
            ph["restart"] = {"skipped": f"{left(args):.0f} s left"}

        # outage: the server killed under load, its pod replaced
        if left(args) > 110:
            ph["outage"] = {"l2_quiet_at": gb.wait_disk_quiet(l2, deadline_s=30), "l2_before": gb.scan_disk(l2)}
            loads = [Load(x.key, x.run.port, x.eng.model, 10 * i + j, args.load_tokens, args.load_suffix_tokens,
                          args.request_timeout)
                     for i, x in enumerate(reps.values()) for j in range(args.load_threads)]
            for ld in loads:
                ld.start()
            time.sleep(8)
            ph["outage"]["kill_at"] = round(time.monotonic() - T0, 3)
            server.kill()
            log("server killed")
            time.sleep(args.outage_s)
            server.delete(out)
            ph["outage"]["new_pod_at"] = round(time.monotonic() - T0, 3)
            ph["outage"]["server_ready_s"] = server.start(out)
            ph["outage"]["ready_at"] = round(time.monotonic() - T0, 3)
            log(f"new server pod ready after {ph['outage']['server_ready_s']} s")
            end = time.monotonic() + 60
            while registered(status(args.status_url)) < len(reps) and time.monotonic() < end:
                time.sleep(1)
            ph["outage"]["registered_at"] = round(time.monotonic() - T0, 3)
            ph["outage"]["registered"] = registered(status(args.status_url))
            ph["outage"]["shm_after"] = shm_facts(args.shm_root, {
                "server": server.main.cgroup, **{x.key: x.pod.box(x.run.container("main").name).cgroup
                                                 for x in reps.values()}})
            log(f"tmpfs after the server's restart: {ph['outage']['shm_after']}")
            time.sleep(5)
            for ld in loads:
                ld.halt.set()
            for ld in loads:
                ld.join(args.request_timeout + 10)
            recs = sorted((x for ld in loads for x in ld.records), key=lambda x: x["t0"])
            ph["outage"]["requests"] = recs
            ph["outage"]["answered"] = sum(x["status"] == 200 for x in recs)
            ph["outage"]["failed"] = sum(x["status"] != 200 for x in recs)
            ph["outage"]["slowest_s"] = max((x["s"] for x in recs), default=None)
            log(f"outage: {ph['outage']['answered']} answered, {ph['outage']['failed']} failed, slowest "
                f"{ph['outage']['slowest_s']} s, registered again {ph['outage']['registered']}")
            save(out, args)

            # reload: each prompt stored before the outage, from the new server's L2 (its L1 started empty)
            ph["reload"] = {"reset": a.reset_prefix_cache(), "status_before": status(args.status_url)}
            ph["reload"].update(first_requests(a, stored, [x["A_gpu"] for x in ph["share"]], SEEDS["reload"],
                                               args.prompt_tokens))
            ph["reload"]["status_after"] = status(args.status_url)
            log(f"reload: from L2 {[x['ttft_s'] for x in rows]} s "
                f"({[round(x['external_kv_transfer']) for x in rows]} tokens), cold "
                f"{ph['reload']['cold_other']['ttft_s']} s")
        else:
            ph["outage"] = {"skipped": f"{left(args):.0f} s left"}
        save(out, args)
        return 0
    except Exception as exc:  # recorded; what was measured before it is kept
        out["error"] = f"{type(exc).__name__}: {exc}"
        log(f"ERROR {out['error']}")
        return 1
    finally:
        if not args.dry_run:
            for x in reps.values():
                if x.pod is not None:
                    out.setdefault("memory_events", {})[x.key] = {n: b.events() for n, b in x.pod.boxes.items()}
            stop_everything()
        out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        out["wall_s"] = round(time.monotonic() - T0, 1)
        save(out, args)
        gb.pack_logs(args)


if __name__ == "__main__":
    sys.exit(main())
