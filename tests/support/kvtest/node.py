"""The real node: containerd + runc + CNI bridge + kubelet + kube-proxy, joined beside the kwok fleet.

A machine-wide singleton (one bridge cni0; containerd's sockets, state and shim sockets in
/run/kvoffload-node): `Cluster(real_node=True)` takes the lock /run/kvoffload-node/lock for as long as its node
runs. What it adds to the host and removes again at teardown, each recorded in state.json["host"]:

  bridge cni0 198.18.0.1/24 (pods 198.18.0.0/24), route 198.19.0.0/24 (Services) on cni0
  nft table inet kvoffload_guard: drops anything forwarded from the bridge to another interface and
      anything with a 198.18.0.0/15 source or destination on another interface (counters stay 0)
  nft tables ip/ip6 kube-proxy (kube-proxy's nftables mode)
  iptables chains kubelet adds (KUBE-FIREWALL, canaries): those not there before are deleted
  sysctls kubelet sets (vm.overcommit_memory, kernel.panic, ...): restored as soon as the node is Ready
  the hugetlb v1 hierarchy (cgroup v1 with a cgroup2 holding hugetlb), the kubepods cgroups, every mount
      under the node's directories, the pods' processes and shims

Nothing is reachable from outside: every address is on cni0, which has no route off the machine.
Registry hosts resolve to http://127.0.0.1:1, so an image pull fails here instead of leaving; images
come from `ctr images import` (the pause image is built here from Kubernetes' pause.c).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from .paths import K8S_VERSION, node_bin_dir
from .procs import LOOPBACK

if TYPE_CHECKING:
    from .cluster import Cluster

NAME = "real-node"
BRIDGE = "cni0"
BRIDGE_IP = "198.18.0.1"  # the host on the bridge: API server, kubelet and kube-proxy bind here
POD_CIDR = "198.18.0.0/24"
SERVICE_CIDR = "198.19.0.0/24"
KUBERNETES_SERVICE_IP = "198.19.0.1"
GUARDED = "198.18.0.0/15"  # pods + Services: never on any other interface
GUARD_TABLE = "kvoffload_guard"
GUARD_LOG = "kvoffload-guard "  # the kernel log prefix of every packet the guard drops
PAUSE_IMAGE = f"localhost/kvoffload/pause:v{K8S_VERSION}"
ARCHIVE_LABEL = "io.kvoffload.archive"  # on an imported image: the tar it came from (names the podman image id)
RUNTIME = "/usr/sbin/runc"  # Debian's runc 1.1.5 takes containerd 2.4's OCI 1.3 spec (crun 1.8 does not)
# The node's taint: only pods that ask for the real node run there (the kwok fleet takes the rest).
TAINT = {"key": "kvoffload.io/real-node", "value": "true", "effect": "NoSchedule"}
LABELS = {"kvoffload.io/real-node": "true", "kvoffload.io/nvme": "true"}
# What a pod (or a KVOffloadServe's spec.scheduling) says to run on the real node.
PLACEMENT = {"nodeSelector": {"kvoffload.io/real-node": "true"},
             "tolerations": [{**TAINT, "operator": "Equal"}]}
# No GPU here, and the node does not claim nvidia.com/gpu. It advertises this extended resource
# instead (a status patch; no device plugin stands behind it): serving pods meant for it set
# spec.resources.gpuResourceName to it, so the rendered pod asks for it where it would ask for
# nvidia.com/gpu, and their engine container is the stand-in image (kvtest.images STANDIN).
GPU_STAND_IN = "kvoffload.io/gpu-stand-in"
STAND_IN_GPUS = "4"
# What kubelet writes at start (kubelet's setupKernelTunables): put back as soon as the node is Ready.
SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
           "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes", "net.ipv4.ip_forward",
           "net.ipv4.conf.all.route_localnet", "net.bridge.bridge-nf-call-iptables")
RUN = Path("/run/kvoffload-node")  # sockets, containerd state, runc state; the lock
HOLDER = RUN / "holder"


def containerd_root() -> Path:
    """containerd's content store (images imported once, kept between clusters), in the cache."""
    return node_bin_dir().parent / "node-containerd-root"


