"""The URI the CLI prints names the CA file it saved, in place of the bare file name of the API's;
the connection details round trip as recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest

from controlplane.cli.client import Api, connection_uri
from controlplane.cli.render import show_instance
from provisioners.base import ConnectionInfo

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


QUERY = "sslmode=verify-full&sslrootcert=controlplane-ca.pem"


def pooled_instance(**more: object) -> dict[str, object]:
    """An HA instance's document as the API gives it: pooled, with its direct address (and `more`)."""
    connection = {
        "sslmode": "verify-full",
        "ca_certificate": PEM,
        "uri": f"postgresql://app:secret@db:6432/app?{QUERY}",
        "pool_mode": "transaction",
        "direct": {"uri": f"postgresql://app:secret@db:5432/app?{QUERY}"},
    }
    return {"name": "orders", "connection": {**connection, **more}}


def test_a_pooled_instance_shows_its_direct_uri_with_the_saved_ca_file_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "ca.pem"
    monkeypatch.setenv("CONTROLPLANE_CA_FILE", str(saved))
    instance = pooled_instance()
    show_instance(instance, "table", cast(Api, object()))
    out = capsys.readouterr().out
    assert f"db:5432/app?sslmode=verify-full&sslrootcert={saved}" in out
    assert f"db:6432/app?sslmode=verify-full&sslrootcert={saved}" in out
    assert "secret" not in out and "controlplane-ca.pem" not in out


def test_an_ha_instance_shows_its_read_only_uri_with_the_saved_ca_file_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "ca.pem"
    monkeypatch.setenv("CONTROLPLANE_CA_FILE", str(saved))
    instance = pooled_instance(
        read_only={
            "host": "db",
            "port": 6432,
            "dbname": "app_readonly",
            "uri": f"postgresql://app:secret@db:6432/app_readonly?{QUERY}",
        }
    )
    show_instance(instance, "table", cast(Api, object()))
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("read_only_uri"))
    assert f"app:****@db:6432/app_readonly?sslmode=verify-full&sslrootcert={saved}" in row
    assert "secret" not in out and "controlplane-ca.pem" not in out


def test_a_one_server_instance_shows_no_read_only_uri(capsys: pytest.CaptureFixture[str]) -> None:
    connection = {"sslmode": None, "uri": "postgresql://app@db:5432/app", "read_only": None}
    show_instance({"name": "orders", "connection": connection}, "table")
    out = capsys.readouterr().out
    assert "read_only_uri" not in out and "direct_uri" not in out


def test_the_read_only_endpoint_round_trips_through_the_recorded_details() -> None:
    info = ConnectionInfo(
        "db",
        6432,
        "app",
        "app_owner",
        "pw",
        sslmode="verify-full",
        pool_mode="transaction",
        direct=("db", 5432),
        read_only=("db", 6432, "app_readonly"),
    )
    shown = info.public()
    assert shown["read_only"] == {"host": "db", "port": 6432, "dbname": "app_readonly"}
    assert "pw" not in str(shown)
    assert ConnectionInfo.from_public(json.loads(json.dumps(shown)), "pw") == info
    # A one-server plan's details carry none (and never did, for what was recorded before it).
    single = ConnectionInfo("db", 5432, "app", "app_owner", "pw")
    assert "read_only" not in single.public()
    assert ConnectionInfo.from_public(single.public(), "pw").read_only is None
