"""The embedded database: the control plane's own PostgreSQL, in a data directory it owns."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from controlplane.postgres import PostgresError, PostgresServer, free_port, make_owned_dir, server_user, url
from controlplane.settings import NotAvailable

log = logging.getLogger(__name__)

SUPERUSER = "controlplane"
DBNAME = "controlplane"

# Durable by default: the control plane's own state must survive a crash.
SERVER_SETTINGS = {
    "max_connections": "200",
    "shared_buffers": "128MB",
    "log_min_messages": "warning",
    "log_line_prefix": "%m [%p] ",
}

# Throwaway clusters (tests, benchmarks of the product's logic) may trade durability for speed.
FAST_SETTINGS = {**SERVER_SETTINGS, "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


@dataclass
class EmbeddedDatabase:
    """The control plane's own server: data in `root/pg`, its port and password in `root/embedded.json`."""

    root: Path
    server: PostgresServer
    password: str
    # Whether this process started the server (False: it was already running and is shared).
    started_here: bool = False

    @property
    def admin_url(self) -> str:
        return url(SUPERUSER, self.password, self.server.host, self.server.port, "postgres")

    def database_url(self, dbname: str = DBNAME) -> str:
        return url(SUPERUSER, self.password, self.server.host, self.server.port, dbname)

    def create_database(self, dbname: str = DBNAME, template: str | None = None) -> str:
        """Create `dbname` unless it exists; return its URL."""
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone()
            if not exists:
                ident = psycopg.sql.Identifier(dbname)
                if template:
                    conn.execute(
                        psycopg.sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY FILE_COPY").format(
                            ident, psycopg.sql.Identifier(template)
                        )
                    )
                else:
                    conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(ident))
        return self.database_url(dbname)

    def stop(self) -> None:
        self.server.stop()


def open_embedded(
    root: Path, settings: dict[str, str] | None = None, *, bindir: Path | None = None
) -> EmbeddedDatabase:
    """Initialise (first time) and start the server under `root`; reuse it on later calls.

    `bindir` is where to look for the server binaries first (CONTROLPLANE_PG_BINDIR).
    """
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    run_as = server_user()
    if run_as.is_switch:
        os.chmod(root, 0o711)  # noqa: S103 (the server user must traverse it)
    state_file = root / "embedded.json"
    if state_file.exists():
        state = json.loads(state_file.read_text())
    else:
        state = {"port": free_port(), "password": secrets.token_urlsafe(32)}
        state_file.write_text(json.dumps(state))
        os.chmod(state_file, 0o600)
    server = PostgresServer(
        datadir=root / "pg", port=int(state["port"]), run_as=run_as, preferred_bindir=bindir
    )
    if not server.initialised:
        make_owned_dir(root / "pg", run_as)
        server.initdb(SUPERUSER, state["password"], settings or SERVER_SETTINGS)
    already_running = server.is_running()
    server.start()
    return EmbeddedDatabase(
        root=root, server=server, password=state["password"], started_here=not already_running
    )


def running_embedded(root: Path) -> EmbeddedDatabase:
    """The embedded server a running `up` keeps under `root` (found from its embedded.json), never
    started here: NotAvailable, in one line saying what to do, when there is none or it is down."""
    root = root.resolve()
    state_file = root / "embedded.json"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        raise NotAvailable(
            f"no database to use: set CONTROLPLANE_DATABASE_URL (or --database-url), or point "
            f"--data-dir at the data directory of a running `controlplane up` (none in {root.parent})"
        ) from None
    server = PostgresServer(datadir=root / "pg", port=int(state["port"]))
    if not server.is_running():
        raise NotAvailable(
            f"the embedded PostgreSQL in {root} is not running: start `controlplane up` "
            "(or set CONTROLPLANE_DATABASE_URL)"
        )
    return EmbeddedDatabase(root=root, server=server, password=state["password"])


async def keep_running(database: EmbeddedDatabase, stop: asyncio.Event, *, interval_s: float = 0.5) -> None:
    """Until `stop`: whenever the server is found dead (kill -9, a crash), start it again.

    PostgreSQL's crash recovery replays the WAL; the pools reconnect by themselves.
    """
    down_since: float | None = None
    while not stop.is_set():
        if not database.server.is_running():
            if down_since is None:
                down_since = time.monotonic()
                log.error("embedded PostgreSQL (port %d) is not running; restarting it", database.server.port)
            try:
                await asyncio.to_thread(database.server.start, 30)
            except PostgresError as exc:
                log.warning("embedded PostgreSQL did not start yet: %s", " ".join(str(exc).split())[:300])
            else:
                log.warning(
                    "embedded PostgreSQL is back (pid %s) after %.1fs",
                    database.server.pid(),
                    time.monotonic() - down_since,
                )
                down_since = None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
