"""Run the rendered pod's containers under a real OCI runtime (crun) on the GPU host, each with the
OCI spec the real node's containerd generated for it (benchmarks/gpu/oci/<pod>/<container>.json),
rewritten by gpu_oci for this host. gpu_bench uses it with `--runtime crun`.

What stands in for the kubelet, and how:
- the sandbox: this process enters a new network, IPC and UTS namespace at start (loopback only, the
  pod's hostname), and every container joins them, as they join the pause container's;
- volumes: one host directory per volume; a memory-backed emptyDir is a tmpfs of its sizeLimit
  (kubelet's rule), the sandbox's /dev/shm a 64 MiB tmpfs (containerd's), the hostPath a directory
  on the host's disk; subPathExpr is expanded from the container's env (kubelet refuses a missing
  variable; so does gpu_manifests); /etc/hosts, /etc/hostname, /etc/resolv.conf (127.0.0.1 only);
- cgroups: the captured pod cgroup (kubepods/<qos>/pod<uid>) with the pod-level memory.max kubelet
  sets (the sum of the containers' limits), each container under it with its captured limit;
- order: init containers to completion, then native sidecars until their startup probe (run in the
  container with `crun exec`, as kubelet execs it) passes, then vLLM and the exporter;
- the image: a root of the host's /usr, /opt, /etc read-only; the serving image's Python packages
  are the host's torch plus the carried wheels (/opt/kvimage/serving), the operator image's the
  operator package (/opt/kvimage/operator).
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import glob
import json
import os
import resource
import shutil
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import gpu_manifests as gm
import gpu_oci

from kvoffload.engine import images

CGROUP = Path("/sys/fs/cgroup")
IMAGES = "/opt/kvimage"  # serving/{site,bin}, operator/{site,bin}: written by the device script
CRUN_ROOT = "/run/kvbench-crun"
SANDBOX_SHM_BYTES = 64 * 2**20
CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWUTS = 0x40000000, 0x08000000, 0x04000000
NS_FILES = {"network": "/proc/self/ns/net", "ipc": "/proc/self/ns/ipc", "uts": "/proc/self/ns/uts"}


# ---------------------------------------------------------------- the sandbox

def enter_sandbox(hostname: str) -> dict[str, str]:
    """This process (before any thread) into its own network, IPC and UTS namespaces, loopback up:
    the pod's sandbox. Returns the namespace files the containers join."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(net, ipc, uts)")
    socket.sethostname(hostname)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # ip link set lo up
        req = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s.fileno(), 0x8913, req))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH14s", b"lo", flags | 0x1, b""))  # SIOCSIFFLAGS IFF_UP
    return {t: f.replace("self", str(os.getpid())) for t, f in NS_FILES.items()}


def host_facts() -> gpu_oci.Host:
    devices = []
    for path in sorted(glob.glob("/dev/nvidia*") + glob.glob("/dev/nvidia-caps/*")):
        st = os.stat(path)
        if (st.st_mode & 0o170000) == 0o020000:  # character device
            devices.append(gpu_oci.Device(path, os.major(st.st_rdev), os.minor(st.st_rdev), st.st_mode & 0o777))
    names = {n for n in dir(resource) if n.startswith("RLIMIT_")}
    hard = {n: resource.getrlimit(getattr(resource, n))[1] for n in names}
    hard = {n: (2**63 - 1 if v == resource.RLIM_INFINITY else v) for n, v in hard.items()}
    cc = CGROUP / "cgroup.controllers"
    controllers = frozenset(cc.read_text().split()) if cc.exists() else frozenset()
    sizes = frozenset(d.split("-")[1].replace("kB", "KB") for d in os.listdir("/sys/kernel/mm/hugepages")) \
        if os.path.isdir("/sys/kernel/mm/hugepages") else frozenset()
    sizes = frozenset({"2048KB": "2MB", "1048576KB": "1GB"}.get(x, x) for x in sizes)
    aa = Path("/sys/kernel/security/apparmor/profiles")
    profiles = frozenset(ln.split(" ")[0] for ln in aa.read_text().splitlines()) if aa.exists() else frozenset()
    dirs = tuple(d for d in ("/usr", "/opt", "/etc") if os.path.isdir(d) and not os.path.islink(d))
    existing = frozenset(d for d in gpu_oci.POD_FILES if os.path.exists(d))
    mem = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
               if ln.startswith("MemTotal:"))
    return gpu_oci.Host(image_dirs=dirs, devices=tuple(devices), rlimit_hard=hard, controllers=controllers,
                        hugepage_sizes=sizes, apparmor_profiles=profiles, existing=existing, memory_capacity=mem)


