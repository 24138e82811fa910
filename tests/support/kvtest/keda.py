"""KEDA's operator and metrics API server (built by tests/autoscaling/build-keda.sh) as local processes against
the kvtest control plane, serving external.metrics.k8s.io to kube-controller-manager's real HPA controller.

How the API server reaches the metrics server without leaving loopback: the APIService names a Service of type
ExternalName `127.0.0.1`. The API server resolves an APIService to an address itself; with
--enable-aggregator-routing=true it wants EndpointSlices, which refuse loopback IPs (docs/cluster.md), so while
KEDA runs the API server runs with routing off (ClusterIPs are inside 127.3.0.0/16 too) and is restarted with
its own flags afterwards. Certificates: one pair from the cluster's CA for the metrics server (the name the
aggregator checks, keda-metrics-apiserver.keda.svc) and for KEDA's operator <-> metrics-server gRPC (mutual TLS).
"""

from __future__ import annotations

import base64
import datetime as _dt
import ipaddress
import math
import os
import subprocess
from pathlib import Path

import yaml

from . import background
from .cluster import Cluster
from .paths import ROOT
from .procs import LOOPBACK, free_ports, wait_until

KEDA_VERSION = "v2.21.0"
NAMESPACE = "keda"
SERVICE = "keda-metrics-apiserver"
API_SERVICE = "v1beta1.external.metrics.k8s.io"
ROUTING_ON = "--enable-aggregator-routing=true"
SCALED_OBJECT_CRD = "scaledobjects.keda.sh"


def built() -> Path | None:
    """The cached KEDA binaries (`make keda` builds them), or None when they are not built."""
    background.wait("keda")
    cp = subprocess.run([str(ROOT / "tests" / "autoscaling" / "build-keda.sh"), "--check"], text=True,
                        capture_output=True, env={**os.environ, "KEDA_VERSION": KEDA_VERSION})
    return Path(cp.stdout.strip()) if cp.returncode == 0 else None


def _certs(cluster: Cluster, d: Path) -> None:
    """ca.crt, tls.crt, tls.key in `d` (the names KEDA reads), signed by the cluster's CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate((cluster.pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((cluster.pki / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(minutes=5)
    sans = [x509.DNSName(f"{SERVICE}.{NAMESPACE}.svc"), x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address(LOOPBACK))]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "keda")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + _dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    d.mkdir(parents=True, exist_ok=True)
    (d / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (d / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))


class Keda:
    """start(): KEDA's CRDs, the APIService, the operator and the metrics server; stop() undoes all of it."""

    def __init__(self, cluster: Cluster, workdir: Path, bin_dir: Path) -> None:
        self.cluster, self.dir, self.bin = cluster, workdir, bin_dir
        self.procs: list[tuple[subprocess.Popen, object]] = []
        self.apiserver_args: list[str] | None = None
        self.crds: list[str] = []

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "w")
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
        env.update(NO_PROXY="*", no_proxy="*", KUBECONFIG=str(self.cluster.kubeconfig), WATCH_NAMESPACE="",
                   POD_NAMESPACE=NAMESPACE, KEDA_CLUSTER_OBJECT_NAMESPACE=NAMESPACE)
        proc = subprocess.Popen([str(self.bin / name), *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=self.dir, start_new_session=True)
        self.procs.append((proc, log))

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def start(self) -> Keda:
        c, client = self.cluster, self.cluster.client
        certs = self.dir / "certs"
        _certs(c, certs)
        for path in sorted((self.bin / "crds").glob("*.yaml")):
            doc = yaml.safe_load(path.read_text())
            client.apply(doc)
            client.established(doc["metadata"]["name"])
            self.crds.append(doc["metadata"]["name"])
        args = c.component_args("kube-apiserver")
        if ROUTING_ON in args:
            self.apiserver_args = args
            c.restart("kube-apiserver", args=[a for a in args if a != ROUTING_ON]
                      + ["--enable-aggregator-routing=false"])
        client.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        grpc, adapter, health, metrics = free_ports(4)
        client.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE, "namespace": NAMESPACE},
                      "spec": {"type": "ExternalName", "externalName": LOOPBACK}})
        client.apply({"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
                      "metadata": {"name": API_SERVICE},
                      "spec": {"group": "external.metrics.k8s.io", "version": "v1beta1", "groupPriorityMinimum": 100,
                               "versionPriority": 100,
                               "caBundle": base64.b64encode((certs / "ca.crt").read_bytes()).decode(),
                               "service": {"namespace": NAMESPACE, "name": SERVICE, "port": adapter}}})
        self._spawn("keda", [f"--metrics-bind-address={LOOPBACK}:{metrics}",
                             f"--health-probe-bind-address={LOOPBACK}:{health}",
                             f"--metrics-service-bind-address={LOOPBACK}:{grpc}", f"--cert-dir={certs}",
                             "--enable-cert-rotation=false", "--enable-webhook-patching=false",
                             "--enable-apiservice-patching=false", "--zap-log-level=info"])
        kc = str(c.kubeconfig)
        self._spawn("keda-adapter", [f"--secure-port={adapter}", f"--bind-address={LOOPBACK}", f"--cert-dir={certs}",
                                     f"--tls-cert-file={certs / 'tls.crt'}",
                                     f"--tls-private-key-file={certs / 'tls.key'}",
                                     f"--metrics-service-address={LOOPBACK}:{grpc}", f"--port={free_ports(1)[0]}",
                                     f"--lister-kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
                                     f"--authorization-kubeconfig={kc}", "--zap-log-level=info"])

        def available() -> bool:
            for proc, _ in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"KEDA exited:\n{self.log('keda')[-2000:]}\n{self.log('keda-adapter')[-2000:]}")
            svc = client.get_or_none("apiservice", API_SERVICE) or {}
            return any(x["type"] == "Available" and x["status"] == "True"
                       for x in svc.get("status", {}).get("conditions", []))

        wait_until(available, timeout=120, interval=0.5, message=f"APIService {API_SERVICE} Available")
        return self

    def stop(self) -> None:
        client = self.cluster.client
        if self.procs and self.crds:
            # While KEDA runs (it removes its finalizers): every ScaledObject, so its CRDs can go below.
            for so in client.list(SCALED_OBJECT_CRD):
                client.delete(SCALED_OBJECT_CRD, so["metadata"]["name"], so["metadata"]["namespace"], wait=True,
                              missing_ok=True)
        for proc, log in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()  # type: ignore[attr-defined]
        self.procs = []
        # An APIService nobody serves would make discovery (kubectl api-resources) fail for later tests.
        client.delete("apiservice", API_SERVICE, missing_ok=True)
        for crd in self.crds:  # a cluster without KEDA again, for later tests
            client.delete("crd", crd, wait=True, missing_ok=True)
        self.crds = []
        if self.apiserver_args is not None:
            self.cluster.restart("kube-apiserver", args=self.apiserver_args)
            self.apiserver_args = None


def hpa_replicas(per_replica: bool, value: float, replicas: int, target: float) -> int:
    """kube-controller-manager's replica count for one KEDA trigger (a test oracle): AverageValue (`per_replica`)
    divides the service's value by the replicas, Value takes it whole; within the HPA's 10 % tolerance of the
    target it holds, else it scales the current replicas by the ratio."""
    ratio = (value / replicas if per_replica else value) / target
    return replicas if abs(ratio - 1) <= 0.1 else math.ceil(ratio * replicas)
