"""The control plane as one table: each component's ports, flags and health check.

Start order is table order; `Cluster` spawns, stops, restarts and reports every component through
this table only. Every listener binds 127.0.0.1; node InternalIPs, pod IPs and Service ClusterIPs
are all inside 127.0.0.0/8 (docs/cluster.md).
"""

from __future__ import annotations

import datetime as _dt
import http.client
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from . import node
from .client import ApiError
from .fleet import KWOK_ANNOTATION
from .procs import LOOPBACK

if TYPE_CHECKING:
    from .cluster import Cluster

# Service ClusterIPs: inside 127/8 as well, so even a client that dials a ClusterIP stays on
# loopback (the apiserver accepts a loopback range; only Endpoints refuse loopback IPs).
SERVICE_CIDR = "127.3.0.0/16"
# kwok's fallback pod CIDR; every node also gets its own /24 from it (4096 nodes max).
KWOK_POD_CIDR = "127.16.0.0/12"

Ports = dict[str, int]
Health = tuple[bool, str]  # (ok, detail)


@dataclass(frozen=True)
class Component:
    name: str
    ports: tuple[str, ...]  # its keys in state["ports"], allocated in table order
    flags: Callable[[Cluster, Ports], list[str]]
    health: Callable[[Cluster, Ports], Health]
    start_timeout: float  # seconds to become healthy at start-up
    # Healthy enough to go on after a (re)start; default: `health`. kwok serves nothing to ask.
    ready: Callable[[Cluster, Ports], bool] | None = None

    def is_ready(self, c: Cluster, ports: Ports) -> bool:
        return self.ready(c, ports) if self.ready else self.health(c, ports)[0]


# ------------------------------------------------------------------------------------------ flags
def _etcd_flags(c: Cluster, p: Ports) -> list[str]:
    client, peer = f"http://{LOOPBACK}:{p['etcd-client']}", f"http://{LOOPBACK}:{p['etcd-peer']}"
    return [
        "--name=kvoffload", f"--data-dir={c.dir / 'etcd'}",
        f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=kvoffload={peer}", "--initial-cluster-state=new",
        "--unsafe-no-fsync=true", "--log-level=warn",
        "--quota-backend-bytes=4294967296", "--snapshot-count=10000",
    ]


def _apiserver_flags(c: Cluster, p: Ports) -> list[str]:
    k = c.pki
    if c.real_node:
        # Bound to the bridge: kubelet, kube-proxy and the pods (through the `kubernetes` Service's
        # Endpoints, which refuse loopback) reach it there; the Node authorizer for the kubelet.
        node_flags = ["--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
                      f"--kubelet-client-certificate={k / 'apiserver-kubelet-client.crt'}",
                      f"--kubelet-client-key={k / 'apiserver-kubelet-client.key'}",
                      f"--kubelet-certificate-authority={k / 'ca.crt'}"]
    else:
        # No Endpoints for the `kubernetes` Service (its only address would be loopback).
        node_flags = ["--authorization-mode=RBAC", "--endpoint-reconciler-type=none"]
    return [
        *node_flags,
        f"--etcd-servers=http://{LOOPBACK}:{p['etcd-client']}",
        f"--bind-address={c.api_host}", f"--advertise-address={c.api_host}",
        f"--secure-port={p['kube-apiserver']}", f"--cert-dir={k}",
        f"--tls-cert-file={k / 'apiserver.crt'}", f"--tls-private-key-file={k / 'apiserver.key'}",
        f"--client-ca-file={k / 'ca.crt'}",
        f"--service-account-issuer=https://{c.api_host}:{p['kube-apiserver']}",
        f"--service-account-key-file={k / 'sa.pub'}",
        f"--service-account-signing-key-file={k / 'sa.key'}",
        f"--service-cluster-ip-range={c.service_cidr}",
        "--allow-privileged=true",
        f"--requestheader-client-ca-file={k / 'front-proxy-ca.crt'}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={k / 'front-proxy-client.crt'}",
        f"--proxy-client-key-file={k / 'front-proxy-client.key'}",
        # logs/exec/port-forward would dial the node's InternalIP (loopback), never a
        # Hostname that needs DNS.
        "--kubelet-preferred-address-types=InternalIP",
        # Webhooks and aggregated APIs are dialled at endpoint (pod) IPs, all loopback.
        "--enable-aggregator-routing=true",
        "--profiling=false", "--event-ttl=1h",
    ]


def _served_by_itself(c: Cluster, p: Ports, name: str) -> list[str]:
    """kube-controller-manager's and kube-scheduler's shared flags: its kubeconfig, its own HTTPS port."""
    k, kc = c.pki, c.dir / "kubeconfigs" / f"{name}.kubeconfig"
    return [
        f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
        f"--bind-address={LOOPBACK}", f"--secure-port={p[name]}",
        f"--tls-cert-file={k / f'{name}-serving.crt'}",
        f"--tls-private-key-file={k / f'{name}-serving.key'}",
    ]