# The engine pair whose torch the GPU host has (2.11.0): its stand-in image is the host's torch plus the carried wheels
# under the first protocol's names (serving/, the carry's site.part*, the bundle .gpu/, `dev.sh plan`); any other pair
# carries its own torch (serving-<pair>/, site-<pair>.part*, .gpup-<pair>/). Not the operator's default pair, which is
# vLLM 0.33.0 + LMCache 0.5.6 since 3 Dec 2026. dev.sh, stage.sh and carry.sh read this line.
HOST_PAIR = "0.26.0-0.5.3"


def stand_in(image: str) -> str:
    """The directory under IMAGES standing in for an image: operator/ for the operator image; for a serving image
    serving/ when it holds HOST_PAIR (the host's torch + wheels) and serving-<vllm>-<lmcache>/ for another
    pair (its own torch: `dev.sh install 0.33.0-0.5.6`). vLLM's official image (backend vllm-native) stands on the
    serving image of its vLLM version: the same vLLM, LMCache unused; an image of no offered pair on HOST_PAIR's."""
    if "kvoffload/kvoffload" in image:
        return "operator"
    pairs = {i: f"{k.vllm}-{k.lmcache}" for i, k in images.serving_images().items()}
    pairs.update({f"vllm/vllm-openai:v{k.vllm}": f"{k.vllm}-{k.lmcache}" for k in images.serving_images().values()})
    pair = pairs.get(image, HOST_PAIR)
    return "serving" if pair == HOST_PAIR else f"serving-{pair}"


