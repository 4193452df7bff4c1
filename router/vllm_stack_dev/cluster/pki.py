"""The test cluster's keys and certificates, made fresh for each cluster (nothing is committed).

A real API server authenticates every caller: the admin and the control-plane components present client
certificates signed by the cluster CA (their user and group are the certificate's CN and O, as kubeadm
sets them up), the API server presents a serving certificate for loopback, and ServiceAccount tokens are
signed with a key pair of their own. A second CA signs the front proxy's client certificate, which the API
server uses towards aggregated APIs (KEDA's metrics adapter is one).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=7)  # a test cluster lives minutes; a week covers a clock that drifts
#: The names the API server answers to: loopback, and the in-cluster names a pod's client would use.
API_SERVER_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc")


@dataclass(frozen=True)
class Credential:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterPki:
    """Every file the control plane's flags name."""

    ca: Credential
    front_proxy_ca: Credential
    api_server: Credential
    front_proxy_client: Credential
    service_account_key: Path  # private: the API server signs tokens with it, the controller manager too
    service_account_public: Path
    clients: dict[str, Credential]  # by component: admin, controller-manager, scheduler, kwok


#: Client identities (CN, O) as kubeadm gives them: RBAC's default bindings name these users and groups.
CLIENTS = {
    "admin": ("kubernetes-admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", None),
    "scheduler": ("system:kube-scheduler", None),
    "kwok": ("kwok-controller", "system:masters"),  # kwok patches node and pod status of every namespace
}


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        parts.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(parts)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def _make_ca(folder: Path, name: str) -> tuple[Credential, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _key()
    subject = _name(name)
    cert = (
        _builder(subject, subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .sign(key, hashes.SHA256())
    )
    credential = Credential(folder / f"{name}.crt", folder / f"{name}.key")
    credential.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(credential.key, key)
    return credential, key, cert


def _issue(
    folder: Path,
    file_name: str,
    subject: x509.Name,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    *,
    server_names: tuple[str, ...] = (),
    server_ips: tuple[str, ...] = (),
    client_too: bool = False,
) -> Credential:
    key = _key()
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server_names or server_ips else []
    if client_too or not usages:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    builder = (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if server_names or server_ips:
        alternatives: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
        alternatives += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    credential = Credential(folder / f"{file_name}.crt", folder / f"{file_name}.key")
    credential.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(credential.key, key)
    return credential


def make_pki(folder: Path, api_server_ips: tuple[str, ...]) -> ClusterPki:
    """Create every key and certificate under ``folder`` (made private to this user)."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    ca, ca_key, ca_cert = _make_ca(folder, "ca")
    front_ca, front_key, front_cert = _make_ca(folder, "front-proxy-ca")
    api_server = _issue(
        folder, "apiserver", _name("kube-apiserver"), ca_key, ca_cert,
        server_names=API_SERVER_NAMES, server_ips=api_server_ips,
    )  # fmt: skip
    front_client = _issue(folder, "front-proxy-client", _name("front-proxy-client"), front_key, front_cert)
    clients = {
        component: _issue(folder, component, _name(cn, group), ca_key, ca_cert)
        for component, (cn, group) in CLIENTS.items()
    }
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sa_private, sa_public = folder / "sa.key", folder / "sa.pub"
    _write_key(sa_private, sa_key)
    sa_public.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return ClusterPki(ca, front_ca, api_server, front_client, sa_private, sa_public, clients)


def make_tls_bundle(folder: Path, names: tuple[str, ...], ips: tuple[str, ...]) -> Path:
    """A CA of its own and one key pair it signed, for serving and as a client (mutual TLS between two
    processes that share the folder), as `ca.crt`, `tls.crt` and `tls.key`: the layout cert-manager
    writes and KEDA's operator and metrics adapter read from their `--cert-dir`."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    ca, ca_key, ca_cert = _make_ca(folder, "ca")
    leaf = _issue(folder, "tls", _name(names[0]), ca_key, ca_cert, server_names=names, server_ips=ips,
                  client_too=True)  # fmt: skip
    assert ca.cert.name == "ca.crt" and leaf.cert.name == "tls.crt" and leaf.key.name == "tls.key"
    ca.key.unlink()  # nothing else is signed with it
    return folder


def issue_signed_by(
    ca: Credential,
    folder: Path,
    file_name: str,
    common_name: str,
    organization: str | None = None,
    *,
    server_ips: tuple[str, ...] = (),
) -> Credential:
    """A key pair signed by the CA whose files ``ca`` names, after the cluster has started: a node's
    kubelet (`system:node:<name>` in `system:nodes`, and its serving certificate) or kube-proxy."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = _name(common_name, organization)
    return _issue(folder, file_name, name, ca_key, ca_cert, server_ips=server_ips)
