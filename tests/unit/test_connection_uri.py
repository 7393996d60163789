"""The URI the CLI prints names the CA file it saved, in place of the bare file name of the API's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from controlplane.cli.client import Api, connection_uri

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
