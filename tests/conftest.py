"""Test harness: one real PostgreSQL server per run, a migrated template, a fresh database per test;
the group markers (unit, integration, e2e) from the directories."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.runtime.embedded import (
    FAST_SETTINGS,
    OWNER_ROLE,
    RUNTIME_ROLE,
    EmbeddedDatabase,
    ensure_roles,
    open_embedded,
    role_passwords,
)
from controlplane.runtime.settings import Settings
from tests.provisioning_support import QUICK_RETRIES, pg_bindir, real_instances

TEMPLATE = "cp_template"
_counter = itertools.count()
# The test groups: each directory of tests/ is a marker (registered in pyproject.toml).
GROUPS = ("unit", "integration", "e2e")


# A unit test runs in milliseconds: one that hangs fails after this many seconds, not pyproject's
# 300 (which bounds the tests that start servers). Generous, so a slow machine never trips it.
UNIT_TIMEOUT_S = 60


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its group, the directory it lives in (unit tests with a short timeout)."""
    for item in items:
        group = item.path.parent.name
        if group in GROUPS:
            item.add_marker(getattr(pytest.mark, group))
        if group == "unit" and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))


class TestServer:
    """Where test databases are created: the embedded mechanism, or CONTROLPLANE_TEST_ADMIN_URL.

    Databases belong to the owner role (migrations run as it); the product's own pools in tests
    connect as the runtime role, so that a missing grant fails a test. Tests' direct SQL uses the
    admin (superuser) URL."""

    def __init__(self, admin_url: str, embedded: EmbeddedDatabase | None, passwords: dict[str, str]) -> None:
        self.admin_url = admin_url
        self.embedded = embedded
        self.passwords = passwords

    def url_for(self, dbname: str) -> str:
        parts = urlsplit(self.admin_url)
        return urlunsplit(parts._replace(path="/" + dbname))

    def as_role(self, url: str, role: str) -> str:
        """The same database's URL for `role` (the owner or the runtime role)."""
        parts = urlsplit(url)
        netloc = f"{role}:{self.passwords[role]}@{parts.hostname}:{parts.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def execute(self, statement: psycopg.sql.Composed) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(statement)

    def create_database(self, name: str, template: str | None = None, owner: str | None = None) -> str:
        ident = psycopg.sql.Identifier(name)
        owned = (
            psycopg.sql.SQL(" OWNER {}").format(psycopg.sql.Identifier(owner))
            if owner
            else psycopg.sql.SQL("")
        )
        if template:
            self.execute(
                psycopg.sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY FILE_COPY{}").format(
                    ident, psycopg.sql.Identifier(template), owned
                )
            )
        else:
            self.execute(psycopg.sql.SQL("CREATE DATABASE {}{}").format(ident, owned))
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        self.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(psycopg.sql.Identifier(name))
        )


@pytest.fixture(scope="session")
def pg_root() -> Iterator[Path]:
    """The session's scratch directory (its PostgreSQL, the local instances' servers and archive),
    removed once the session's servers are stopped: a session leaves no gigabytes behind."""
    root = Path(tempfile.mkdtemp(prefix="cp-test-"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def test_server(pg_root: Path) -> Iterator[TestServer]:
    passwords = role_passwords(pg_root)
    external = os.environ.get("CONTROLPLANE_TEST_ADMIN_URL")
    if external:
        ensure_roles(external, passwords)
        yield TestServer(external, None, passwords)
        return
    embedded = open_embedded(pg_root / "db", FAST_SETTINGS, bindir=pg_bindir())
    try:
        ensure_roles(embedded.admin_url, passwords)
        yield TestServer(embedded.admin_url, embedded, passwords)
    finally:
        embedded.stop()


@pytest.fixture(scope="session")
def template_url(test_server: TestServer) -> str:
    """The migrated template (admin URL): migrated as the owner, with the runtime role's grants."""
    name = f"{TEMPLATE}_{os.getpid()}"
    test_server.drop_database(name)
    url = test_server.create_database(name, owner=OWNER_ROLE)
    db.migrate(test_server.as_role(url, OWNER_ROLE), runtime_role=RUNTIME_ROLE)
    return url


@pytest.fixture
def fresh_database(test_server: TestServer, template_url: str) -> Iterator[str]:
    """A database cloned from the migrated template, dropped after the test (its admin URL)."""
    template = urlsplit(template_url).path.lstrip("/")
    name = f"cp_test_{os.getpid()}_{next(_counter)}"
    url = test_server.create_database(name, template=str(template), owner=OWNER_ROLE)
    try:
        yield url
    finally:
        test_server.drop_database(name)


@pytest.fixture
def runtime_url(test_server: TestServer, fresh_database: str) -> str:
    """The fresh database as the runtime role: what the product's services connect as."""
    return test_server.as_role(fresh_database, RUNTIME_ROLE)


@pytest.fixture
def owner_url(test_server: TestServer, fresh_database: str) -> str:
    """The fresh database as the role that owns its tables (and runs migrations)."""
    return test_server.as_role(fresh_database, OWNER_ROLE)


@pytest.fixture
def empty_database(test_server: TestServer) -> Iterator[str]:
    """A database with no schema at all (for migration tests)."""
    name = f"cp_empty_{os.getpid()}_{next(_counter)}"
    url = test_server.create_database(name)
    try:
        yield url
    finally:
        test_server.drop_database(name)


@pytest.fixture
def settings(runtime_url: str, owner_url: str, tmp_path: Path) -> Settings:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    os.chmod(tmp_path, 0o755)
    # No rate limit: how many requests fit in a window depends on the machine, and a test that is
    # not about limits must not meet one (those that are configure theirs, on an injected clock:
    # docs/operations.md, "Time and rates in tests").
    return Settings(
        database_url=runtime_url,
        migration_database_url=owner_url,
        data_dir=data_dir,
        heartbeat_interval_s=0.2,
        pg_bindir=pg_bindir(),
        api_rate_limit=0,
        api_webhook_rate_limit=0,
        console_sign_in_limit=0,
    )


@pytest.fixture
def local_settings(pg_root: Path, runtime_url: str) -> Iterator[Settings]:
    """Settings for real instance servers with quick retries; the servers are stopped after the test."""
    # WAL segments closed within a second of a write: what the archive holds catches up at once.
    with real_instances(
        pg_root, runtime_url, **QUICK_RETRIES, shutdown_grace_s=0.5, local_archive_timeout_s=1
    ) as settings:
        yield settings


@pytest.fixture
async def conn(fresh_database: str) -> AsyncIterator[AsyncConn]:
    connection = await db.connect(fresh_database)
    async with connection:
        yield connection
