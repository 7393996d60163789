"""TLS: the control plane's CA and each instance server's certificate, issued by it.

The CA is made on first use; a server's certificate names the hosts clients reach the servers by.
"""

from __future__ import annotations

from pathlib import Path

from controlplane.runtime.files import write_atomically
from controlplane.runtime.postgres import PostgresServer
from controlplane.runtime.tls import CaStore, CertificateAuthority, needs_new_certificate
from provisioners.local.storage import Storage

# What clients are told to check: the server's certificate, against the control plane's CA.
SSLMODE = "verify-full"
# The certificate and key are server.crt and server.key in the data directory (the defaults).
SERVER_CERT = "server.crt"
SERVER_KEY = "server.key"


class InstanceTls:
    """The CA kept in `directory` (its key sealed with the storage's key), and the servers'
    certificates for `names`, owned by the server user."""

    def __init__(self, directory: Path, storage: Storage, names: list[str]) -> None:
        self.directory = directory
        self.storage = storage
        self.names = names
        self._ca: CertificateAuthority | None = None

    @property
    def store(self) -> CaStore:
        return CaStore(self.directory, self.storage.box)

    def authority(self) -> CertificateAuthority:
        """The control plane's CA (made on first use), which signs every instance's certificate."""
        if self._ca is None:
            self._ca = self.store.load()
        return self._ca

    def ensure(self, server: PostgresServer) -> bool:
        """The server's certificate from the control plane's CA, for its hosts; True when (re)issued."""
        cert_path = server.datadir / SERVER_CERT
        current = cert_path.read_bytes() if cert_path.exists() else None
        ca = self.authority()
        if not needs_new_certificate(current, ca, self.names):
            return False
        issued = ca.issue_server(self.names, common_name=server.datadir.parent.name)
        key_path = server.datadir / SERVER_KEY
        write_atomically(key_path, issued.key_pem, 0o600)
        write_atomically(cert_path, issued.cert_pem, 0o644)
        self.storage.chown(key_path)
        self.storage.chown(cert_path)
        return True
