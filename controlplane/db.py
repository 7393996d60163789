"""Database access: the URL to use, migrations, and the connection pools of the services."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
from psycopg import pq
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool

from controlplane.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parent.parent
ALEMBIC_INI = ROOT / "alembic.ini"

AsyncConn = psycopg.AsyncConnection[DictRow]


def sqlalchemy_url(url: str) -> str:
    """The same URL, naming the psycopg 3 driver for SQLAlchemy."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise SettingsError(f"not a PostgreSQL URL: {url.split('@')[-1]!r} (expected postgresql://...)")


def libpq_url(url: str) -> str:
    """The same URL in the form libpq accepts."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def alembic_config(url: str) -> object:
    from alembic.config import Config

    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(ROOT / "alembic"))
    config.attributes["database_url"] = url
    return config


def migrate(url: str, revision: str = "head") -> None:
    from alembic.config import Config

    from alembic import command

    config = alembic_config(url)
    assert isinstance(config, Config)
    command.upgrade(config, revision)


def head_revision() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = alembic_config("postgresql://unused")
    assert isinstance(config, Config)
    head = ScriptDirectory.from_config(config).get_current_head()
    assert head is not None
    return head


def resolve_database_url(settings: Settings) -> str:
    """The configured URL, or the embedded server's (started, and its database created)."""
    if settings.database.url_value:
        return libpq_url(settings.database.url_value)
    from controlplane.embedded import open_embedded

    return open_embedded(settings.data_dir / "db", bindir=settings.database.pg_bindir).create_database()


@contextlib.asynccontextmanager
async def transaction(conn: AsyncConn) -> AsyncIterator[None]:
    """The caller's transaction when one is open (a use case inside the API's idempotent request
    joins it: no savepoint, no extra round trips), else a transaction of its own."""
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        yield
        return
    async with conn.transaction():
        yield


async def connect(url: str, *, autocommit: bool = True) -> AsyncConn:
    return await psycopg.AsyncConnection.connect(url, autocommit=autocommit, row_factory=dict_row)


def pool(
    url: str, *, min_size: int = 1, max_size: int = 10, name: str = "controlplane"
) -> AsyncConnectionPool[AsyncConn]:
    """An async pool of autocommit connections returning rows as dicts (open it before use).

    Connections are not checked on every checkout (that costs a round trip per use): one broken
    by a server restart fails its user once (the API answers 503) and is discarded when returned.
    """

    async def configure(conn: AsyncConn) -> None:
        await conn.set_autocommit(True)

    return AsyncConnectionPool(
        libpq_url(url),
        min_size=min_size,
        max_size=max_size,
        kwargs={"row_factory": dict_row},
        configure=configure,
        open=False,
        name=name,
    )
