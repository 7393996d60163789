"""Alembic environment: migrates the database named by the caller (never one built at import)."""

from __future__ import annotations

import re

from sqlalchemy import create_engine, pool, text
from sqlalchemy.dialects.postgresql.base import PGDialect

from alembic import context
from controlplane.db.connection import sqlalchemy_url
from controlplane.db.schema import XID8, metadata

config = context.config

# Held for the migration's transaction so that two hosts migrating at once run one after the other.
MIGRATION_LOCK_KEY = 0x63706D6967

# The event tables' monthly partitions are made by cp_ensure_event_partitions, not described by
# the metadata: comparing the schema leaves them out.
PARTITION = re.compile(r"^(instance|job)_events_y\d{4}m\d{2}$")


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    return not (type_ == "table" and name is not None and PARTITION.match(name))


def run_migrations_online() -> None:
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL given to the migration (use `controlplane migrate`)")
    engine = create_engine(sqlalchemy_url(url), poolclass=pool.NullPool)
    # Reflection names the columns of PostgreSQL's xid8 type (this engine's dialect only).
    dialect = engine.dialect
    assert isinstance(dialect, PGDialect), "the control plane's database is PostgreSQL"
    dialect.ischema_names = {**dialect.ischema_names, "xid8": XID8}
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=metadata,
            compare_type=True,
            include_name=include_name,
        )
        with context.begin_transaction():
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            context.run_migrations()
    engine.dispose()


run_migrations_online()
