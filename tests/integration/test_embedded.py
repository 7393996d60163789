"""The embedded PostgreSQL: started in a directory it owns, stopped cleanly, reused on the next start."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from controlplane.db import connection as db
from controlplane.runtime.embedded import FAST_SETTINGS, OWNER_ROLE, RUNTIME_ROLE, open_embedded
from controlplane.runtime.postgres import find_bindir, port_in_use
from controlplane.runtime.settings import Settings, SettingsError, load


def owner_uid(pid: int) -> int:
    return os.stat(f"/proc/{pid}").st_uid


def test_embedded_server_starts_stops_and_is_reused(pg_root: Path) -> None:
    data_dir = pg_root / "embedded-reuse"
    data_dir.mkdir()
    os.chmod(data_dir, 0o755)
    root = data_dir / "db"

    first = open_embedded(root, FAST_SETTINGS)
    try:
        assert (root / "pg" / "PG_VERSION").exists()
        assert oct((root / "embedded.json").stat().st_mode & 0o777) == "0o600"
        state = json.loads((root / "embedded.json").read_text())
        assert state["port"] == first.server.port
        pid = first.server.pid()
        assert pid is not None
        if os.geteuid() == 0:
            assert owner_uid(pid) != 0, "PostgreSQL must run as a non-root user"
        else:
            assert owner_uid(pid) == os.geteuid()

        url = first.create_database()
        assert first.create_database() == url  # idempotent
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE survivor (note text)")
            conn.execute("INSERT INTO survivor VALUES ('written before the stop')")
    finally:
        first.stop()
    assert not first.server.is_running()
    assert not port_in_use(first.server.port)

    # With no database URL configured, a client command uses the running server under
    # data_dir/db, and never starts it: stopped, it says so in one line.
    settings = Settings(database_url=None, data_dir=data_dir)
    with pytest.raises(SettingsError, match="is not running: start `controlplane up`"):
        db.resolve_database_url(settings)
    assert not first.server.is_running()
    second = open_embedded(root)
    try:
        # Running, as its runtime role; the database made before the roles existed is handed over
        # to the owner role.
        reopened_url = db.resolve_database_url(settings)
        assert second.server.port == first.server.port and second.password == first.password
        assert conninfo_to_dict(reopened_url)["user"] == RUNTIME_ROLE
        assert oct((root / "roles.json").stat().st_mode & 0o777) == "0o600"
        target = db.migration_target(settings)
        assert conninfo_to_dict(target.url)["user"] == OWNER_ROLE and target.runtime_role == RUNTIME_ROLE
        db.migrate(target.url, runtime_role=target.runtime_role)
        with psycopg.connect(url) as admin:
            owners = admin.execute(
                "SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class"
                " WHERE relnamespace = 'public'::regnamespace AND relkind IN ('r', 'p', 'S')"
            ).fetchall()
        assert owners == [(OWNER_ROLE,)]
        with psycopg.connect(reopened_url) as conn:
            assert conn.execute("SELECT note FROM survivor").fetchall() == [("written before the stop",)]
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="must be owner"):
                conn.execute("ALTER TABLE instance_events DISABLE TRIGGER instance_events_append_only")
    finally:
        second.stop()
    assert not second.server.is_running()


def test_data_dir_defaults_to_dot_controlplane() -> None:
    assert load({}).data_dir == Path(".controlplane")
    assert load({}).database.url_value is None
    assert load({"CONTROLPLANE_DATA_DIR": "/srv/cp"}).data_dir == Path("/srv/cp")
    assert load({"CONTROLPLANE_DATABASE_URL": "postgresql://h/db"}).database.url_value == "postgresql://h/db"


def test_server_binaries_are_found() -> None:
    bindir = find_bindir()
    for tool in ("initdb", "postgres", "pg_ctl"):
        assert (bindir / tool).exists()


def test_configured_url_skips_the_embedded_server(tmp_path: Path) -> None:
    url = "postgresql+psycopg://user:pw@db.example:5432/cp"
    assert db.resolve_database_url(Settings(database_url=url, data_dir=tmp_path)) == (
        "postgresql://user:pw@db.example:5432/cp"
    )
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize("bad", ["mysql://h/db", "sqlite:///x"])
def test_only_postgres_urls_are_accepted(bad: str) -> None:
    with pytest.raises(ValueError, match="not a PostgreSQL URL"):
        db.sqlalchemy_url(bad)


def test_pools_retry_at_least_every_second_and_never_give_up() -> None:
    """psycopg_pool's own backoff doubles without bound and gives up after 300 s; ours does neither."""
    pool = db.pool("postgresql://nobody@127.0.0.1:1/none")
    assert pool.reconnect_timeout == float("inf")
    attempt = db._CappedBackoff(timeout=pool.reconnect_timeout)
    now = 0.0
    for _ in range(40):  # forty failed attempts in a row: over half a minute of outage
        attempt.update_delay(now)
        assert attempt.delay <= db.RECONNECT_MAX_DELAY_S
        now += attempt.delay
        assert not attempt.time_to_give_up(now)
    assert now > 30
