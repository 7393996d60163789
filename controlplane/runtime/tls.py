"""The control plane's certificate authority and the server certificates it signs (with `cryptography`).

The CA is made once, on first start, and kept in `data_dir/tls/`: the certificate in the clear
(`ca.pem`, what clients verify servers with) and its private key encrypted with the control
plane's secret box (`ca.key`), like every other secret it keeps at rest.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import ipaddress
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from controlplane.runtime.files import write_atomically
from controlplane.runtime.secretbox import SecretBox

CA_NAME = "controlplane instance CA"
CA_VALIDITY = dt.timedelta(days=3650)
SERVER_VALIDITY = dt.timedelta(days=397)
# A server certificate closer than this to its end is issued again.
RENEW_BEFORE = dt.timedelta(days=30)


@dataclass(frozen=True)
class ServerCertificate:
    """A server's certificate and private key, PEM-encoded (the key unencrypted, for the server)."""

    cert_pem: bytes
    key_pem: bytes


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _unencrypted(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class CertificateAuthority:
    """One CA: its certificate and key; signs server certificates for the hosts they name."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self.key = key

    @classmethod
    def create(cls, now: dt.datetime | None = None) -> CertificateAuthority:
        now = now or _now()
        key = _new_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + CA_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
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
        return cls(cert, key)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue_server(
        self, hosts: Iterable[str], common_name: str, now: dt.datetime | None = None
    ) -> ServerCertificate:
        """A server certificate for `hosts` (DNS names or IP addresses, all in its SAN)."""
        now = now or _now()
        key = _new_key()
        names: list[x509.GeneralName] = []
        for host in dict.fromkeys(hosts):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + SERVER_VALIDITY, self.cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        return ServerCertificate(cert.public_bytes(serialization.Encoding.PEM), _unencrypted(key))

    def signed(self, cert_pem: bytes) -> bool:
        """Whether `cert_pem` was issued by this CA (its signature checks out)."""
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
            cert.verify_directly_issued_by(self.cert)
        except (ValueError, TypeError, InvalidSignature):
            return False
        return True


def needs_new_certificate(
    cert_pem: bytes | None, ca: CertificateAuthority, hosts: Iterable[str], now: dt.datetime | None = None
) -> bool:
    """No certificate yet, or one from another CA, for other hosts, or near its end."""
    if not cert_pem or not ca.signed(cert_pem):
        return True
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return True
    present = {str(v) for v in san.get_values_for_type(x509.IPAddress)} | set(
        san.get_values_for_type(x509.DNSName)
    )
    if not {str(_normal(h)) for h in hosts} <= present:
        return True
    return cert.not_valid_after_utc - (now or _now()) < RENEW_BEFORE


def _normal(host: str) -> object:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return host


class CaStore:
    """The CA in `directory`: `ca.pem` in the clear, `ca.key` sealed with the secret box.

    Made on first use under an exclusive lock, so two processes starting together agree on one.
    """

    def __init__(self, directory: Path, box: SecretBox) -> None:
        self.directory = directory
        self.box = box

    @property
    def cert_path(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def key_path(self) -> Path:
        return self.directory / "ca.key"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o755)  # noqa: S103 (the server user reads ca.pem; ca.key stays 0600)
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def load(self) -> CertificateAuthority:
        """The CA, made (and stored) if there is none yet."""
        if not (self.cert_path.exists() and self.key_path.exists()):
            with self._locked():
                if not (self.cert_path.exists() and self.key_path.exists()):
                    self._save(CertificateAuthority.create())
        cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        key = serialization.load_pem_private_key(self.box.decrypt(self.key_path.read_bytes()).encode(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{self.key_path} does not hold an EC private key")
        return CertificateAuthority(cert, key)

    def _save(self, ca: CertificateAuthority) -> None:
        sealed = self.box.encrypt(_unencrypted(ca.key).decode())
        write_atomically(self.key_path, sealed, 0o600)
        write_atomically(self.cert_path, ca.cert_pem, 0o644)
