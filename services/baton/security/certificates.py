"""A private CA and role certificates for baton's internal mTLS (``baton.security.mtls``).

``baton up`` makes a short-lived CA at start and one certificate per role in its own
directory, so the local service is mTLS like a deployed one; the tests make theirs the
same way (another CA, an expired certificate). A cluster gets its certificates from a
Secret or cert-manager instead (docs/operations.md).

Certificates: EC P-256, common name ``baton-<role>``, DNS name ``baton.internal`` (the name
every channel checks, ``baton.security.mtls.INTERNAL_SERVER_NAME``), valid for client and server
authentication.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from baton.config import MtlsConfig
from baton.security.mtls import INTERNAL_SERVER_NAME, ROLE_PREFIX


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    @classmethod
    def create(cls, name: str = "baton local CA", days: float = 1.0) -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        certificate = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                       .public_key(key.public_key()).serial_number(x509.random_serial_number())
                       .not_valid_before(now - datetime.timedelta(minutes=5))
                       .not_valid_after(now + datetime.timedelta(days=days))
                       .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                       .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                                    crl_sign=True, content_commitment=False,
                                                    key_encipherment=False, data_encipherment=False,
                                                    key_agreement=False, encipher_only=False,
                                                    decipher_only=False), critical=True)
                       .sign(key, hashes.SHA256()))
        return cls(key, certificate)

    def issue(self, role: str, days: float = 1.0, expired: bool = False) -> tuple[bytes, bytes]:
        """(key PEM, certificate PEM) for ``role``; ``expired`` makes one that ended yesterday."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
        if expired:
            start, end = now - datetime.timedelta(days=2), now - datetime.timedelta(days=1)
        certificate = (x509.CertificateBuilder()
                       .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                   ROLE_PREFIX + role)]))
                       .issuer_name(self.certificate.subject).public_key(key.public_key())
                       .serial_number(x509.random_serial_number())
                       .not_valid_before(start).not_valid_after(end)
                       .add_extension(x509.SubjectAlternativeName(
                           [x509.DNSName(INTERNAL_SERVER_NAME)]), critical=False)
                       .add_extension(x509.ExtendedKeyUsage(
                           [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
                       .sign(self.key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return key_pem, certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def write(self, directory: Path, role: str, days: float = 1.0, expired: bool = False) -> MtlsConfig:
        """The CA and a ``role`` certificate as files under ``directory`` (keys readable by
        their owner only); the settings that name them."""
        directory.mkdir(parents=True, exist_ok=True)
        ca_path = directory / "ca.crt"
        ca_path.write_bytes(self.pem)
        key_pem, cert_pem = self.issue(role, days, expired)
        key_path, cert_path = directory / f"{role}.key", directory / f"{role}.crt"
        key_path.touch(mode=0o600)
        key_path.write_bytes(key_pem)
        cert_path.write_bytes(cert_pem)
        return MtlsConfig(ca=str(ca_path), cert=str(cert_path), key=str(key_path))