def image_env(image: str, python: str) -> dict[str, str]:
    """The environment the stand-in image gives: its packages' bin and site dirs before the host's Python
    (PYTHONPATH comes first on sys.path: a carried torch shadows the host's)."""
    which = stand_in(image)
    pybin = os.path.dirname(os.path.abspath(python))  # the venv's bin, not the interpreter it links to
    env = {"PATH": f"{IMAGES}/{which}/bin:{pybin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "PYTHONPATH": f"{IMAGES}/{which}/site", "PYTHONUNBUFFERED": "1"}
    if which != "operator":  # what a CUDA base image sets; the driver libraries are the host's
        ld = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
        for p in ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib"):
            if p not in ld and os.path.isdir(p):
                ld.append(p)
        env.update({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
                    **({"LD_LIBRARY_PATH": ":".join(ld)} if ld else {})})
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def load_specs(oci_dir: str, alias: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """{container: captured spec} from a capture directory (capture.py's layout: one JSON per container).
    `alias` names a captured container for a rendered one the capture lacks (vllm -> the capture's vllm)."""
    out = {}
    for p in sorted(Path(oci_dir).glob("*.json")):
        if p.stem not in ("sandbox", "changes"):  # changes.json: what capture.for_cpu_node changed
            out[p.stem] = json.loads(p.read_text())
    if not out:
        raise SystemExit(f"no captured OCI specs in {oci_dir}")
    for name, other in (alias or {}).items():
        out.setdefault(name, out[other])
    return out


# ---------------------------------------------------------------- the pod

def _mount(fstype: str, target: str, options: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(fstype.encode(), target.encode(), fstype.encode(), 0, options.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount {fstype} {target} {options}")


def _umount(target: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(target.encode(), 2)  # MNT_DETACH


def _cgroup_path(rel: str) -> Path:
    return CGROUP / rel.lstrip("/")


def _make_cgroup(path: Path) -> None:
    """path and its ancestors, each with the controllers on for its children (cgroup v2), as kubelet's
    cgroupfs driver makes kubepods/<qos>/pod<uid>."""
    want = [c for c in ("cpu", "memory", "pids", "io") if c in (CGROUP / "cgroup.controllers").read_text().split()]
    cur = CGROUP
    for part in [*path.relative_to(CGROUP).parts, None]:
        for c in want:  # one at a time: a controller that cannot be enabled must not keep the others off
            try:
                (cur / "cgroup.subtree_control").write_text(f"+{c}")
            except OSError:
                pass
        if part is not None:
            cur = cur / part
            cur.mkdir(exist_ok=True)


class Box:
    """One container: its bundle, crun's process, its cgroup."""

    def __init__(self, pod: "Pod", pc: gm.PodContainer, spec: dict[str, Any]) -> None:
        self.pod, self.pc, self.spec = pod, pc, spec
        self.id = f"{pod.name}-{pc.name}"
        self.bundle = Path(pod.work, "bundles", pc.name)
        self.proc: subprocess.Popen | None = None
        self.log = Path(pod.logdir, f"{pod.tag}-{pc.name}.log")
        self.started = 0.0

    @property
    def cgroup(self) -> str:
        return str(_cgroup_path(self.spec["linux"]["cgroupsPath"]))

    def _crun(self, *a: str) -> list[str]:
        return [self.pod.crun, "--root", CRUN_ROOT, *a]

    def start(self) -> subprocess.Popen:
        subprocess.run(self._crun("delete", "-f", self.id), capture_output=True, timeout=30)
        fh = open(self.log, "ab")
        self.proc = subprocess.Popen(self._crun("run", "--bundle", str(self.bundle), self.id), stdout=fh,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = time.monotonic()
        return self.proc

    def run_to_completion(self, timeout: float) -> dict[str, Any]:
        p = self.start()
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop(5)
            rc = None
        out = self.log.read_text(errors="replace")[-600:]
        self.delete()
        return {"name": self.pc.name, "rc": rc, "output": out, "s": round(time.monotonic() - self.started, 1)}

    def exec(self, argv: list[str], timeout: float = 30) -> int:
        try:
            return subprocess.run(self._crun("exec", self.id, *argv), capture_output=True, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in Path(self.cgroup, "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def events(self) -> dict[str, int]:
        try:
            lines = Path(self.cgroup, "memory.events").read_text().splitlines()
            return {k: int(v) for k, v in (ln.split() for ln in lines)}
        except OSError:
            return {}

    def stop(self, grace: float = 30) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            subprocess.run(self._crun("kill", self.id, "TERM"), capture_output=True, timeout=30)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                subprocess.run(self._crun("kill", "-a", self.id, "KILL"), capture_output=True, timeout=30)
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, 9)
        self.delete()

    def delete(self) -> None:
        subprocess.run(self._crun("delete", "-f", self.id), capture_output=True, timeout=30)


LIVE: list["Pod"] = []  # pods prepared and not yet cleaned up: stop_all() on a signal


def stop_all() -> None:
    """Every container of every live pod killed and deleted, its mounts and cgroups removed."""
    for p in list(LIVE):
        p.cleanup()


class Pod:
    """The rendered pod's containers on this host. `prepare` lays out volumes, files, cgroups and
    bundles; the caller starts the containers in the pod's order."""

    def __init__(self, run: gm.PodRun, specs: dict[str, dict[str, Any]], *, name: str, tag: str, work: str,
                 logdir: str, namespaces: dict[str, str], python: str, crun: str, host: gpu_oci.Host,
                 dry_run: bool = False, other_shape: bool = False, template: dict[str, Any] | None = None) -> None:
        self.template = template  # no capture of this pod: each container's spec from the node's spec of another
        self.other_shape = other_shape or template is not None  # the capture is of a pod of another backend
        self.dry_run = dry_run  # lay out directories, files and bundles only: no mounts, cgroups or crun
        self.run, self.specs, self.name, self.tag, self.work = run, specs, name, tag, work
        self.logdir, self.namespaces, self.python, self.crun, self.host = logdir, namespaces, python, crun, host
        self.boxes: dict[str, Box] = {}
        self.changes: dict[str, list[str]] = {}
        self.mounted: list[str] = []
        self.pod_cgroup: Path | None = None

    def prepare(self) -> None:
        if not self.dry_run:  # else a container would start on another pair's packages, or on none
            absent = sorted({d for c in self.run.containers
                             if not os.path.isdir(f"{IMAGES}/{(d := stand_in(c.image))}")})
            if absent:
                raise SystemExit(f"no stand-in image {', '.join(f'{IMAGES}/{d}' for d in absent)}: "
                                 "run dev.sh install first")
        w = Path(self.work)
        if w.exists():
            self.cleanup()
        LIVE.append(self)
        for d in self.run.fresh_dirs:
            shutil.rmtree(d, ignore_errors=True)
        for name, d in self.run.volume_dirs.items():
            os.makedirs(d, exist_ok=True)
            if name in self.run.memory_volumes:  # kubelet: a tmpfs of the sizeLimit
                size = self.run.memory_volumes[name]
                self._tmpfs(d, f"mode=0777{f',size={size}' if size else ''}")
            # emptyDirs are 0777 (kubelet); the hostPath root is 0755 root's (the admin's), as kubelet's subPath parents
            os.chmod(d, 0o755 if name in self.run.host_path_volumes else 0o777)
        for c in self.run.containers:  # subPath directories, made by kubelet with the volume's mode
            for src, _ro in c.mounts.values():
                os.makedirs(src, exist_ok=True)
        for path, text in self.run.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
            os.chmod(path, 0o644)
        files = w / "pod-files"
        files.mkdir(parents=True, exist_ok=True)
        (files / "hosts").write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{gm.POD_IP}\t{self.name}\n")
        (files / "hostname").write_text(self.name + "\n")
        (files / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        shm = w / "sandbox-shm"
        shm.mkdir(exist_ok=True)
        self._tmpfs(str(shm), f"mode=1777,size={SANDBOX_SHM_BYTES}")
        derived: dict[str, list[str]] = {}
        if self.template is not None:
            for c in self.run.containers:
                self.specs[c.name], derived[c.name] = gpu_oci.from_template(self.template, c.security, c.cpu_request,
                                                                            c.memory_limit)
        missing = [c.name for c in self.run.containers if c.name not in self.specs]
        if missing:
            raise SystemExit(f"no captured spec for containers {missing} (have: {', '.join(self.specs)})")
        self.pod_cgroup = _cgroup_path(gpu_oci.pod_cgroup(self.specs[self.run.containers[0].name]))
        if not self.dry_run:
            _make_cgroup(self.pod_cgroup)
            self.host = dataclasses.replace(self.host, swap_accounting=(self.pod_cgroup / "memory.swap.max").exists())
        limits = []
        floor = min((c.memory_request or 0 for c in self.run.containers if c.role in ("main", "exporter")), default=0)
        for c in self.run.containers:
            spec = self.specs[c.name]
            oom = gpu_oci.oom_score_adj(gpu_oci.qos(spec), c.memory_request, self.host.memory_capacity,
                                        floor if c.role == "sidecar" else None) if self.host.memory_capacity else None
            (files / f"termination-log-{c.name}").write_text("")
            os.chmod(files / f"termination-log-{c.name}", 0o666)
            rootfs = w / f"rootfs-{c.name}"
            rootfs.mkdir(parents=True, exist_ok=True)
            for tmp in ("tmp", "var/tmp"):  # as in every image: world-writable, sticky (a writable root uses them)
                (rootfs / tmp).mkdir(parents=True, exist_ok=True)
                os.chmod(rootfs / tmp, 0o1777)
            for link in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
                if os.path.islink(f"/{link}") and not (rootfs / link).is_symlink():
                    os.symlink(os.readlink(f"/{link}"), rootfs / link)
            at = gpu_oci.Placement(rootfs=str(rootfs), pod_files=str(files), sandbox_shm=str(shm),
                                   namespaces=self.namespaces, image_env=image_env(c.image, self.python),
                                   volume_mounts=c.mounts, cgroup_leaf=c.name, memory_limit=c.memory_limit,
                                   cpu_shares=gpu_oci.cpu_shares(c.cpu_request), oom_score_adj=oom,
                                   other_shape=self.other_shape, hostname=self.name)
            new, ch = gpu_oci.rewrite(spec, c.argv, c.env, self.host, at, c.name)
            self.boxes[c.name] = Box(self, c, new)
            self.changes[c.name] = derived.get(c.name, []) + ch
            if c.role != "init":
                limits.append(c.memory_limit)
        for b in self.boxes.values():
            b.bundle.mkdir(parents=True, exist_ok=True)
            (b.bundle / "config.json").write_text(json.dumps(b.spec, indent=1))
        if self.dry_run:
            return
        if limits and all(limits):  # kubelet's pod-level limit: the sum of the containers' (init ones run alone)
            (self.pod_cgroup / "memory.max").write_text(str(sum(limits)))

    def _tmpfs(self, path: str, options: str) -> None:
        if not self.dry_run:
            _mount("tmpfs", path, options)
            self.mounted.append(path)

    def box(self, name: str) -> Box:
        return self.boxes[name]

    def of_role(self, role: str) -> list[Box]:
        return [self.boxes[c.name] for c in self.run.containers if c.role == role]

    def cleanup(self) -> None:
        if self in LIVE:
            LIVE.remove(self)
        for b in self.boxes.values():
            b.stop(5)
        for d in reversed(self.mounted):
            _umount(d)
        self.mounted.clear()
        if self.pod_cgroup is not None and self.pod_cgroup.is_dir():
            for d in [*(x for x in self.pod_cgroup.iterdir() if x.is_dir()), self.pod_cgroup]:
                try:
                    d.rmdir()
                except OSError:
                    pass
        shutil.rmtree(self.work, ignore_errors=True)


# ---------------------------------------------------------------- gpu_bench's target

SANDBOX: dict[str, str] = {}  # namespace files, once gpu_bench entered the sandbox (enter_sandbox)
HOST: gpu_oci.Host | None = None


class PodTarget:
    """gpu_bench's run target for `--runtime crun`: the same interface as gpu_bench.HostTarget."""

    def __init__(self, kind: str, rendered: gm.Rendered, cfg: dict[str, Any], args: Any, tag: str,
                 serving_env: dict[str, str], bench: Any) -> None:
        global HOST
        self.bench = bench  # the gpu_bench module: its sampler, log and readers
        if not SANDBOX:
            raise RuntimeError("gpu_pod.enter_sandbox() was not called before the run")
        HOST = HOST or host_facts()
        self.args, self.tag, self.kind = args, tag, kind
        self.connector = kind != "baseline"
        work = f"{args.work}/{tag}"
        self.disk_root = f"{args.disk_root}/kvbench-{tag}"
        overrides, extra = bench.overrides_for(kind, args)
        self.run = run = gm.containerize(rendered, work, self.disk_root, connector=self.connector, model_config=cfg,
                                         lmcache_overrides=overrides, extra_env=extra, serving_env=serving_env,
                                         kept={v: f"{args.work}/kept-{v}" for v in args.keep_volume},
                                         **bench.engine_additions(args))
        self.logdir = Path(args.out) / "logs"
        template = json.loads(Path(args.oci_template).read_text()) if args.oci_template else None
        specs = {} if template else load_specs(args.oci_dir, dict(a.split("=", 1) for a in args.oci_alias))
        self.pod = Pod(run, specs, name=f"{rendered.name}-0", tag=tag, work=work, logdir=str(self.logdir),
                       namespaces=SANDBOX, python=args.python, crun=args.crun, host=HOST,
                       other_shape=args.oci_other_shape, template=template)
        main = run.container("main")
        self.port, self.exporter_port, self.status_url = run.port, run.exporter_port, run.status_url
        self.disk_dir, self.multiproc_dir, self.lmcache = run.disk_dir, run.multiproc_dir, run.lmcache
        self.engine_argv = main.argv
        self.served_model = gm.flag(main.argv, "--served-model-name") or gm.MODEL_DIR
        self.elog = self.logdir / f"{tag}-{main.name}.log"
        self.describe = {"changes": run.changes, "argv": main.argv, "env": main.env, "lmcache": run.lmcache,
                         "exporter_argv": ((run.container("exporter") or main).argv
                                           if run.container("exporter") else None),
                         "sidecars": [{"name": c.name, "argv": c.argv, "memory_limit": c.memory_limit}
                                      for c in run.containers if c.role == "sidecar"],
                         "containers": {c.name: {"role": c.role, "argv": c.argv, "memory_limit": c.memory_limit}
                                        for c in run.containers}}
        self.side_samplers: dict[str, Any] = {}
        self.engine_cgroup: str | None = None

    def prepare(self, res: dict[str, Any]) -> None:
        socket.sethostname(self.pod.name)
        self.pod.prepare()
        res["oci_changes"] = self.pod.changes
        res["oci_specs"] = {n: b.spec for n, b in self.pod.boxes.items()}
        res["pod_cgroup"] = str(self.pod.pod_cgroup)
        self.engine_cgroup = self.pod.box(self.run.container("main").name).cgroup
        res["cgroup"] = self.engine_cgroup
        res["init"] = []
        for b in self.pod.of_role("init"):
            r = b.run_to_completion(300)
            res["init"].append(r)
            self.bench.log(f"{self.tag}: init {b.pc.name} rc {r['rc']}: {r['output'].strip()[-200:]}")
            if r["rc"] != 0:
                raise RuntimeError(f"init container {b.pc.name} exited {r['rc']}: {r['output'][-300:]}")

    def start_sidecars(self, res: dict[str, Any]) -> None:
        for b in self.pod.of_role("sidecar"):
            self.bench.log(f"{self.tag}: starting sidecar {b.pc.name} (crun)")
            b.start()
            ms = self.bench.MemSampler(b.cgroup)
            ms.start()
            self.side_samplers[b.pc.name] = ms
            t0 = time.monotonic()
            while b.pc.probe:
                if b.proc.poll() is not None:
                    raise RuntimeError(f"sidecar {b.pc.name} exited {b.proc.returncode} "
                                       "before its startup probe passed")
                if b.exec(b.pc.probe) == 0:
                    break
                if time.monotonic() - t0 > self.args.start_timeout / 2:
                    raise RuntimeError(f"sidecar {b.pc.name}: startup probe still failing")
                time.sleep(0.5)
            res.setdefault("sidecar_ready_s", {})[b.pc.name] = round(time.monotonic() - t0, 1)
            self.bench.log(f"{self.tag}: sidecar {b.pc.name} ready after {res['sidecar_ready_s'][b.pc.name]} s")

    def start_engine(self) -> subprocess.Popen:
        return self.pod.box(self.run.container("main").name).start()

    def engine_pids(self) -> list[int]:
        return self.pod.box(self.run.container("main").name).pids()

    def start_exporter(self) -> subprocess.Popen | None:
        x = self.run.container("exporter")
        if not x:
            return None
        b = self.pod.box(x.name)
        p = b.start()
        self.side_samplers[x.name] = ms = self.bench.MemSampler(b.cgroup)
        ms.start()
        return p

    def stop_exporter(self) -> None:
        x = self.run.container("exporter")
        if x:
            self.pod.box(x.name).stop(5)

    def sidecar_facts(self) -> dict[str, Any]:
        return {b.pc.name: {"cgroup": self.bench.cgroup_stat(b.cgroup), **self.bench.rss_bytes(b.pids())}
                for b in self.pod.of_role("sidecar")}

    def stop(self, res: dict[str, Any]) -> None:
        res["memory_events"] = {n: b.events() for n, b in self.pod.boxes.items() if b.proc is not None}
        res["pod_memory_events"] = _events(self.pod.pod_cgroup)
        res["exit_codes"] = {n: b.proc.poll() for n, b in self.pod.boxes.items() if b.proc is not None}
        for role in ("exporter", "main", "sidecar"):
            for b in self.pod.of_role(role):
                b.stop(30 if role == "main" else 10)
        for name, ms in self.side_samplers.items():
            ms.halt.set()
            ms.join(5)
            c = next(c for c in self.run.containers if c.name == name)
            res.setdefault("sidecar_memory", {})[name] = {"limit": c.memory_limit, **ms.summary()}
        for b in self.pod.of_role("sidecar"):
            res.setdefault("sidecar_log_facts", {})[b.pc.name] = self.bench.server_log_facts(
                b.log.read_text(errors="replace") if b.log.exists() else "")

    def cleanup(self) -> None:
        self.pod.cleanup()
        shutil.rmtree(self.disk_root, ignore_errors=True)


def _events(cg: Path | None) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (ln.split() for ln in Path(cg, "memory.events").read_text().splitlines())}
    except (OSError, TypeError):
        return {}


# ---------------------------------------------------------------- smoke test

SMOKE = ("import json, os, torch, vllm, lmcache, importlib.util as u, sysconfig; "
         "d = u.find_spec('lmcache').submodule_search_locations[0]; "
         "s = u.spec_from_file_location('lmcache.c_ops', d + '/c_ops' + sysconfig.get_config_var('EXT_SUFFIX')); "
         "u.module_from_spec(s); "
         "h = torch.empty(1 << 30, dtype=torch.uint8).pin_memory(); g = torch.empty_like(h, device='cuda'); "
         "g.copy_(h); torch.cuda.synchronize(); "
         "print('smoke', json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'groups': os.getgroups(), "
         "'cuda': torch.cuda.is_available(), 'gpu': torch.cuda.get_device_name(0), 'vllm': vllm.__version__, "
         "'cap_eff': [ln for ln in open('/proc/self/status') if ln.startswith(('CapEff', 'NoNewPrivs', 'Seccomp'))], "
         "'root_writable': os.access('/', os.W_OK), 'shm': os.statvfs('/dev/shm').f_blocks * "
         "os.statvfs('/dev/shm').f_frsize, 'cgroup': "
         "open('/proc/self/cgroup').read().strip(), 'hostname': os.uname().nodename}))")


def main(argv: list[str] | None = None) -> int:
    """`smoke`: the vLLM container of a rendered pod, its command replaced by an import + CUDA check."""
    import argparse
    import sys
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("what", choices=("smoke",))
    ap.add_argument("--rendered", required=True)
    ap.add_argument("--oci", help="the captured specs of this pod")
    ap.add_argument("--oci-template", help="no capture: derive each container's spec "
                                           "from this captured spec of another pod")
    ap.add_argument("--work", default="/var/tmp/kvpod-smoke")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--crun", default="crun")
    ap.add_argument("--out", default=".")
    ap.add_argument("--dry-run", action="store_true", help="bundles only (no namespaces, mounts, cgroups or crun)")
    ap.add_argument("--oci-other-shape", action="store_true", help="the captures are of a pod of another backend")
    a = ap.parse_args(argv)
    r = gm.parse_rendered(Path(a.rendered).read_text())
    SANDBOX.update(NS_FILES if a.dry_run else enter_sandbox(f"{r.name}-0"))
    run = gm.containerize(r, a.work, f"{a.work}-disk")
    main_c = run.container("main")
    smoke = dataclasses.replace(main_c, role="init", argv=["python3", "-c", SMOKE], probe=[])
    run.containers = [smoke if c is main_c else c for c in run.containers if c.role != "exporter"]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    template = json.loads(Path(a.oci_template).read_text()) if a.oci_template else None
    pod = Pod(run, {} if template else load_specs(a.oci), name=f"{r.name}-0", tag="smoke", work=a.work, logdir=a.out,
              template=template,
              namespaces=SANDBOX, python=a.python, crun=a.crun, host=host_facts(), dry_run=a.dry_run,
              other_shape=a.oci_other_shape)
    try:
        pod.prepare()
        for name, ch in pod.changes.items():
            print(f"{name}: " + "; ".join(ch))
        if a.dry_run:
            for name, b in pod.boxes.items():
                Path(a.out, f"{name}.json").write_text(json.dumps(b.spec, indent=1))
            return 0
        rc = 0
        for c in run.containers:
            if c.role == "sidecar":
                continue
            res = pod.box(c.name).run_to_completion(240)
            print(f"{c.name}: rc {res['rc']} in {res['s']} s: {res['output'].strip()}")
            rc = rc or (res["rc"] != 0)
        return rc
    finally:
        pod.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())
