"""A throwaway PKI for the transport-security tests: CAs, a server and client certificates (PEM files)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: Issued  # SAN 127.0.0.1, localhost and specmesh-internal; signed by `ca`
    client: Issued  # signed by `ca`
    foreign_ca: Path
    foreign_client: Issued  # signed by `foreign_ca`, which the servers do not trust


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, cert: x509.Certificate, key) -> Issued:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return Issued(cert_path, key_path)


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _ca(directory: Path, stem: str) -> tuple[Issued, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(stem, _name(stem), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return _write(directory, stem, cert, key), cert, key


def _leaf(directory: Path, stem: str, ca_cert: x509.Certificate, ca_key, server: bool) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(stem, ca_cert.subject, key.public_key()).add_extension(
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
        critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"),
            x509.DNSName("specmesh-internal")]), critical=False)
    return _write(directory, stem, builder.sign(ca_key, hashes.SHA256()), key)


def make_pki(directory: Path) -> Pki:
    ca, ca_cert, ca_key = _ca(directory, "ca")
    foreign, foreign_cert, foreign_key = _ca(directory, "foreign-ca")
    return Pki(ca=ca.cert, server=_leaf(directory, "server", ca_cert, ca_key, server=True),
               client=_leaf(directory, "client", ca_cert, ca_key, server=False), foreign_ca=foreign.cert,
               foreign_client=_leaf(directory, "foreign-client", foreign_cert, foreign_key, server=False))
