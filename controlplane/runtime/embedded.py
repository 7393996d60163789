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

from controlplane.runtime.postgres import (
    PostgresError,
    PostgresServer,
    free_port,
    make_owned_dir,
    server_user,
    url,
)
from controlplane.runtime.settings import NotAvailable

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
            async with asyncio.timeout(interval_s):
                await stop.wait()


# The two roles of the control plane's database: the owner runs migrations; the runtime role
# (API, worker, reconciler) owns nothing and may only add to the audit log (docs/deployment.md).
OWNER_ROLE = "controlplane_owner"
RUNTIME_ROLE = "controlplane_app"


@dataclass(frozen=True)
class DatabaseRoles:
    owner_url: str
    runtime_url: str
    runtime_role: str = RUNTIME_ROLE


def role_passwords(root: Path) -> dict[str, str]:
    """The roles' generated passwords, kept in `root/roles.json` (mode 0600), made the first time."""
    path = root / "roles.json"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(
                {OWNER_ROLE: secrets.token_urlsafe(32), RUNTIME_ROLE: secrets.token_urlsafe(32)}, handle
            )
    passwords: dict[str, str] = json.loads(path.read_text())
    return passwords


def ensure_roles(admin_url: str, passwords: dict[str, str]) -> None:
    """Create the owner and runtime roles (login, no other attribute), or reset their passwords."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        for role, password in passwords.items():
            ident = psycopg.sql.Identifier(role)
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            verb = "ALTER" if exists else "CREATE"
            conn.execute(
                psycopg.sql.SQL(
                    verb + " ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD {}"
                ).format(ident, psycopg.sql.Literal(password))
            )


def hand_over(admin_url: str, database_url: str, owner: str) -> None:
    """Make `owner` own the database and everything in its public schema (a database made before
    the roles existed was owned by the superuser)."""
    dbname = psycopg.conninfo.conninfo_to_dict(database_url)["dbname"]
    role = psycopg.sql.Identifier(owner)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("ALTER DATABASE {} OWNER TO {}").format(psycopg.sql.Identifier(str(dbname)), role)
        )
    with psycopg.connect(database_url, autocommit=True) as conn:
        foreign = conn.execute(
            "SELECT CASE c.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW' ELSE 'TABLE' END, c.relname"
            " FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace"
            " AND c.relkind IN ('r', 'p', 'S', 'v') AND c.relowner <> %s::regrole"
            # A sequence owned by a column follows its table.
            " AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass"
            " AND d.objid = c.oid AND d.deptype = 'a')"
            " UNION ALL SELECT 'FUNCTION', p.oid::regprocedure::text FROM pg_proc p"
            " WHERE p.pronamespace = 'public'::regnamespace AND p.proowner <> %s::regrole",
            (owner, owner),
        ).fetchall()
        for kind, name in foreign:
            target = psycopg.sql.SQL(name) if kind == "FUNCTION" else psycopg.sql.Identifier(name)
            conn.execute(psycopg.sql.SQL("ALTER " + kind + " {} OWNER TO {}").format(target, role))


def open_roles(embedded: EmbeddedDatabase, dbname: str = DBNAME) -> DatabaseRoles:
    """The owner's and the runtime role's URLs for `dbname`: roles, database and ownership made
    the first time (and an older database owned by the superuser handed over to the owner)."""
    passwords = role_passwords(embedded.root)
    ensure_roles(embedded.admin_url, passwords)
    admin_db_url = embedded.create_database(dbname)
    with psycopg.connect(embedded.admin_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = %s", (dbname,)
        ).fetchone()
    if row is None or row[0] != OWNER_ROLE:
        hand_over(embedded.admin_url, admin_db_url, OWNER_ROLE)
    host, port = embedded.server.host, embedded.server.port
    return DatabaseRoles(
        owner_url=url(OWNER_ROLE, passwords[OWNER_ROLE], host, port, dbname),
        runtime_url=url(RUNTIME_ROLE, passwords[RUNTIME_ROLE], host, port, dbname),
    )
