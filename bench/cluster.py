"""The one scratch PostgreSQL cluster of a bench run: durable settings, a database per measured run."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from controlplane.runtime.embedded import SERVER_SETTINGS
from controlplane.runtime.postgres import PostgresServer, free_port, make_owned_dir, server_user, url

SUPERUSER = "bench"

# Durable on purpose: the physical limit is a real commit, flushed to disk.
BENCH_SETTINGS = {
    **SERVER_SETTINGS,
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "max_connections": "300",
}

# With --profile: the server's own view of each statement (calls, time, rows, buffers), nested
# statements (those of the product's functions) included.
STATEMENT_STATS_SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.max": "5000",
}

# What the results record about the server.
RECORDED_SETTINGS = (
    "server_version",
    "fsync",
    "synchronous_commit",
    "full_page_writes",
    "wal_sync_method",
    "wal_level",
    "commit_delay",
    "shared_buffers",
    "max_wal_size",
    "checkpoint_timeout",
    "max_connections",
    "work_mem",
)


@dataclass
class Cluster:
    """A PostgreSQL 15 server in a temporary directory, removed when stopped."""

    root: Path
    server: PostgresServer
    password: str
    databases: set[str] = field(default_factory=set)

    @classmethod
    def start(cls, statement_stats: bool = False) -> Cluster:
        root = Path(tempfile.mkdtemp(prefix="cp-bench-"))
        os.chmod(root, 0o755)  # the server user must traverse it
        run_as = server_user()
        server = PostgresServer(datadir=root / "pg", port=free_port(), run_as=run_as)
        cluster = cls(root, server, secrets.token_urlsafe(24))
        try:
            make_owned_dir(root / "pg", run_as)
            settings = {**BENCH_SETTINGS, **(STATEMENT_STATS_SETTINGS if statement_stats else {})}
            server.initdb(SUPERUSER, cluster.password, settings)
            server.start()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def url(self, dbname: str = "postgres") -> str:
        return url(SUPERUSER, self.password, self.server.host, self.server.port, dbname)

    @property
    def env(self) -> dict[str, str]:
        """libpq variables for tools (pgbench, psql, the peers' own commands)."""
        return {
            "PGHOST": self.server.host,
            "PGPORT": str(self.server.port),
            "PGUSER": SUPERUSER,
            "PGPASSWORD": self.password,
        }

    def execute(self, statement: str | sql.Composed, dbname: str = "postgres") -> None:
        with psycopg.connect(self.url(dbname), autocommit=True) as conn:
            conn.execute(statement)

    def create_database(self, name: str, template: str | None = None) -> str:
        self.drop_database(name)
        ident = sql.Identifier(name)
        if template:
            statement = sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY FILE_COPY").format(
                ident, sql.Identifier(template)
            )
        else:
            statement = sql.SQL("CREATE DATABASE {}").format(ident)
        self.execute(statement)
        self.databases.add(name)
        return self.url(name)

    def drop_database(self, name: str) -> None:
        self.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        self.databases.discard(name)

    def checkpoint(self) -> None:
        """Start a measured run from a clean WAL state, the same for every variant."""
        self.execute("CHECKPOINT")

    def settings(self) -> dict[str, str]:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            recorded = {
                name: str(conn.execute("SELECT current_setting(%s)", (name,)).fetchone()[0])  # type: ignore[index]
                for name in RECORDED_SETTINGS
            }
            version = conn.execute("SELECT version()").fetchone()
        recorded["version"] = str(version[0]) if version else "?"
        return recorded

    def stop(self) -> None:
        try:
            self.server.stop(mode="immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def with_dbname(database_url: str, dbname: str) -> str:
    parts = urlsplit(database_url)
    return urlunsplit(parts._replace(path="/" + dbname))
