"""TLS for the local provisioner's servers: a control-plane CA made with `cryptography` (its key kept
encrypted), a certificate per instance naming its host, verify-full works, plain text is refused."""

from __future__ import annotations

import datetime as dt
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from cryptography import x509

from controlplane.api.app import create_app
from controlplane.runtime.settings import Settings
from controlplane.runtime.tls import CertificateAuthority, needs_new_certificate
from provisioners.base import InstanceSpec
from provisioners.local import SERVER_CERT, LocalProvisioner
from tests.provisioning_support import real_instances

DEV = InstanceSpec("dev", 1)


@pytest.fixture
def local(pg_root: Path) -> Iterator[LocalProvisioner]:
    with real_instances(pg_root) as settings:
        yield LocalProvisioner(settings)


def dial(host: str, port: int, user: str, password: str, **tls: str) -> psycopg.Connection[Any]:
    options = " ".join(f"{key}={value}" for key, value in tls.items())
    return psycopg.connect(
        options, host=host, port=port, user=user, password=password, dbname="app", connect_timeout=5
    )


async def test_an_instance_speaks_only_tls_with_a_certificate_from_the_control_plane_ca(
    local: LocalProvisioner, tmp_path: Path
) -> None:
    iid = uuid.uuid4()
    await local.allocate_storage(iid, DEV, 1)
    await local.configure_network(iid, DEV, 1)
    info = await local.initialize_database(iid, DEV, 1)
    assert info.sslmode == "verify-full" and info.public()["sslmode"] == "verify-full"

    # The CA: its certificate published, its key on disk only encrypted with the secret box.
    ca_pem = await local.ca_certificate()
    assert ca_pem is not None and ca_pem.encode() == local.ca_store.cert_path.read_bytes()
    sealed = local.ca_store.key_path.read_bytes()
    assert b"PRIVATE KEY" not in sealed and "PRIVATE KEY" in local.box.decrypt(sealed)
    assert local.ca_store.key_path.stat().st_mode & 0o777 == 0o600
    ca = x509.load_pem_x509_certificate(ca_pem.encode())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca

    # The server's certificate is the CA's, for the host the customer is given.
    cert = x509.load_pem_x509_certificate((local.datadir(iid) / SERVER_CERT).read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert info.host in {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} | set(
        san.get_values_for_type(x509.DNSName)
    )

    # verify-full against the CA: connected, and the session is encrypted.
    root = str(local.ca_store.cert_path)
    with dial(
        info.host, info.port, info.user, info.password, sslmode="verify-full", sslrootcert=root
    ) as conn:
        row = conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
        assert row == (True,)

    # Plain text is refused by the server, with the right password.
    with pytest.raises(psycopg.OperationalError, match="no encryption"):
        dial(info.host, info.port, info.user, info.password, sslmode="disable")

    # A CA the client was not given does not vouch for the server.
    stranger = tmp_path / "other-ca.pem"
    stranger.write_bytes(CertificateAuthority.create().cert_pem)
    with pytest.raises(psycopg.OperationalError, match="certificate verify failed"):
        dial(info.host, info.port, info.user, info.password, sslmode="verify-full", sslrootcert=str(stranger))

    # The same CA is used by a second provisioner over the same data directory (made only once).
    again = LocalProvisioner(local.settings)
    assert await again.ca_certificate() == ca_pem
    assert sorted(os.listdir(local.ca_store.directory)) == [".lock", "ca.key", "ca.pem"]


def test_a_server_certificate_is_issued_again_for_other_hosts_another_ca_or_near_its_end() -> None:
    now = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    ca = CertificateAuthority.create(now)
    issued = ca.issue_server(["127.0.0.1", "db.example"], "inst", now)
    assert not needs_new_certificate(issued.cert_pem, ca, ["db.example", "127.0.0.1"], now)
    assert needs_new_certificate(None, ca, ["127.0.0.1"], now)
    assert needs_new_certificate(issued.cert_pem, ca, ["10.0.0.7"], now)
    assert needs_new_certificate(issued.cert_pem, CertificateAuthority.create(now), ["127.0.0.1"], now)
    assert needs_new_certificate(issued.cert_pem, ca, ["127.0.0.1"], now + dt.timedelta(days=380))
    assert not needs_new_certificate(issued.cert_pem, ca, ["127.0.0.1"], now + dt.timedelta(days=300))


async def test_the_api_publishes_the_ca_without_a_key(local_settings: Settings, tmp_path: Path) -> None:
    application = create_app(local_settings)
    async with application.router.lifespan_context(application):
        transport = httpx.ASGITransport(app=application, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            served = await http.get("/v1/ca.pem")  # no key needed: a certificate is public
    assert served.status_code == 200 and served.headers["content-type"] == "application/x-pem-file"
    local = LocalProvisioner(local_settings)
    assert served.text == await local.ca_certificate()
    assert served.text.encode() == local.ca_store.cert_path.read_bytes()
