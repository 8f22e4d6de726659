"""A throwaway PKI for the TLS tests and ``ctxmem bench security``: a CA, a server
certificate for 127.0.0.1 and client certificates per tenant, written as PEM files (keys
0600), made with ``cryptography``. Never for production: nothing here is kept secret."""

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


@dataclass
class Pki:
    """Where the files are: ``ca``, ``server_cert``/``server_key`` and, per tenant,
    ``client[tenant] = (cert, key)``."""

    dir: Path
    ca_key: ec.EllipticCurvePrivateKey
    ca_cert: x509.Certificate
    ca: Path
    server_cert: Path
    server_key: Path
    client: dict[str, tuple[Path, Path]]


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))


def _cert(subject_cn: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
          issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False,
          san: list[x509.GeneralName] | None = None, server: bool = False,
          serial: int | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
         .issuer_name(issuer).public_key(key.public_key())
         .serial_number(serial or x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if not ca:
        b = b.add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def server_cert(pki: Pki, cert_path: Path, key_path: Path, serial: int | None = None
                ) -> x509.Certificate:
    """Write a new server certificate for 127.0.0.1 (and ``localhost``) signed by the CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert("ctxmem-test-server", key, pki.ca_cert.subject, pki.ca_key, server=True,
                 serial=serial, san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                     x509.DNSName("localhost")])
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert


def make_pki(root: Path, tenants: tuple[str, ...] = ("alice", "bob")) -> Pki:
    """A fresh CA, server certificate and one client certificate per tenant (its URI SAN
    ``ctxmem://tenant/NAME``; CN ``cn-NAME`` so the SAN is what names the tenant)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ctxmem test CA")])
    ca_cert = _cert("ctxmem test CA", ca_key, ca_name, ca_key, ca=True)
    ca = root / "ca.crt"
    ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    pki = Pki(root, ca_key, ca_cert, ca, root / "tls.crt", root / "tls.key", {})
    server_cert(pki, pki.server_cert, pki.server_key)
    for t in tenants:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"cn-{t}", key, ca_name, ca_key,
                     san=[x509.UniformResourceIdentifier(f"ctxmem://tenant/{t}")])
        c, k = root / f"{t}.crt", root / f"{t}.key"
        c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(k, key)
        pki.client[t] = (c, k)
    return pki


def member_cert(pki: Pki, name: str) -> tuple[Path, Path]:
    """A pod member's certificate (server and client use, for 127.0.0.1), signed by the
    CA: the pod's peer-fetch TLS in the tests and ``ctxmem bench pod``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(pki.ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(pki.ca_key, hashes.SHA256()))
    c, k = pki.dir / f"{name}.crt", pki.dir / f"{name}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(k, key)
    return c, k
