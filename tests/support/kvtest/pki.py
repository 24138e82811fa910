"""The control plane's PKI (cryptography): a CA, serving and client certificates, the
service-account key pair, the front-proxy pair; and kubeconfigs that use them."""

from __future__ import annotations

import datetime as _dt
import ipaddress
from pathlib import Path
from typing import Iterable

from .procs import LOOPBACK

KUBERNETES_SERVICE_IP = "127.3.0.1"  # the first address of the Service CIDR (components.SERVICE_CIDR)


def write_pki(d: Path, api_ips: Iterable[str] = (LOOPBACK, KUBERNETES_SERVICE_IP),
              node: tuple[str, str] | None = None) -> None:
    """CA, serving certs, client certs and the service-account key pair (cryptography).

    `api_ips`: the API server's addresses (its certificate's IP SANs). `node` = (name, IP) of a real
    node (kvtest.node): its kubelet's client and serving certificates, kube-proxy's, and the API
    server's client certificate for kubelets (logs, exec, port-forward)."""
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
          ips=list(api_ips))
    issue("kube-controller-manager-serving", "kube-controller-manager", server=True,
          dns=local_dns, ips=[LOOPBACK])
    issue("kube-scheduler-serving", "kube-scheduler", server=True, dns=local_dns, ips=[LOOPBACK])
    issue("admin", "kvoffload-admin", "system:masters")
    issue("kube-controller-manager", "system:kube-controller-manager")
    issue("kube-scheduler", "system:kube-scheduler")
    # kwok plays every kubelet of the fleet (node status, leases, pod status, deletes).
    issue("kwok", "kwok-controller", "system:masters")
    if node:
        node_name, node_ip = node
        issue("kubelet", f"system:node:{node_name}", "system:nodes")  # the Node authorizer's identity
        issue("kubelet-serving", f"system:node:{node_name}", server=True, dns=[node_name], ips=[node_ip])
        issue("kube-proxy", "system:kube-proxy")  # bound to system:node-proxier by default
        issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")

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


def write_kubeconfig(path: Path, server: str, pki: Path, user: str, token: str | None = None,
                     namespace: str | None = None) -> None:
    """A kubeconfig for `user`: its client certificate from `pki`, or with `token` that bearer token
    alone (a ServiceAccount's), in `namespace` if given."""
    import base64

    import yaml

    b64 = lambda p: base64.b64encode(p.read_bytes()).decode()  # noqa: E731
    creds = {"token": token} if token else {"client-certificate-data": b64(pki / f"{user}.crt"),
                                             "client-key-data": b64(pki / f"{user}.key")}
    context = {"cluster": "kvoffload", "user": user, **({"namespace": namespace} if namespace else {})}
    cfg = {
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "clusters": [{"name": "kvoffload", "cluster": {
            "server": server, "certificate-authority-data": b64(pki / "ca.crt")}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "kvoffload", "context": context}],
        "current-context": "kvoffload",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    path.chmod(0o600)
