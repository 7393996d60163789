"""The URI the CLI prints names the CA file it saved, in place of the bare file name of the API's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from controlplane.cli.client import Api, connection_uri
from controlplane.cli.render import show_instance

pytestmark = pytest.mark.unit

PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def test_the_saved_ca_file_replaces_the_file_name_of_the_api_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = tmp_path / "my ca.pem"
    monkeypatch.setenv("CONTROLPLANE_CA_FILE", str(saved))
    connection: dict[str, Any] = {
        "sslmode": "verify-full",
        "ca_certificate": PEM,
        "uri": "postgresql://app@db:5432/app?sslmode=verify-full&sslrootcert=controlplane-ca.pem",
    }
    uri = connection_uri(cast(Api, None), connection)  # the instance's own CA: the API is not asked
    assert uri == f"postgresql://app@db:5432/app?sslmode=verify-full&sslrootcert={tmp_path}/my%20ca.pem"
    assert saved.read_text() == PEM


def test_an_unverified_uri_is_printed_as_the_api_gives_it() -> None:
    connection = {"sslmode": None, "uri": "postgresql://app@db:5432/app"}
    assert connection_uri(cast(Api, None), connection) == "postgresql://app@db:5432/app"


def test_a_pooled_instance_shows_its_direct_uri_with_the_saved_ca_file_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "ca.pem"
    monkeypatch.setenv("CONTROLPLANE_CA_FILE", str(saved))
    query = "sslmode=verify-full&sslrootcert=controlplane-ca.pem"
    instance = {
        "name": "orders",
        "connection": {
            "sslmode": "verify-full",
            "ca_certificate": PEM,
            "uri": f"postgresql://app:secret@db:6432/app?{query}",
            "pool_mode": "transaction",
            "direct": {"uri": f"postgresql://app:secret@db:5432/app?{query}"},
        },
    }
    show_instance(instance, "table", cast(Api, object()))
    out = capsys.readouterr().out
    assert f"db:5432/app?sslmode=verify-full&sslrootcert={saved}" in out
    assert f"db:6432/app?sslmode=verify-full&sslrootcert={saved}" in out
    assert "secret" not in out and "controlplane-ca.pem" not in out
