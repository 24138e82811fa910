"""A real local Kubernetes control plane for tests and the demo.

etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok (fake GPU nodes), all bound
to 127.0.0.1, run from the binaries that tests/cluster/build.sh caches; `components.COMPONENTS` says
how each one runs. With `real_node` (env KVO_REAL_NODE=1, `kvtest up --real-node`) a real kubelet +
containerd node joins beside the fleet (kvtest.node, tests/cluster/build-node.sh) and the API server
binds the node's bridge address 198.18.0.1 instead.

State (default <repository>/.cluster, env KVO_CLUSTER_DIR):
  kubeconfig            admin kubeconfig (CN=kvoffload-admin, O=system:masters)
  state.json            ports, pids (+ /proc start times), binaries, fleet, timings
  pki/                  CA, serving certs, client certs, service-account key pair
  kubeconfigs/          kube-controller-manager, kube-scheduler, kwok kubeconfigs
  etcd/                 etcd data dir
  logs/<component>.log  stdout+stderr of each component
  kwok.yaml             kwok Stage objects (from $BIN/kwok-stages)
  nodes.json            the Node objects created for the fleet
  node/                 the real node's configs, kubelet root dir, CNI state, pod logs
  .lock                 flock serialising up/down between processes
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from . import node, procs
from .client import ApiError, Client
from .components import BY_NAME, COMPONENTS, KWOK_POD_CIDR, NODE_COMPONENTS, NODE_STAGES, SERVICE_CIDR, STAGES
from .fleet import NODE_IP_BASE, load_fleet, node_addresses, node_pod_cidr, render_nodes
from .paths import (
    HELM_VERSION,
    K8S_VERSION,
    KWOK_VERSION,
    ROOT,
    bin_dir,
    kubectl_path,
    missing_binaries,
    missing_node_binaries,
    node_bin_dir,
    state_dir,
)
from .pki import KUBERNETES_SERVICE_IP, write_kubeconfig, write_pki
from .procs import LOOPBACK, alive, wait_until

NODE_NAMES = {comp.name for comp in NODE_COMPONENTS}


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ClusterError(RuntimeError):
    pass


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return (f"{' '.join(map(str, self.cmd))} exited {self.returncode}\n"
                f"stdout: {self.stdout}\nstderr: {self.stderr}")


@dataclass
class Cluster:
    dir: Path = field(default_factory=state_dir)
    bin: Path = field(default_factory=bin_dir)
    # A real node (kvtest.node) beside the kwok fleet: env KVO_REAL_NODE=1, or `kvtest up --real-node`.
    real_node: bool = field(default_factory=lambda: os.environ.get("KVO_REAL_NODE") == "1")
    _client: Client | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.state().get("processes") and self.state().get("real_node"):
            self.real_node = True  # a running cluster's node is part of it, whatever the environment says

    # ------------------------------------------------------------------------------------ paths, state
    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def api_host(self) -> str:
        """Where the API server binds: loopback, or the real node's bridge address."""
        return node.BRIDGE_IP if self.real_node else LOOPBACK

    @property
    def service_cidr(self) -> str:
        return node.SERVICE_CIDR if self.real_node else SERVICE_CIDR

    @property
    def components(self) -> tuple:
        return COMPONENTS + NODE_COMPONENTS if self.real_node else COMPONENTS

    @property
    def pki(self) -> Path:
        return self.dir / "pki"

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{Path(kubectl_path()).parent}{os.pathsep}{self.bin}{os.pathsep}{env.get('PATH', '')}"
        # Helm keeps its caches and config inside the state dir, never in $HOME.
        for k, sub in (("HELM_CACHE_HOME", "helm/cache"), ("HELM_CONFIG_HOME", "helm/config"),
                       ("HELM_DATA_HOME", "helm/data")):
            env.setdefault(k, str(self.dir / sub))
        env.pop("HTTPS_PROXY", None), env.pop("https_proxy", None)
        return env

    def state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def _save(self, st: dict) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(st, indent=2, sort_keys=True))
        tmp.replace(self.state_file)

    @contextlib.contextmanager
    def _lock(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # ------------------------------------------------------------------------------------ clients
    def _run(self, cmd: list[str], input: str | None, check: bool, timeout: float) -> subprocess.CompletedProcess:
        cp = subprocess.run(cmd, input=input, text=True, capture_output=True, env=self.env, timeout=timeout)
        if check and cp.returncode != 0:
            raise KubectlError(cp.returncode, cmd, cp.stdout, cp.stderr)
        return cp

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        return self._run([kubectl_path(), f"--kubeconfig={self.kubeconfig}", *map(str, args)], input, check, timeout)

    def helm(self, *args: str, check: bool = True, input: str | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
        return self._run([str(self.bin / "helm"), f"--kubeconfig={self.kubeconfig}", *map(str, args)],
                         input, check, timeout)

    def api_client(self):
        """A kubernetes ApiClient: what the operator's own code takes (tests that run it in-process, benchmarks)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def token_kubeconfig(self, path: Path, token: str, namespace: str, user: str) -> Path:
        """A kubeconfig for this cluster that authenticates with `token` alone (a ServiceAccount's)."""
        write_kubeconfig(path, self.state()["server"], self.pki, user, token=token, namespace=namespace)
        return path

    @property
    def client(self) -> Client:
        """The tests' API client, as the admin (cached per apiserver port: discovery is kept)."""
        port = self.state()["ports"]["kube-apiserver"]
        if self._client is None or self._client.port != port:
            self._client = Client(port, self.pki / "ca.crt", (self.pki / "admin.crt", self.pki / "admin.key"),
                                  host=self.state().get("api_host", LOOPBACK))
        return self._client

    def request(self, method: str, path: str, port: int, timeout: float = 10) -> tuple[int, Any]:
        """Raw HTTPS call to a component's own port (kube-controller-manager's and kube-scheduler's
        /healthz, which need no client certificate). The API server is reached through `client`."""
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        conn = http.client.HTTPSConnection(LOOPBACK, port, context=ctx, timeout=timeout)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode(errors="replace")

    def install_crd(self) -> None:
        """The project's CRD (crds/, server-side), Established."""
        for path in sorted((ROOT / "crds").glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc:
                    self.client.apply(doc)
                    self.client.established(doc["metadata"]["name"])

    # ------------------------------------------------------------------------------------ health
    def component_health(self) -> dict[str, tuple[bool, str]]:
        st = self.state()
        recs, ports = st.get("processes", {}), st.get("ports", {})
        out: dict[str, tuple[bool, str]] = {}
        for comp in self.components:
            rec = recs.get(comp.name)
            if not rec or not alive(rec):
                out[comp.name] = (False, "not running")
                continue
            try:
                out[comp.name] = comp.health(self, ports)
            except Exception as exc:  # noqa: BLE001
                out[comp.name] = (False, f"{type(exc).__name__}: {exc}")
        return out

    def healthy(self) -> bool:
        h = self.component_health()
        return bool(h) and all(ok for ok, _ in h.values())

    def running(self) -> bool:
        """All recorded processes alive and the apiserver ready (cheap reuse check)."""
        st = self.state()
        recs = st.get("processes", {})
        if not st or any(c.name not in recs or not alive(recs[c.name]) for c in self.components):
            return False
        with contextlib.suppress(Exception):
            self.client.request("GET", "/readyz", timeout=3)  # raises unless 2xx
            return True
        return False

    def fleet_nodes(self) -> list[dict]:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return json.loads((self.dir / "nodes.json").read_text())
        return []

    # ------------------------------------------------------------------------------------ nodes
    def nodes(self) -> list[dict]:
        return self.client.list("nodes")

    def ready_nodes(self) -> set[str]:
        ready = set()
        for n in self.nodes():
            for c in n.get("status", {}).get("conditions", []) or []:
                if c["type"] == "Ready" and c["status"] == "True":
                    ready.add(n["metadata"]["name"])
        return ready

    def apply_fleet(self, pools: list[dict], wait: bool = True, timeout: float = 120) -> list[str]:
        """Create the fleet's nodes that do not exist yet; return the names of all its nodes.

        Node indexes (hence loopback IPs and pod CIDRs) continue after the nodes that
        already exist, so growing a fleet never reuses an address.
        """
        existing = {n["metadata"]["name"]: n for n in self.nodes()}
        desired = render_nodes(pools)
        new = [n for n in desired if n["metadata"]["name"] not in existing]
        if new:
            used = [int(ipaddress.IPv4Address(a["address"])) - int(NODE_IP_BASE)
                    for n in existing.values() for a in n.get("status", {}).get("addresses", [])
                    if a["type"] == "InternalIP" and a["address"].startswith("127.")]
            idx = max([u for u in used if u >= 0], default=-1) + 1
            for n in new:
                n["spec"]["podCIDR"] = node_pod_cidr(idx)
                n["spec"]["podCIDRs"] = [node_pod_cidr(idx)]
                n["status"]["addresses"] = node_addresses(n["metadata"]["name"], idx)
                idx += 1
                try:
                    self.client.create(n)
                except ApiError as exc:
                    if exc.status != 409:
                        raise ClusterError(f"create node {n['metadata']['name']}: {exc}") from exc
            fleet = {n["metadata"]["name"]: n for n in self.fleet_nodes()}
            fleet.update({n["metadata"]["name"]: n for n in new})
            (self.dir / "nodes.json").write_text(json.dumps(list(fleet.values()), indent=1))
        names = [n["metadata"]["name"] for n in desired]
        if wait:
            wait_until(lambda: set(names) <= self.ready_nodes(), timeout=timeout, interval=0.25,
                       message=f"{len(names)} nodes Ready")
        return names

    def delete_nodes(self, names: Iterable[str]) -> None:
        names = list(names)
        for name in names:
            self.client.delete("nodes", name, missing_ok=True)
        keep = [n for n in self.fleet_nodes() if n["metadata"]["name"] not in set(names)]
        (self.dir / "nodes.json").write_text(json.dumps(keep, indent=1))

    # ------------------------------------------------------------------------------------ lifecycle
    @classmethod
    def ensure(cls, pools: list[dict] | None = None) -> tuple[Cluster, bool]:
        """Reuse a running healthy cluster in the state dir, or start one. -> (cluster, started)"""
        c = cls()
        return c, c.up(pools)

    def up(self, pools: list[dict] | None = None) -> bool:
        """Start unless a healthy cluster runs (then only add `pools`' missing nodes); True if it started one."""
        with self._lock():
            if self.running():
                if pools is not None:
                    self.apply_fleet(pools)
                return False
            self._start(pools if pools is not None else load_fleet())
            return True

    def down(self) -> list[str]:
        with self._lock():
            return self._stop()

    def stop_component(self, comp: str, sig: int = signal.SIGKILL, timeout: float = 15) -> None:
        """Kill one running component's process group and wait until it is gone and its ports are free."""
        with self._lock():
            st = self.state()
            rec = st.get("processes", {}).get(comp)
            if not rec:
                raise ClusterError(f"{comp} is not part of the running cluster in {self.dir}")
            procs.kill(rec, sig)

            def gone() -> bool:
                procs.reap(rec["pid"])
                return not alive(rec)

            try:
                wait_until(gone, timeout=timeout, interval=0.05, message=f"{comp} exited")
            except TimeoutError:
                if sig == signal.SIGKILL:
                    raise
                procs.kill(rec, signal.SIGKILL)  # a graceful stop that takes too long
                wait_until(gone, timeout=5, interval=0.05, message=f"{comp} exited after SIGKILL")
            procs.CHILDREN.pop(rec["pid"], None)
            ports = [st["ports"][k] for k in BY_NAME[comp].ports]
            wait_until(lambda: not any(procs.port_bound(p) for p in ports), timeout=timeout, interval=0.1,
                       message=f"{comp} ports {ports} free")

    def start_component(self, comp: str, timeout: float = 90, args: list[str] | None = None) -> float:
        """Start a stopped component again with its recorded flags (same ports, same data); wait until healthy.

        `args` replaces the recorded flags (and is recorded in their place). Returns the seconds it
        took to become healthy.
        """
        with self._lock():
            st = self.state()
            rec = st.get("processes", {}).get(comp)
            if not rec:
                raise ClusterError(f"{comp} is not part of the cluster in {self.dir}")
            if alive(rec):
                raise ClusterError(f"{comp} (pid {rec['pid']}) is still running")
            t0 = time.monotonic()
            self._spawn(st, comp, list(args) if args is not None else rec["cmd"][1:])
            self._wait_ready(st, comp, timeout)
            return round(time.monotonic() - t0, 2)

    def restart(self, comp: str, downtime: float = 0.0, sig: int = signal.SIGKILL,
                args: list[str] | None = None) -> float:
        """Kill one component and start it again with the same flags (or `args`), ports and data dir.

        `downtime` seconds pass between the kill and the start. Returns the seconds from the
        start until the component was healthy. The other components keep running.
        """
        self.stop_component(comp, sig)
        if downtime:
            time.sleep(downtime)
        return self.start_component(comp, args=args)

    def component_args(self, comp: str) -> list[str]:
        """The flags one running component was started with."""
        return list(self.state()["processes"][comp]["cmd"][1:])

    def _start(self, pools: list[dict]) -> None:
        missing = missing_binaries(self.bin)
        if missing:
            raise ClusterError(f"missing binaries in {self.bin}: {missing}; run tests/cluster/build.sh")
        if self.real_node and missing_node_binaries():
            raise ClusterError(f"the real node needs {missing_node_binaries()} ({node_bin_dir()}); "
                               f"run tests/cluster/build-node.sh and make system-deps")
        self._stop(quiet=True)  # a half-dead earlier cluster: kill what is left of it
        for attempt in range(2):
            try:
                self._start_once(pools)
                return
            except Exception as exc:  # noqa: BLE001 - whatever failed, nothing it started may stay behind
                log(f"start failed ({exc}); stopping what started")
                problems = self._stop(quiet=True)
                if problems:
                    log(f"stopping after the failed start: {problems}")
                if attempt == 1 or not isinstance(exc, ClusterError):  # a component that exited early: once more
                    raise

    def _start_once(self, pools: list[dict]) -> None:
        t0 = time.monotonic()
        d = self.dir
        for sub in ("pki", "kubeconfigs", "etcd", "logs", "helm"):
            shutil.rmtree(d / sub, ignore_errors=True)
        for f in ("kubeconfig", "state.json", "kwok.yaml", "nodes.json"):
            with contextlib.suppress(FileNotFoundError):
                (d / f).unlink()
        (d / "logs").mkdir(parents=True)
        (d / "etcd").mkdir(mode=0o700)
        st = {"dir": str(d), "bin": str(self.bin), "kubeconfig": str(self.kubeconfig), "processes": {},
              "real_node": self.real_node, "api_host": self.api_host}
        self._save(st)
        if self.real_node:
            node.host_up(self, st)  # the bridge first: the API server binds on it
            write_pki(self.pki, api_ips=(LOOPBACK, node.BRIDGE_IP, node.KUBERNETES_SERVICE_IP),
                      node=(node.NAME, node.BRIDGE_IP))
        else:
            write_pki(self.pki, api_ips=(LOOPBACK, KUBERNETES_SERVICE_IP))
        self._client = None  # new certificates: a cached client's TLS context holds the old ones
        names = [name for comp in self.components for name in comp.ports]
        ports = dict(zip(names, procs.free_ports(len(names))))
        server = f"https://{self.api_host}:{ports['kube-apiserver']}"
        write_kubeconfig(self.kubeconfig, server, self.pki, "admin")
        for user in ("kube-controller-manager", "kube-scheduler", "kwok"):
            write_kubeconfig(d / "kubeconfigs" / f"{user}.kubeconfig", server, self.pki, user)
        self._write_kwok_config()
        if self.real_node:
            node.write_configs(self, ports, server)
        st.update({"server": server, "ports": ports, "service_cidr": self.service_cidr, "pod_cidr": KWOK_POD_CIDR,
                   "versions": {"kubernetes": K8S_VERSION, "kwok": KWOK_VERSION, "helm": HELM_VERSION},
                   "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        self._save(st)
        timings: dict[str, float] = {"pki": round(time.monotonic() - t0, 2)}
        node_names: list[str] = []
        for stage in STAGES:
            for comp in stage:
                self._spawn(st, comp, BY_NAME[comp].flags(self, ports))
            if "kwok" in stage:
                node_names = self.apply_fleet(pools, wait=False)
            for comp in stage:
                self._wait_ready(st, comp, BY_NAME[comp].start_timeout)
            timings[stage[0] if len(stage) == 1 else "controllers"] = round(time.monotonic() - t0, 2)
        wait_until(lambda: self._watch(st, "kwok") and set(node_names) <= self.ready_nodes(),
                   timeout=BY_NAME["kwok"].start_timeout, interval=0.2, message=f"{len(node_names)} nodes Ready")
        timings["nodes_ready"] = round(time.monotonic() - t0, 2)
        # The serviceaccount and root-ca publisher controllers work: pods can be admitted.
        wait_until(lambda: self.client.exists("serviceaccount", "default", "default")
                   and self.client.exists("configmap", "kube-root-ca.crt", "default"),
                   timeout=60, interval=0.2, message="default ServiceAccount and kube-root-ca.crt")
        timings["ready"] = round(time.monotonic() - t0, 2)
        if self.real_node:
            self._start_node(st, timings, t0)
        st["timings"] = timings
        st["startup_seconds"] = timings["ready"]
        self._save(st)
        log(f"cluster up in {timings['ready']:.1f}s ({timings})")

    def _start_node(self, st: dict, timings: dict[str, float], t0: float) -> None:
        """containerd (the pause image imported), then kubelet and kube-proxy; the node Ready, then the
        host's sysctls put back and the stand-in GPUs advertised (kvtest.node)."""
        t_node = time.monotonic()
        for stage in NODE_STAGES:
            for comp in stage:
                self._spawn(st, comp, BY_NAME[comp].flags(self, st["ports"]))
            for comp in stage:
                self._wait_ready(st, comp, BY_NAME[comp].start_timeout)
            if stage == ("containerd",):
                node.import_pause(self)
        wait_until(lambda: self._watch(st, "kubelet") and node.NAME in self.ready_nodes(), timeout=90,
                   interval=0.2, message=f"{node.NAME} Ready")
        st["node"] = node.after_ready(self)
        timings["real_node_ready"] = round(time.monotonic() - t_node, 2)
        timings["ready"] = round(time.monotonic() - t0, 2)

    @staticmethod
    def _node_env() -> dict[str, str]:
        """The node's processes find the shim, nft, iptables, mount and the runtime on PATH."""
        env = Cluster._component_env()
        env["PATH"] = f"{node_bin_dir()}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        return env

    def _wait_ready(self, st: dict, comp: str, timeout: float) -> None:
        c = BY_NAME[comp]
        wait_until(lambda: self._watch(st, comp) and c.is_ready(self, st["ports"]), timeout=timeout,
                   interval=0.1, message=f"{comp} healthy")

    def _watch(self, st: dict, comp: str) -> bool:
        """True while comp runs; raise with its log tail once it has exited."""
        rec = st["processes"][comp]
        if alive(rec):
            return True
        procs.reap(rec["pid"])
        tail = ""
        with contextlib.suppress(OSError):
            tail = "\n".join(Path(rec["log"]).read_text(errors="replace").splitlines()[-25:])
        raise ClusterError(f"{comp} exited early; log {rec['log']}:\n{tail}")

    def _spawn(self, st: dict, comp: str, args: list[str]) -> None:
        logf = self.dir / "logs" / f"{comp}.log"
        exe = (node_bin_dir() if comp in NODE_NAMES else self.bin) / comp
        with open(logf, "ab") as out:
            p = subprocess.Popen([str(exe), *args], stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT, cwd=self.dir,
                                 start_new_session=True,
                                 env=self._node_env() if comp in NODE_NAMES else self._component_env())
        procs.CHILDREN[p.pid] = p
        stat = procs.proc_stat(p.pid)
        st["processes"][comp] = {"pid": p.pid, "pgid": p.pid, "starttime": stat[2] if stat else 0,
                                 "log": str(logf), "cmd": [str(exe), *args]}
        self._save(st)

    @staticmethod
    def _component_env() -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER")}
        # No proxies: a proxy env var could make a component dial off-host.
        env["NO_PROXY"] = env["no_proxy"] = "*"
        env["KUBECONFIG"] = "/dev/null"
        return env

    def _write_kwok_config(self) -> None:
        s = self.bin / "kwok-stages"
        files = [s / "node/fast/node-initialize.yaml",
                 s / "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
                 s / "pod/fast/pod-ready.yaml", s / "pod/fast/pod-complete.yaml",
                 s / "pod/fast/pod-delete.yaml"]
        docs = []
        for f in files:
            if not f.exists():
                raise ClusterError(f"kwok stage missing: {f}")
            docs.append(f.read_text().strip())
        (self.dir / "kwok.yaml").write_text("\n---\n".join(docs) + "\n")

    def _stop(self, quiet: bool = False) -> list[str]:
        """Kill every recorded process group (reverse start order); verify; return problems."""
        st = self.state()
        recs = st.get("processes", {})
        order = [c.name for c in reversed(COMPONENTS + NODE_COMPONENTS) if c.name in recs]
        order += [c for c in recs if c not in BY_NAME]
        if "containerd" in recs and alive(recs["containerd"]):
            # kubelet and kube-proxy first (no pod restarted behind our back), then every pod while
            # containerd can still remove them.
            for comp in ("kubelet", "kube-proxy"):
                if comp in recs:
                    procs.kill(recs[comp], signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                wait_until(lambda: not any(alive(recs[k]) for k in ("kubelet", "kube-proxy") if k in recs),
                           timeout=15, interval=0.1)
            try:
                node.remove_pods(self)
            except Exception as exc:  # noqa: BLE001 - host_down still kills them by PID
                log(f"removing the node's pods through containerd: {exc}")
        for comp in order:
            procs.kill(recs[comp], signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(recs[c]) for c in order):
            for r in recs.values():
                procs.reap(r["pid"])
            time.sleep(0.1)
        for comp in order:
            if alive(recs[comp]):
                procs.kill(recs[comp], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(recs[c]) for c in order):
            time.sleep(0.1)
        for r in recs.values():  # reap our own children
            p = procs.CHILDREN.pop(r["pid"], None)
            if p is not None:
                with contextlib.suppress(Exception):
                    p.wait(timeout=1)
        problems = [f"{c} (pid {recs[c]['pid']}) still alive" for c in order if alive(recs[c])]
        # Any process still in a recorded process group?
        pgids = {int(r["pgid"]) for r in recs.values()}
        for pdir in Path("/proc").iterdir():
            if pdir.name.isdigit():
                s = procs.proc_stat(int(pdir.name))
                if s and s[1] in pgids and s[0] not in ("Z", "X"):
                    problems.append(f"pid {pdir.name} left in process group {s[1]}")
        # No recorded port may still be bound.
        deadline = time.monotonic() + 5
        ports = st.get("ports", {})
        while True:
            bound = [f"{n}:{p}" for n, p in ports.items() if procs.port_bound(p)]
            if not bound or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        problems += [f"port still bound: {b}" for b in bound]
        if st.get("host"):
            problems += node.host_down(self, st)
            self._save(st)
        if recs:
            st["processes"] = {}
            st["stopped_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            self._save(st)
            if not quiet:
                log("stopped " + ", ".join(order) + ("" if not problems else f"; PROBLEMS: {problems}"))
        return problems

    # ------------------------------------------------------------------------------------ reporting
    def memory_kib(self) -> dict[str, int]:
        out = {}
        for comp, rec in self.state().get("processes", {}).items():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{rec['pid']}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[comp] = int(line.split()[1])
        return out

    def status_text(self) -> str:
        st = self.state()
        if not st.get("processes"):
            return f"cluster: not running (state dir {self.dir})"
        health = self.component_health()
        mem = self.memory_kib()
        ports = st["ports"]
        lines = [f"cluster: {'healthy' if all(ok for ok, _ in health.values()) else 'UNHEALTHY'}"
                 f"  (state {self.dir}, started {st.get('started_at')}, "
                 f"startup {st.get('startup_seconds')}s)",
                 f"kubeconfig: {self.kubeconfig}", f"server: {st['server']}",
                 f"{'COMPONENT':25} {'PID':>7} {'PORT':>12} {'RSS MiB':>8}  HEALTH"]
        for comp in self.components:
            ok, detail = health.get(comp.name, (False, "?"))
            pid = st["processes"].get(comp.name, {}).get("pid", "-")
            port = ",".join(str(ports[k]) for k in comp.ports) or "-"
            lines.append(f"{comp.name:25} {pid:>7} {port:>12} "
                         f"{mem.get(comp.name, 0) / 1024:8.0f}  {'ok' if ok else 'FAIL'} {detail}")
        lines.append(f"{'total':25} {'':>7} {'':>12} {sum(mem.values()) / 1024:8.0f}")
        if health.get("kube-apiserver", (False,))[0]:
            # kubectl under test: `make cluster-status` shows a user kubectl's own node table
            cp = self.kubectl("get", "nodes", "-o", "wide", "-L", "nvidia.com/gpu.product", check=False)
            lines.append(cp.stdout.rstrip() or cp.stderr.rstrip())
        return "\n".join(lines)