def _kcm_flags(c: Cluster, p: Ports) -> list[str]:
    k = c.pki
    return [
        *_served_by_itself(c, p, "kube-controller-manager"),
        f"--root-ca-file={k / 'ca.crt'}", f"--service-account-private-key-file={k / 'sa.key'}",
        f"--cluster-signing-cert-file={k / 'ca.crt'}", f"--cluster-signing-key-file={k / 'ca.key'}",
        "--use-service-account-credentials=true", "--leader-elect=false",
        "--controllers=*", "--allocate-node-cidrs=false",
        f"--service-cluster-ip-range={c.service_cidr}",
        "--kube-api-qps=200", "--kube-api-burst=400", "--profiling=false",
    ]


def _scheduler_flags(c: Cluster, p: Ports) -> list[str]:
    return [*_served_by_itself(c, p, "kube-scheduler"), "--leader-elect=false", "--profiling=false"]


def _kwok_flags(c: Cluster, p: Ports) -> list[str]:
    # No --server-address and no --node-port: kwok opens no port at all.
    return [
        f"--kubeconfig={c.dir / 'kubeconfigs' / 'kwok.kubeconfig'}",
        f"--config={c.dir / 'kwok.yaml'}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
        f"--node-ip={LOOPBACK}", f"--cidr={KWOK_POD_CIDR}",
        "--node-lease-duration-seconds=40",
    ]


# ----------------------------------------------------------------------------------------- health
def _etcd_health(c: Cluster, p: Ports) -> Health:
    conn = http.client.HTTPConnection(LOOPBACK, p["etcd-client"], timeout=3)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        body = r.read().decode()
    finally:
        conn.close()
    return r.status == 200 and '"health":"true"' in body.replace(" ", ""), body.strip()[:80]


def _apiserver_health(c: Cluster, p: Ports) -> Health:
    try:
        return True, f"/readyz 200 {str(c.client.request('GET', '/readyz', timeout=3))[:60]}"
    except ApiError as exc:
        return False, f"/readyz {exc.status} {str(exc.body)[:60]}"


def _healthz(name: str) -> Callable[[Cluster, Ports], Health]:
    """A controller's own HTTPS port (not the API server's): a plain GET, no client certificate."""
    def health(c: Cluster, p: Ports) -> Health:
        code, body = c.request("GET", "/healthz", p[name], timeout=3)
        return code == 200, f"/healthz {code} {str(body)[:60]}"
    return health


def _kwok_health(c: Cluster, p: Ports) -> Health:
    """kwok serves nothing (no --server-address): judge it by the fleet's node leases."""
    leases = c.client.list("leases", "kube-node-lease")
    names = {n["metadata"]["name"] for n in c.fleet_nodes()}
    now = _dt.datetime.now(_dt.timezone.utc)
    fresh = 0
    for lease in leases:
        if lease["metadata"]["name"] not in names:
            continue
        rt = lease["spec"].get("renewTime")
        if rt and (now - _dt.datetime.fromisoformat(rt.replace("Z", "+00:00"))).total_seconds() < 60:
            fresh += 1
    return fresh == len(names), f"{fresh}/{len(names)} node leases fresh"


COMPONENTS = (
    Component("etcd", ("etcd-client", "etcd-peer"), _etcd_flags, _etcd_health, start_timeout=20),
    Component("kube-apiserver", ("kube-apiserver",), _apiserver_flags, _apiserver_health, start_timeout=90),
    Component("kube-controller-manager", ("kube-controller-manager",), _kcm_flags,
              _healthz("kube-controller-manager"), start_timeout=60),
    Component("kube-scheduler", ("kube-scheduler",), _scheduler_flags, _healthz("kube-scheduler"), start_timeout=60),
    # Started with the controllers; the nodes it drives becoming Ready is the start-up's last wait.
    Component("kwok", (), _kwok_flags, _kwok_health, start_timeout=60, ready=lambda c, p: True),
)
# The real node (kvtest.node), after the control plane: the runtime, then kubelet and kube-proxy.
NODE_COMPONENTS = (
    Component("containerd", (), node.containerd_flags, node.containerd_health, start_timeout=90),
    Component("kubelet", ("kubelet", "kubelet-healthz"), node.kubelet_flags, node.kubelet_health, start_timeout=60),
    Component("kube-proxy", ("kube-proxy-healthz", "kube-proxy-metrics"), node.kube_proxy_flags,
              node.kube_proxy_health, start_timeout=60),
)
BY_NAME = {comp.name: comp for comp in COMPONENTS + NODE_COMPONENTS}
# Start-up stages: each waits until its components are ready before the next starts.
STAGES = (("etcd",), ("kube-apiserver",), ("kube-controller-manager", "kube-scheduler", "kwok"))
NODE_STAGES = (("containerd",), ("kubelet", "kube-proxy"))
