"""A cluster CA and the certificates it signs, made with `cryptography`, for local clusters
and tests.

    ca.pem / ca.key                       the cluster CA (keep ca.key off the nodes)
    <name>.pem / <name>.key               a node: its role and its addresses
    <name>.pem / <name>.key               a server that is no node (Redis): its addresses

A node certificate says what the node is in one URI SAN, ``spiffe://spotinfer/role/<role>``
(coordinator, worker, daemon, operator), which the servers' authorization tables read
(`common.authz`), optionally which node it is, ``spiffe://spotinfer/node/<name>`` (a worker
takes Preempt, Resume and Prefetch from a daemon certificate naming its worker id), and where it may be reached in DNS and IP SANs (always localhost and
127.0.0.1). A server certificate (`make_server_cert`, for the local cluster's redis-server)
holds the addresses only. Keys are EC P-256 and written 0600. The processes themselves only
load files.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.authz import NODE_ROLES, node_uri, role_uri

CA_NAME = "ca"
DEFAULT_VALID_DAYS = 365
LOCAL_NAMES = ("localhost",)
LOCAL_IPS = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class CertPaths:
    """Where one certificate and its key lie."""

    cert: Path
    key: Path


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    os.replace(tmp, path)


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def make_ca(folder: Path, name: str = "spotinfer cluster CA", days: int = 3650) -> CertPaths:
    """A self-signed CA in ``folder`` (ca.pem, ca.key); returns its paths."""
    folder.mkdir(parents=True, exist_ok=True)
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    not_before, not_after = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    paths = CertPaths(folder / f"{CA_NAME}.pem", folder / f"{CA_NAME}.key")
    _write_key(paths.key, key)
    _write_cert(paths.cert, cert)
    return paths


def make_node_cert(
    ca: CertPaths,
    folder: Path,
    name: str,
    role: str,
    hosts: tuple[str, ...] = (),
    days: int = DEFAULT_VALID_DAYS,
    extra_roles: tuple[str, ...] = (),
    node: str = "",
) -> CertPaths:
    """``<name>.pem`` / ``<name>.key`` in ``folder``, signed by ``ca``, for a node of ``role``
    reachable at ``hosts`` (names or IPs; localhost and 127.0.0.1 always). ``extra_roles``:
    more roles for one certificate (a worker VM's worker and daemon share the files);
    ``node``: the node it belongs to (its worker's id), "" for none."""
    if node and ("/" in node or not node.isprintable() or node != node.strip()):
        raise ValueError(f"a node name is one path segment without spaces, got {node!r}")
    for each in (role, *extra_roles):
        if each not in NODE_ROLES:
            raise ValueError(f"role must be one of {NODE_ROLES}, got {each!r}")
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, name),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
        ]
    )
    names = _subject_alternative_names((role, *extra_roles), hosts, node)
    return _sign(ca, folder, name, subject, names, days)


def make_server_cert(
    ca: CertPaths,
    folder: Path,
    name: str,
    hosts: tuple[str, ...] = (),
    days: int = DEFAULT_VALID_DAYS,
) -> CertPaths:
    """``<name>.pem`` / ``<name>.key`` in ``folder``, signed by ``ca``, for a server that is no
    spotinfer node (the local cluster's redis-server): no role, reachable at ``hosts``
    (localhost, 127.0.0.1 and ::1 always), and, like a node's, good as a client certificate."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    return _sign(ca, folder, name, subject, _subject_alternative_names((), hosts), days)


def _sign(
    ca: CertPaths,
    folder: Path,
    name: str,
    subject: x509.Name,
    alternative_names: x509.SubjectAlternativeName,
    days: int,
) -> CertPaths:
    """A new key and its certificate (TLS server and client), signed by ``ca``, written as
    ``<name>.pem`` / ``<name>.key`` in ``folder``."""
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey), "the CA key must be EC"
    folder.mkdir(parents=True, exist_ok=True)
    key = _new_key()
    not_before, not_after = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(alternative_names, critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = CertPaths(folder / f"{name}.pem", folder / f"{name}.key")
    _write_key(paths.key, key)
    _write_cert(paths.cert, cert)
    return paths


def _subject_alternative_names(
    node_roles: tuple[str, ...], hosts: tuple[str, ...], node: str = ""
) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(role_uri(role)) for role in dict.fromkeys(node_roles)
    ]
    if node:
        names.append(x509.UniformResourceIdentifier(node_uri(node)))
    seen: set[str] = set()
    for host in (*LOCAL_NAMES, *LOCAL_IPS, *hosts):
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def load_ca(folder: Path) -> CertPaths:
    paths = CertPaths(folder / f"{CA_NAME}.pem", folder / f"{CA_NAME}.key")
    if not paths.cert.exists() or not paths.key.exists():
        raise FileNotFoundError(f"no CA in {folder} (make one with `spotinfer certs ca`)")
    return paths