def dirs(c: Cluster) -> dict[str, Path]:
    d = c.dir / "node"
    return {"node": d, "kubelet": d / "kubelet", "cni-conf": d / "cni-conf", "cni-state": d / "cni-state",
            "certs.d": d / "certs.d", "logs": d / "pod-logs", "state": RUN / "containerd", "runc": RUN / "runc",
            "sock": RUN / "containerd.sock", "root": containerd_root()}


def sh(*cmd: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    cp = subprocess.run(list(cmd), capture_output=True, text=True, input=input)
    if check and cp.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {cp.returncode}: {cp.stderr.strip()}")
    return cp


def ctr(c: Cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh(str(node_bin_dir() / "ctr"), "--address", str(dirs(c)["sock"]), "-n", "k8s.io", *args, check=check)


def sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def read_sysctls() -> dict[str, str]:
    out = {}
    for k in SYSCTLS:
        with contextlib.suppress(OSError):
            out[k] = sysctl_path(k).read_text().strip()
    return out


# ----------------------------------------------------------------------------------------- lock
def lock_holder() -> str | None:
    """The cluster dir whose real node holds the machine (its bridge exists), None when free."""
    if sh("ip", "link", "show", BRIDGE, check=False).returncode:
        return None
    with contextlib.suppress(FileNotFoundError):
        return HOLDER.read_text().strip() or "?"
    return "? (cni0 exists, no holder recorded)"


def claim(owner: Path) -> None:
    """One real node per machine: creating cni0 is the atomic claim; a second one fails naming the holder."""
    RUN.mkdir(parents=True, exist_ok=True)
    with open(RUN / "lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        if sh("ip", "link", "add", BRIDGE, "type", "bridge", check=False).returncode:
            raise RuntimeError(f"a real node already runs on this machine (cluster {lock_holder()}); stop it "
                               f"first (KVO_CLUSTER_DIR=<that dir> python -m kvtest down), or remove a left-over "
                               f"{BRIDGE} (ip link del {BRIDGE})")
        HOLDER.write_text(str(owner))


# ----------------------------------------------------------------------------------------- host
def iptables_chains() -> dict[str, list[str]]:
    """{'iptables:filter': [chain, ...], ...}: the chains that exist now."""
    out: dict[str, list[str]] = {}
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            cp = sh(tool, "-w", "-t", table, "-S", check=False)
            out[f"{tool}:{table}"] = [ln.split()[1] for ln in cp.stdout.splitlines() if ln.startswith("-N ")]
    return out


def nft_tables() -> list[str]:
    """Every nft table now, as 'family name' (iptables-nft's tables among them)."""
    return [" ".join(ln.split()[1:3]) for ln in sh("nft", "list", "tables").stdout.splitlines()
            if ln.startswith("table ")]


def _drop(match: str, name: str) -> str:
    """A guard rule: count, log (GUARD_LOG) and drop what `match` selects."""
    return f'{match} counter log prefix "{GUARD_LOG}{name}: " drop comment "{name}"'


def guard_ruleset() -> str:
    """Drop what would leave the bridge: forwarded from cni0 (or a pod's veth) elsewhere, or a pod/Service
    address on any interface but cni0, its veths and lo. Each rule counts and logs what it drops."""
    inside = f'{{ "{BRIDGE}", "veth*", "lo" }}'
    bridge = f'{{ "{BRIDGE}", "veth*" }}'
    return f"""table inet {GUARD_TABLE} {{
  chain forward {{ type filter hook forward priority -200; policy accept;
    {_drop(f"iifname {bridge} oifname != {bridge}", "bridge-to-elsewhere")}
    {_drop(f"oifname {bridge} iifname != {bridge}", "elsewhere-to-bridge")}
  }}
  chain out {{ type filter hook postrouting priority -200; policy accept;
    {_drop(f"oifname != {inside} ip saddr {GUARDED}", "guarded-source-out")}
    {_drop(f"oifname != {inside} ip daddr {GUARDED}", "guarded-destination-out")}
  }}
  chain in {{ type filter hook prerouting priority -200; policy accept;
    {_drop(f"iifname != {inside} ip saddr {GUARDED}", "guarded-source-in")}
    {_drop(f"iifname != {inside} ip daddr {GUARDED}", "guarded-destination-in")}
  }}
}}
"""


def guard_log() -> list[str]:
    """The kernel's log lines of the packets the guard dropped (addresses, ports, TCP flags, interfaces)."""
    return [ln for ln in sh("dmesg").stdout.splitlines() if GUARD_LOG in ln]


def guard_counters() -> dict[str, int]:
    """{rule comment: packets dropped} of the guard table."""
    cp = sh("nft", "-j", "list", "table", "inet", GUARD_TABLE)
    out = {}
    for item in json.loads(cp.stdout)["nftables"]:
        rule = item.get("rule")
        if rule:
            pk = next(e["counter"]["packets"] for e in rule["expr"] if "counter" in e)
            out[rule.get("comment", str(rule["handle"]))] = pk
    return out


def host_up(c: Cluster, st: dict) -> None:
    """Bridge, route, guard, the hugetlb hierarchy; what was there before, for host_down."""
    claim(c.dir)
    # nft first: listing iptables-nft chains may create their (empty) tables.
    host: dict = {"nft": nft_tables(), "sysctls": read_sysctls(), "iptables": iptables_chains(), "added": []}
    st["host"] = host
    c._save(st)

    def added(kind: str, what: str) -> None:
        host["added"].append([kind, what])
        c._save(st)

    added("link", BRIDGE)
    sh("ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    sh("ip", "route", "add", SERVICE_CIDR, "dev", BRIDGE, "src", BRIDGE_IP)
    added("route", SERVICE_CIDR)
    sh("nft", "-f", "-", input=guard_ruleset())
    added("nft", f"inet {GUARD_TABLE}")
    # cgroup v1 with hugetlb either in the cgroup2 mount or bound to a v1 hierarchy that nothing mounts:
    # the runtime wants every controller on one side, and the shim finds a container's cgroup (its OOM
    # events) only when each v1 hierarchy in /proc/self/cgroup is mounted. Mount hugetlb as v1.
    hugetlb = Path("/sys/fs/cgroup/hugetlb")
    v1_mounted = any(ln.split()[0] == "cgroup" and "hugetlb" in ln.split()[3].split(",")
                     for ln in Path("/proc/self/mounts").read_text().splitlines())
    if Path("/sys/fs/cgroup/memory").is_dir() and not v1_mounted:
        hugetlb.mkdir(exist_ok=True)
        sh("mount", "-t", "cgroup", "-o", "hugetlb", "cgroup", str(hugetlb))
        added("mount", str(hugetlb))
    for k in ("node", "kubelet", "cni-conf", "cni-state", "certs.d", "logs", "state", "runc", "root"):
        dirs(c)[k].mkdir(parents=True, exist_ok=True)


def restore_sysctls(st: dict) -> dict[str, tuple[str, str]]:
    """Put back every sysctl that differs from before the node started; -> {key: (was, found)}."""
    changed = {}
    for k, was in st.get("host", {}).get("sysctls", {}).items():
        with contextlib.suppress(OSError):
            now = sysctl_path(k).read_text().strip()
            if now != was:
                sysctl_path(k).write_text(was)
                changed[k] = (was, now)
    return changed


def mounts_under(roots: list[Path]) -> list[str]:
    """Mount points at or below any of `roots`, deepest first."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if any(mp == str(r) or mp.startswith(f"{r}/") for r in roots):
            out.append(mp)
    return sorted(set(out), key=lambda m: m.count("/"), reverse=True)


def kubepods_cgroups() -> list[Path]:
    """Every kubepods cgroup directory (v1 controllers and the unified tree), deepest first."""
    found = []
    for ctl in Path("/sys/fs/cgroup").iterdir():
        root = ctl / "kubepods"
        if root.is_dir():
            found += [p for p, _, _ in os.walk(root)]
    return sorted(found, key=lambda p: str(p).count("/"), reverse=True)


def pod_pids() -> set[int]:
    pids = set()
    for cg in kubepods_cgroups():
        with contextlib.suppress(OSError):
            pids |= {int(p) for p in (Path(cg) / "cgroup.procs").read_text().split()}
    return pids


def shim_pids() -> set[int]:
    """The runc shims this node's containerd started (their executable is ours)."""
    shim = str(node_bin_dir() / "containerd-shim-runc-v2")
    pids = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(p / "exe") == shim:
                    pids.add(int(p.name))
    return pids


def remove_pods(c: Cluster) -> None:
    """While containerd still runs: every container and sandbox of the node gone (images stay)."""
    for line in ctr(c, "tasks", "ls", "-q", check=False).stdout.split():
        ctr(c, "tasks", "kill", "-s", "SIGKILL", line, check=False)
    time.sleep(0.5)
    for line in ctr(c, "tasks", "ls", "-q", check=False).stdout.split():
        ctr(c, "tasks", "rm", "-f", line, check=False)
    ids = ctr(c, "containers", "ls", "-q", check=False).stdout.split()
    if ids:
        ctr(c, "containers", "rm", *ids, check=False)
    sandboxes = ctr(c, "sandboxes", "ls", "-q", check=False).stdout.split()
    for sb in sandboxes:
        ctr(c, "sandboxes", "rm", "-f", sb, check=False)


def host_down(c: Cluster, st: dict) -> list[str]:
    """After the node's processes stopped: kill what is left by PID, unmount, and remove what host_up
    and the node added. Returns problems (empty: the machine is as before)."""
    problems: list[str] = []
    host = st.get("host") or {}
    for pid in pod_pids() | shim_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (pod_pids() or shim_pids()):
        time.sleep(0.1)
    left = pod_pids() | shim_pids()
    problems += [f"pid {p} left" for p in left]
    d = dirs(c)
    roots = [d["node"], d["state"], d["runc"], d["root"], RUN]
    for mp in mounts_under(roots):
        if sh("umount", mp, check=False).returncode:
            sh("umount", "-l", mp, check=False)
    problems += [f"mount left: {m}" for m in mounts_under(roots)]
    for cg in kubepods_cgroups():
        with contextlib.suppress(OSError):
            os.rmdir(cg)
    problems += [f"cgroup left: {cg}" for cg in kubepods_cgroups()]
    before = host.get("iptables", {})
    for key, chains in iptables_chains().items():
        tool, table = key.split(":")
        new = [ch for ch in chains if ch not in before.get(key, [])]
        for line in sh(tool, "-w", "-t", table, "-S", check=False).stdout.splitlines():
            parts = line.split()
            if parts[0] == "-A" and ("-j" in parts and parts[parts.index("-j") + 1] in new):
                sh(tool, "-w", "-t", table, "-D", *parts[1:], check=False)
        for ch in new:
            sh(tool, "-w", "-t", table, "-F", ch, check=False)
        for ch in new:
            if sh(tool, "-w", "-t", table, "-X", ch, check=False).returncode:
                problems.append(f"{tool} -t {table} chain {ch} left")
    for kind, what in reversed(host.get("added", [])):
        if kind == "link":
            sh("ip", "link", "del", what, check=False)
        elif kind == "route":
            sh("ip", "route", "del", what, check=False)
        elif kind == "nft":
            sh("nft", "delete", "table", *what.split(), check=False)
        elif kind == "mount":
            sh("umount", what, check=False)
            with contextlib.suppress(OSError):
                os.rmdir(what)
    # Tables that were not there before: kube-proxy's, and the ones kubelet's iptables calls made.
    for table in nft_tables():
        if table not in host.get("nft", []):
            sh("nft", "delete", "table", *table.split(), check=False)
    problems += [f"nft table {t} left" for t in nft_tables() if t not in host.get("nft", [])]
    changed = restore_sysctls(st)
    if changed:
        problems.append(f"sysctls were still changed at teardown (restored): {changed}")
    if sh("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        problems.append(f"{BRIDGE} left")
    st.pop("host", None)
    shutil.rmtree(RUN, ignore_errors=True)  # sockets, containerd's and runc's state, shim sockets, the claim
    return problems


# ----------------------------------------------------------------------------------------- configs
def write_configs(c: Cluster, ports: dict[str, int], server: str) -> None:
    """containerd's config.toml, the CNI network, the registry trap, kubelet's and kube-proxy's configs."""
    from .pki import write_kubeconfig

    d, b = dirs(c), node_bin_dir()
    (d["node"] / "resolv.conf").write_text("nameserver 127.0.0.1\n")  # pods resolve nothing off the machine
    trap = d["certs.d"] / "_default"
    trap.mkdir(parents=True, exist_ok=True)
    (trap / "hosts.toml").write_text('server = "http://127.0.0.1:1"\n\n[host."http://127.0.0.1:1"]\n'
                                     '  capabilities = ["pull", "resolve"]\n')
    (d["cni-conf"] / "10-kvoffload.conflist").write_text(json.dumps({
        "cniVersion": "1.0.0", "name": "kvoffload", "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": False, "ipMasq": False, "hairpinMode": True,
             "ipam": {"type": "host-local", "dataDir": str(d["cni-state"]),
                      "ranges": [[{"subnet": POD_CIDR, "rangeStart": "198.18.0.10", "gateway": BRIDGE_IP}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": False}]}, indent=1))
    cri, runc = 'plugins."io.containerd.cri.v1', 'containerd.runtimes.runc'
    tables = {
        'plugins."io.containerd.server.v1.grpc"': {"address": str(d["sock"])},
        'plugins."io.containerd.server.v1.ttrpc"': {"address": f"{d['sock']}.ttrpc"},
        'plugins."io.containerd.server.v1.debug"': {"address": ""},
        'plugins."io.containerd.server.v1.metrics"': {"address": ""},
        'plugins."io.containerd.shim.v1.manager"': {"socket_dir": str(RUN / "s")},
        'plugins."io.containerd.internal.v1.opt"': {"path": str(d["node"] / "containerd-opt")},
        'plugins."io.containerd.transfer.v1.local"': {"config_path": str(d["certs.d"])},
        'plugins."io.containerd.image-verifier.v1.bindir"': {"bin_dir": str(d["node"] / "image-verifiers")},
        f'{cri}.images"': {"snapshotter": "overlayfs"},
        f'{cri}.images".pinned_images': {"sandbox": PAUSE_IMAGE},
        f'{cri}.images".registry': {"config_path": str(d["certs.d"])},
        f'{cri}.runtime"': {"restrict_oom_score_adj": True, "netns_mounts_under_state_dir": True,
                            "enable_selinux": False},
        f'{cri}.runtime".containerd': {"default_runtime_name": "runc"},
        f'{cri}.runtime".{runc}': {"runtime_type": "io.containerd.runc.v2"},
        f'{cri}.runtime".{runc}.options': {"BinaryName": RUNTIME, "Root": str(d["runc"]), "SystemdCgroup": False},
        f'{cri}.runtime".cni': {"bin_dirs": [str(b / "cni")], "conf_dir": str(d["cni-conf"])},
    }
    top = {"version": 4, "root": str(d["root"]), "state": str(d["state"]), "temp": str(d["node"] / "containerd-tmp"),
           "disabled_plugins": ["io.containerd.nri.v1.nri"] + [f"io.containerd.snapshotter.v1.{x}" for x in
                                                                ("btrfs", "devmapper", "zfs", "blockfile", "erofs")]}
    (d["node"] / "containerd.toml").write_text(toml(top, tables))
    for sub in ("containerd-tmp", "containerd-opt", "image-verifiers"):
        (d["node"] / sub).mkdir(exist_ok=True)
    pki = c.pki
    write_kubeconfig(c.dir / "kubeconfigs" / "kubelet.kubeconfig", server, pki, "kubelet")
    write_kubeconfig(c.dir / "kubeconfigs" / "kube-proxy.kubeconfig", server, pki, "kube-proxy")
    import yaml

    (d["node"] / "kubelet.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": BRIDGE_IP, "port": ports["kubelet"], "readOnlyPort": 0,
        "healthzBindAddress": LOOPBACK, "healthzPort": ports["kubelet-healthz"],
        "tlsCertFile": str(pki / "kubelet-serving.crt"), "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(pki / "ca.crt")}},
        "authorization": {"mode": "AlwaysAllow"},  # only the API server holds a CA-signed client cert for it
        "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{d['sock']}",
        "resolvConf": str(d["node"] / "resolv.conf"), "clusterDNS": [],
        "registerWithTaints": [TAINT], "maxPods": 110,
        # Images cannot be pulled again here: never garbage-collect them.
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "2%", "imagefs.available": "2%"},
        "podLogsDir": str(d["logs"]), "serializeImagePulls": False,
        "syncFrequency": "10s", "nodeStatusUpdateFrequency": "5s", "volumeStatsAggPeriod": "10s",
    }))
    (d["node"] / "kube-proxy.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "nftables", "hostnameOverride": NAME, "bindAddress": BRIDGE_IP, "clusterCIDR": POD_CIDR,
        "clientConnection": {"kubeconfig": str(c.dir / "kubeconfigs" / "kube-proxy.kubeconfig")},
        "healthzBindAddress": f"{LOOPBACK}:{ports['kube-proxy-healthz']}",
        "metricsBindAddress": f"{LOOPBACK}:{ports['kube-proxy-metrics']}",
        # 0: kube-proxy leaves the conntrack sysctls alone.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "nodePortAddresses": [f"{BRIDGE_IP}/32"],
    }))


def toml(top: dict, tables: dict[str, dict]) -> str:
    """TOML for flat values (strings, bools, ints, lists of strings: JSON spells them as TOML does)."""
    def lines(values: dict) -> list[str]:
        return [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines(top) + [ln for name, vals in tables.items() for ln in (f"[{name}]", *lines(vals))]) + "\n"


def containerd_flags(c: Cluster, p: dict[str, int]) -> list[str]:
    return [f"--config={dirs(c)['node'] / 'containerd.toml'}", "--log-level=warn"]


def kubelet_flags(c: Cluster, p: dict[str, int]) -> list[str]:
    d = dirs(c)
    labels = ",".join(f"{k}={v}" for k, v in LABELS.items())
    return [f"--config={d['node'] / 'kubelet.yaml'}", f"--kubeconfig={c.dir / 'kubeconfigs' / 'kubelet.kubeconfig'}",
            f"--root-dir={d['kubelet']}", f"--cert-dir={d['kubelet'] / 'pki'}", f"--node-ip={BRIDGE_IP}",
            f"--hostname-override={NAME}", f"--node-labels={labels}", "--v=1"]


def kube_proxy_flags(c: Cluster, p: dict[str, int]) -> list[str]:
    return [f"--config={dirs(c)['node'] / 'kube-proxy.yaml'}", "--v=1"]


def _http_ok(port: int, path: str = "/healthz") -> tuple[bool, str]:
    with urllib.request.urlopen(f"http://{LOOPBACK}:{port}{path}", timeout=3) as r:  # noqa: S310 - loopback
        return r.status == 200, f"{path} {r.status}"


def containerd_health(c: Cluster, p: dict[str, int]) -> tuple[bool, str]:
    cp = ctr(c, "version", check=False)
    return cp.returncode == 0, (cp.stdout.split("Server:")[-1].split()[-1] if cp.returncode == 0 else cp.stderr[-80:])


def kubelet_health(c: Cluster, p: dict[str, int]) -> tuple[bool, str]:
    return _http_ok(p["kubelet-healthz"])


def kube_proxy_health(c: Cluster, p: dict[str, int]) -> tuple[bool, str]:
    return _http_ok(p["kube-proxy-healthz"])


# ----------------------------------------------------------------------------------------- images
def pause_image_tar() -> bytes:
    """An OCI image layout (tar) holding the pause binary build-node.sh built, for `ctr images import`."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        info = t.gettarinfo(str(node_bin_dir() / "pause" / "pause"), arcname="pause")
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        with open(node_bin_dir() / "pause" / "pause", "rb") as fh:
            t.addfile(info, fh)
    raw = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(raw).hexdigest()
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
                         "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **blob(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **blob(raw)}]}).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", **blob(manifest),
        "annotations": {"org.opencontainers.image.ref.name": PAUSE_IMAGE,
                        "io.containerd.image.name": PAUSE_IMAGE}}]}).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        def add(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
        add("oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        add("index.json", index)
        for digest, data in blobs.items():
            add(f"blobs/sha256/{digest.split(':')[1]}", data)
    return out.getvalue()


def import_pause(c: Cluster) -> None:
    """The pause image (pause_image_tar) into the node's k8s.io namespace, once."""
    if PAUSE_IMAGE in images(c):
        return
    cp = subprocess.run([str(node_bin_dir() / "ctr"), "--address", str(dirs(c)["sock"]), "-n", "k8s.io",
                         "images", "import", "-"], input=pause_image_tar(), capture_output=True)
    if cp.returncode:
        raise RuntimeError(f"ctr images import (pause): {cp.stderr.decode(errors='replace')[-400:]}")


def load_images(c: Cluster, names: list[str]) -> list[str]:
    """Images kvtest.images builds (its NAMES: "operator", "standin-slim", "router", ...) into the node's containerd,
    from
    their docker-archive tars; one containerd holds already (same podman image id) is skipped."""
    from . import images as built

    done = []
    for name in names:
        tar = built.save(name)  # <name>-<image id>.tar, built and saved once
        tag = built.images()[name].tag
        have = ctr(c, "images", "ls", f"name=={tag}").stdout
        if f"{ARCHIVE_LABEL}={tar.name}" in have:
            continue
        t0 = time.monotonic()
        ctr(c, "images", "import", str(tar))
        ctr(c, "images", "label", tag, f"{ARCHIVE_LABEL}={tar.name}")
        done.append(f"{tag} ({time.monotonic() - t0:.0f}s)")
    return done


def images(c: Cluster) -> set[str]:
    return {ln.split()[0] for ln in ctr(c, "images", "ls").stdout.splitlines()[1:] if ln.strip()}


def after_ready(c: Cluster) -> dict:
    """Once kubelet reports the node Ready: sysctls back, the stand-in GPUs advertised. -> what it did."""
    st = c.state()
    changed = restore_sysctls(st)
    # An extended resource kubelet keeps and copies to allocatable (no device plugin: a stand-in).
    path = "/status/capacity/" + GPU_STAND_IN.replace("/", "~1")
    c.client.request("PATCH", f"/api/v1/nodes/{NAME}/status",
                     body=[{"op": "add", "path": path, "value": STAND_IN_GPUS}],
                     content_type="application/json-patch+json")
    return {"sysctls_restored": {k: list(v) for k, v in changed.items()}}



def oci_specs(c: Cluster, namespace: str, pod: str) -> dict[str, dict]:
    """{container name: the OCI runtime spec containerd generated for it} of a pod on the real node: the
    bundle's config.json that runc was given (init containers, sidecars and the pod's sandbox included)."""
    p = c.client.get("pods", pod, namespace)
    st = p["status"]
    out: dict[str, dict] = {}
    for cs in st.get("initContainerStatuses", []) + st.get("containerStatuses", []):
        cid = (cs.get("containerID") or "").removeprefix("containerd://")
        if cid:
            out[cs["name"]] = _spec(c, cid)
    info = json.loads(ctr(c, "containers", "info", cid).stdout) if out else {}
    sandbox = (info.get("Labels") or {}).get("io.kubernetes.cri.sandbox-id") or info.get("SandboxID")
    if sandbox:
        out["(sandbox)"] = _spec(c, sandbox)
    return out


def _spec(c: Cluster, cid: str) -> dict:
    bundle = dirs(c)["state"] / "io.containerd.runtime.v2.task" / "k8s.io" / cid / "config.json"
    if bundle.exists():  # a running container: exactly what the runtime executes
        return json.loads(bundle.read_text())
    return json.loads(ctr(c, "containers", "info", cid).stdout)["Spec"]  # exited: the spec containerd stored


# ----------------------------------------------------------------------------------------- a pod's processes
def task_pids(c: Cluster, pod: dict) -> dict[str, int]:
    """{container: pid of its first process} of a pod's running containers (containerd's tasks; sidecars included)."""
    tasks = {parts[0]: int(parts[1]) for parts in (ln.split() for ln in ctr(c, "tasks", "ls").stdout.splitlines()[1:])
             if len(parts) >= 3 and parts[2] == "RUNNING"}
    out = {}
    for cs in pod["status"].get("containerStatuses", []) + pod["status"].get("initContainerStatuses", []):
        cid = (cs.get("containerID") or "").removeprefix("containerd://")
        if cid in tasks:
            out[cs["name"]] = tasks[cid]
    return out


def proc_status(pid: int) -> dict[str, str]:
    """/proc/PID/status as the kernel holds the process: Uid, Gid, Groups, CapEff, NoNewPrivs, Seccomp, ..."""
    return {k: v.strip() for k, v in (ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines())}


def mount_options(pid: int) -> dict[str, tuple[str, str]]:
    """{mount point: (per-mount options, fs type)} as the process sees them."""
    out = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        out[left.split()[4]] = (left.split()[5], right.split()[0])
    return out


def listening(pid: int) -> set[tuple[str, int]]:
    """TCP listeners in the process's network namespace (/proc/PID/net/tcp: the pod's, not the host's)."""
    import socket

    out = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":
            addr, port = local.split(":")
            out.add((socket.inet_ntoa(bytes.fromhex(addr)[::-1]), int(port, 16)))
    return out


# ----------------------------------------------------------------------------------------- serving pods
# The engine image of serving pods on the real node: a stand-in (no GPU here). `make test` runs the slim one
# (kvtest.images.STANDIN_SLIM); KVO_STANDIN=full the 8.8 GB one (kvtest.images.STANDIN), whose import into
# containerd takes twice its size on disk.
FULL_STANDIN = os.environ.get("KVO_STANDIN") == "full"
STANDIN = "standin" if FULL_STANDIN else "standin-slim"  # a kvtest.images name
# Memory terms that fit the stand-in: the full one imports torch and vLLM's parser (~1.5 GiB), the slim one is
# a small Python process. The CPU tier is the LMCache server's L1 (a /dev/shm segment the stand-in touches).
STANDIN_SIZES = ({"engineBaseline": "1536Mi", "perWorkerOverhead": "256Mi", "stagingPerWorker": "128Mi",
                  "serverBaseline": "1Gi"} if FULL_STANDIN else
                 {"engineBaseline": "192Mi", "perWorkerOverhead": "32Mi", "stagingPerWorker": "32Mi",
                  "serverBaseline": "96Mi"})
STANDIN_CPU_TIER = "512Mi" if FULL_STANDIN else "64Mi"


RELEASE_NS = "kvoffload-system"  # where `make demo` installs the chart


def operator_config(demo) -> dict:  # noqa: ANN001 - the session's demo handle (tests/conftest.py)
    """The settings file the chart gave the demo's operator (its ConfigMap's config.yaml)."""
    import yaml

    (cm,) = [c for c in demo.client.list("configmaps", RELEASE_NS) if "config.yaml" in (c.get("data") or {})]
    return yaml.safe_load(cm["data"]["config.yaml"])


def serve_spec(name: str, image: str, disk: Path, *, env=(), reclaim: str = "Delete") -> dict:
    """A KVOffloadServe (backend lmcache-server, a hostPath disk tier at `disk`) whose pod runs on this node. It pins
    the stand-in's pair (kvtest.images.STANDIN_PAIR, offered), whose H200 pages the stand-in serves and whose LMCache
    server the full stand-in runs: the operator renders for the pair the image holds."""
    from .images import STANDIN_PAIR  # not at the top: `import kvtest` would run kvtest.images before `python -m` does

    vllm, lmcache = STANDIN_PAIR.split("-")
    return {"apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadServe", "metadata": {"name": name},
            "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
                     "engine": {"image": image, "vllmVersion": vllm, "lmcacheVersion": lmcache,
                                "maxModelLen": 8192, "maxNumSeqs": 4, "env": list(env)},
                     "offload": {"backend": "lmcache-server", "chunkSize": 256, "cpu": {"size": STANDIN_CPU_TIER},
                                 "disk": {"path": str(disk), "size": "256Mi", "reclaimPolicy": reclaim}},
                     "resources": {"gpuResourceName": GPU_STAND_IN, "gpuMemory": "24Gi", "cpu": "100m", "shm": "64Mi",
                                   **STANDIN_SIZES},
                     "scheduling": PLACEMENT}}


def routed_spec(name: str, image: str, disk: Path, *, replicas: int = 2) -> dict:
    """serve_spec with spec.routing (cache_aware) and `replicas` replicas, backend lmcache (in-process; the same disk
    tier): the lmcache-server backend's server sidecar requests a whole CPU per pod, so two of its pods do not fit a
    2-CPU node."""
    body = serve_spec(name, image, disk)
    spec = body["spec"]
    spec["offload"]["backend"] = "lmcache"
    spec["resources"] = {k: v for k, v in spec["resources"].items() if k != "serverBaseline"}
    spec.update(replicas=replicas, routing={"policy": "cache_aware"})
    return body


def kv_routed_spec(name: str, image: str, *, replicas: int = 2) -> dict:
    """spec.routing with policy kv_aware on backend vllm-native (CPU tier only): its engines publish the GPU and CPU
    tiers' KV events, which the router indexes."""
    body = serve_spec(name, image, Path("/unused"))
    spec = body["spec"]
    spec["offload"] = {"backend": "vllm-native", "cpu": {"size": STANDIN_CPU_TIER}}
    spec["resources"] = {k: v for k, v in spec["resources"].items() if k not in ("serverBaseline", "stagingPerWorker")}
    spec.update(replicas=replicas, routing={"policy": "kv_aware"})
    return body
