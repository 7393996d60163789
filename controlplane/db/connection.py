"""Database access: the URL to use, migrations, and the connection pools of the services."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast

import psycopg
from opentelemetry.trace import SpanKind
from psycopg import pq
from psycopg import sql as pgsql
from psycopg.abc import Params, Query, QueryNoTemplate
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout
from psycopg_pool.base import AttemptWithBackoff

from controlplane.db import sql
from controlplane.runtime import metrics, tracing
from controlplane.runtime.logs import first_line
from controlplane.runtime.settings import Settings, SettingsError

if TYPE_CHECKING:
    from controlplane.runtime.embedded import EmbeddedDatabase

log = logging.getLogger(__name__)

# The migrations: inside the package when installed from a wheel (its build copies them there:
# deploy/packaging/shipped_migrations.py), else the checkout's top-level alembic/ and alembic.ini.
_SHIPPED = Path(__file__).resolve().parent / "migrations"
_CHECKOUT = Path(__file__).resolve().parents[2]
MIGRATIONS, ALEMBIC_INI = (
    (_SHIPPED, _SHIPPED / "alembic.ini")
    if (_SHIPPED / "env.py").is_file()
    else (_CHECKOUT / "alembic", _CHECKOUT / "alembic.ini")
)

AsyncConn = psycopg.AsyncConnection[DictRow]
T = TypeVar("T")


class TracedCursor(psycopg.AsyncCursor[DictRow]):
    """The cursor of every connection of the services: inside a traced request or job, each
    statement is a span of its own, named after its name in `controlplane.db.sql`. Tracing off (or
    outside a traced request or job), it is psycopg's cursor plus one test."""

    async def execute(
        self,
        query: Query,
        params: Params | None = None,
        *,
        prepare: bool | None = None,
        binary: bool | None = None,
    ) -> Self:
        statement = cast(QueryNoTemplate, query)  # no template strings here (Python 3.14's t"")
        if not tracing.active():
            return await super().execute(statement, params, prepare=prepare, binary=binary)
        name, attributes = _statement(statement)
        with tracing.span(name, kind=SpanKind.CLIENT, attributes=attributes):
            return await super().execute(statement, params, prepare=prepare, binary=binary)


@functools.cache
def _statement_names() -> dict[str, str]:
    """Each statement's text, to the name it has in `controlplane.db.sql` (those made per entity,
    the transitions: `TRANSITION_ONE[instance]`)."""
    names: dict[str, str] = {}
    for name in sql.__all__:
        value = getattr(sql, name)
        if isinstance(value, str):
            names[value] = name
        elif isinstance(value, Mapping):
            names.update({text: f"{name}[{key}]" for key, text in value.items() if isinstance(text, str)})
    return names


def _statement(query: QueryNoTemplate) -> tuple[str, dict[str, str]]:
    """A statement's span name and attributes: its name in `sql` (else its first word) and its text,
    which holds placeholders, never values."""
    text = query if isinstance(query, str) else None
    name = _statement_names().get(text) if text is not None else None
    summary = name or (text.split(None, 1)[0].upper() if text and text.strip() else "statement")
    attributes = {"db.system.name": "postgresql", "db.query.summary": summary}
    if text is not None:
        attributes["db.query.text"] = text
    return f"sql {summary}", attributes


log = logging.getLogger(__name__)


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
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["database_url"] = url
    return config


def migrate(url: str, revision: str = "head", *, runtime_role: str | None = None) -> None:
    """Bring the schema to `revision` as the role of `url` (the owner), then grant the runtime role."""
    from alembic.config import Config

    from alembic import command

    config = alembic_config(url)
    assert isinstance(config, Config)
    command.upgrade(config, revision)
    if runtime_role:
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            grant_runtime(conn, runtime_role)


# What the runtime role may do beyond reading: the event logs, the checkpoints and the signing key
# only grow; the schema's bookkeeping is read only; everything else is read and written.
APPEND_ONLY_TABLES = frozenset(
    {
        "instance_events",
        "job_events",
        "job_steps",
        "audit_keys",
        "audit_checkpoints",
        "audit_checkpoint_heads",
    }
)
READ_ONLY_TABLES = frozenset({"alembic_version", "lifecycle_transitions"})
RUNTIME_FUNCTIONS = ("cp_ensure_event_partitions(timestamptz, timestamptz)",)


class RoleError(RuntimeError):
    """The runtime role cannot be given least privilege (it is the owner, a superuser, or missing)."""


def grant_runtime(conn: psycopg.Connection[tuple[Any, ...]], role: str) -> None:
    """Give `role` exactly what the API, worker and reconciler need, and nothing it could tamper with.

    Run as the owner after every migration, so tables added later are covered. The role owns
    nothing: it cannot ALTER, DISABLE TRIGGER, TRUNCATE or DROP. On the append-only tables it has
    INSERT and SELECT, through the partitioned parents only (the partitions, made later by
    cp_ensure_event_partitions, grant it nothing, and no default privileges are set).
    """
    row = conn.execute(sql.ROLE_ATTRIBUTES, {"role": role}).fetchone()
    if row is None:
        raise RoleError(f"runtime role {role!r} does not exist (create it first: docs/deployment.md)")
    superuser, member, same = row
    if same or member:
        raise RoleError(f"runtime role {role!r} is the owner or a member of it: it could alter the audit log")
    if superuser:
        raise RoleError(f"runtime role {role!r} is a superuser: it could alter the audit log")
    ident = pgsql.Identifier(role)
    tables = conn.execute(sql.PUBLIC_TABLES).fetchall()
    with conn.transaction():
        conn.execute(pgsql.SQL(sql.GRANT_SCHEMA_USAGE).format(role=ident))
        for name, is_partition in tables:
            table = pgsql.Identifier(name)
            conn.execute(pgsql.SQL(sql.REVOKE_TABLE).format(table=table, role=ident))
            if is_partition:
                continue
            if name in APPEND_ONLY_TABLES:
                privileges = sql.APPEND_ONLY_PRIVILEGES
            elif name in READ_ONLY_TABLES:
                privileges = sql.READ_ONLY_PRIVILEGES
            else:
                privileges = sql.READ_WRITE_PRIVILEGES
            statement = pgsql.SQL(sql.GRANT_TABLE).format(
                privileges=pgsql.SQL(privileges), table=table, role=ident
            )
            conn.execute(statement)
        conn.execute(pgsql.SQL(sql.GRANT_SEQUENCES).format(role=ident))
        for function in RUNTIME_FUNCTIONS:
            conn.execute(pgsql.SQL(sql.REVOKE_FUNCTION_FROM_PUBLIC).format(function=pgsql.SQL(function)))
            conn.execute(pgsql.SQL(sql.GRANT_FUNCTION).format(function=pgsql.SQL(function), role=ident))
    log.info("runtime role %s granted its privileges", role)


def url_user(url: str | None) -> str | None:
    """The role a PostgreSQL URL (or key=value string) connects as, if it names one."""
    if not url:
        return None
    user = conninfo_to_dict(libpq_url(url)).get("user")
    return str(user) if user else None


@dataclass(frozen=True)
class MigrationTarget:
    """Where migrations run (as the owner) and which role then gets the runtime privileges."""

    url: str
    runtime_role: str | None


def migration_target(settings: Settings, embedded: EmbeddedDatabase | None = None) -> MigrationTarget:
    """The owner's URL: CONTROLPLANE_MIGRATION_DATABASE_URL, else CONTROLPLANE_DATABASE_URL (one
    role for everything), else the owner role of the embedded server (`embedded`, or the one a
    running `up` keeps in data_dir)."""
    database = settings.database
    if database.migration_url_value:
        runtime = database.runtime_role or url_user(database.url_value)
        return MigrationTarget(libpq_url(database.migration_url_value), runtime)
    if database.url_value:
        return MigrationTarget(libpq_url(database.url_value), database.runtime_role)
    from controlplane.runtime.embedded import open_roles, running_embedded

    roles = open_roles(embedded or running_embedded(Path(settings.data_dir) / "db"))
    return MigrationTarget(roles.owner_url, roles.runtime_role)


def head_revision() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = alembic_config("postgresql://unused")
    assert isinstance(config, Config)
    head = ScriptDirectory.from_config(config).get_current_head()
    assert head is not None
    return head


def resolve_database_url(settings: Settings) -> str:
    """The runtime role's URL: the configured one, or that of the embedded server a running `up`
    keeps in data_dir (its runtime role).

    Never starts a server: a command that finds neither says in one line what to set
    (NotAvailable). Only `up` (and `migrate`, for its own run) start the embedded server.
    """
    if settings.database.url_value:
        return libpq_url(settings.database.url_value)
    from controlplane.runtime.embedded import open_roles, running_embedded

    return open_roles(running_embedded(Path(settings.data_dir) / "db")).runtime_url


@contextlib.asynccontextmanager
async def transaction(conn: AsyncConn) -> AsyncIterator[None]:
    """The caller's transaction when one is open (a use case inside the API's idempotent request
    joins it: no savepoint, no extra round trips), else a transaction of its own."""
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        yield
        return
    async with conn.transaction():
        yield


async def connect(url: str, *, autocommit: bool = True, timeouts: Timeouts | None = None) -> AsyncConn:
    conninfo = url if timeouts is None else timeouts.conninfo(url)
    return await psycopg.AsyncConnection.connect(
        conninfo, autocommit=autocommit, row_factory=dict_row, cursor_factory=TracedCursor
    )


@dataclass(frozen=True)
class Timeouts:
    """`lock_timeout` and `statement_timeout` of one role's sessions, in seconds; 0 leaves the
    server's (or the database role's) own value.

    They are sent as the connection's startup options, so they hold on any PostgreSQL the control
    plane reaches (the embedded one, or an external one under any role), without ALTER ROLE. A
    statement that waits longer than `lock_s` for a lock, or runs longer than `statement_s`,
    is cancelled by the server: a request never hangs on a lock another session holds.
    """

    lock_s: float = 0.0
    statement_s: float = 0.0

    @classmethod
    def api(cls, settings: Settings) -> Timeouts:
        """The API's: short, a person or a client waits on each request."""
        return cls(settings.database.api_lock_timeout_s, settings.database.api_statement_timeout_s)

    @classmethod
    def background(cls, settings: Settings) -> Timeouts:
        """The worker's, the reconciler's and the supervisor's: longer, nobody waits on them."""
        return cls(
            settings.database.background_lock_timeout_s, settings.database.background_statement_timeout_s
        )

    def options(self) -> str:
        """The `-c name=value` options that set them (empty when both are left to the server)."""
        values = (("lock_timeout", self.lock_s), ("statement_timeout", self.statement_s))
        return " ".join(f"-c {name}={max(1, round(s * 1000))}ms" for name, s in values if s > 0)

    def conninfo(self, url: str) -> str:
        """`url` with these options added to any it already carries."""
        ours = self.options()
        if not ours:
            return url
        given = conninfo_to_dict(url).get("options")
        return make_conninfo(url, options=f"{given} {ours}" if given else ours)


# A transaction that lost a race with another one (deadlock_detected, serialization_failure): the
# server rolled it back whole, and the same transaction run again is likely to get through.
LOST_RACE = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)
# How many times such a transaction is run in all; after the last, the error goes to the caller
# (the API answers 409 with Retry-After: a lost race is never a 503).
LOST_RACE_ATTEMPTS = 3
# The longest random pause before running it again (times the attempt number).
LOST_RACE_PAUSE_S = 0.05


async def retry_lost_races(work: Callable[[], Awaitable[T]], *, attempts: int = LOST_RACE_ATTEMPTS) -> T:
    """`work()`, one whole transaction from its start, run again after a short random pause when it
    loses to a deadlock or a serialization failure, up to `attempts` times in all. Nothing else is
    retried here: a lock timeout or an outage goes to the caller at once."""
    attempt = 1
    while True:
        try:
            return await work()
        except LOST_RACE as exc:
            if attempt >= attempts:
                metrics.LOST_RACES.labels("given_up").inc()
                log.warning("a transaction lost %d races in a row; giving up: %s", attempts, first_line(exc))
                raise
            metrics.LOST_RACES.labels("retried").inc()
            log.info("a transaction lost a race (%s); running it again", first_line(exc))
            await asyncio.sleep(random.uniform(0, LOST_RACE_PAUSE_S * attempt))  # noqa: S311 (jitter)
            attempt += 1


async def in_transaction(
    pool: AsyncConnectionPool[AsyncConn], work: Callable[[AsyncConn], Awaitable[T]]
) -> T:
    """`work(conn)` in one transaction on a pooled connection, run again if it loses a race."""

    async def attempt() -> T:
        async with pool.connection() as conn, conn.transaction():
            return await work(conn)

    return await retry_lost_races(attempt)


# A write refused because the database (or this session) is read-only: a standby, a failover in
# progress, or default_transaction_read_only.
READ_ONLY = psycopg.errors.ReadOnlySqlTransaction


# Reconnection attempts during an outage are at most this far apart: service returns within
# about this long after the database does (the pool's own backoff doubles without a bound).
RECONNECT_MAX_DELAY_S = 1.0
# How long a caller waits for a connection while the database is known to be unreachable
# (instead of the pool's full timeout): requests fail fast, and are answered 503 + Retry-After.
OUTAGE_WAIT_S = 0.05
# A new connection that takes longer than this is given up (the server is up but not answering).
CONNECT_TIMEOUT_S = 5


class _CappedBackoff(AttemptWithBackoff):
    """The pool's backoff between reconnection attempts, capped at RECONNECT_MAX_DELAY_S."""

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        self.delay = min(self.delay, RECONNECT_MAX_DELAY_S)


class Pool(AsyncConnectionPool[AsyncConn]):
    """An async pool that outlives the database going away and coming back.

    It never stops trying to reconnect (psycopg_pool gives up after `reconnect_timeout`, 300 s by
    default) and tries at least every RECONNECT_MAX_DELAY_S; while its last connection attempt
    failed, a caller waits OUTAGE_WAIT_S for a connection rather than the full timeout (30 s),
    and gets PoolTimeout (so do the callers already waiting when an attempt fails). Once a
    connection succeeds again, the idle connections broken by the outage are checked and replaced.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, reconnect_timeout=float("inf"), **kwargs)
        self.unavailable_since: float | None = None
        self._checking: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def connection(self, timeout: float | None = None) -> AsyncIterator[AsyncConn]:  # noqa: ASYNC109 (the pool's)
        async with super().connection(timeout) as conn:
            try:
                yield conn
            except READ_ONLY:
                await self.discard_read_only(conn)
                raise

    async def discard_read_only(self, conn: AsyncConn) -> None:
        """Close a session that found the database read-only (the pool opens another in its place):
        after a failover the new sessions reach the writable server, and a session that started
        read-only (default_transaction_read_only) stays so for its whole life."""
        log.warning("pool %s: the database is read-only; closing the session that found it", self.name)
        await conn.close()

    @property
    def available(self) -> bool:
        return self.unavailable_since is None

    async def getconn(self, timeout: float | None = None) -> AsyncConn:  # noqa: ASYNC109 (the pool's)
        if timeout is None and self.unavailable_since is not None:
            timeout = OUTAGE_WAIT_S
        return await super().getconn(timeout)

    async def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        await super()._add_connection(attempt or _CappedBackoff(timeout=self.reconnect_timeout), growing)

    async def _connect(self, timeout: float | None = None) -> AsyncConn:  # noqa: ASYNC109 (the pool's)
        try:
            conn = await super()._connect(timeout)
        except psycopg.OperationalError as exc:
            if self.unavailable_since is None:
                self.unavailable_since = time.monotonic()
                log.warning(
                    "pool %s: the database is unavailable (%s); retrying", self.name, str(exc).strip()
                )
            await self._fail_waiting()
            raise
        if self.unavailable_since is not None:
            log.warning(
                "pool %s: the database is available again after %.1fs",
                self.name,
                time.monotonic() - self.unavailable_since,
            )
            self.unavailable_since = None
            if self._checking is None or self._checking.done():
                self._checking = asyncio.get_running_loop().create_task(self.check())
        return conn

    async def _fail_waiting(self) -> None:
        """End the waits of the callers queued for a connection (PoolTimeout, as after
        OUTAGE_WAIT_S): one that asked before the outage was known would otherwise wait out the
        full timeout for a connection no attempt can make."""
        async with self._lock:
            while self._waiting:
                await self._waiting.popleft().fail(PoolTimeout("the database is unavailable"))


# Errors after which a database write is retried on a fresh connection (a read-only database too:
# a failover in progress, after which the new connections reach the writable server).
DATABASE_GONE = (psycopg.OperationalError, PoolTimeout, READ_ONLY)
# How long a lease waits for a pooled connection before counting the database as unreachable.
LEASE_WAIT_S = 5.0


class Lease:
    """A pooled connection kept across operations (sparing the pool's check on every checkout),
    given back to the pool, which discards it if broken, when an operation fails on it."""

    def __init__(self, pool: AsyncConnectionPool[AsyncConn]) -> None:
        self.pool = pool
        self.conn: AsyncConn | None = None

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConn]:
        if self.conn is not None and (self.conn.closed or self.conn.broken):
            await self.release()
        if self.conn is None:
            self.conn = await self.pool.getconn(timeout=LEASE_WAIT_S)
        try:
            yield self.conn
        except BaseException as exc:
            if isinstance(exc, READ_ONLY) and isinstance(self.pool, Pool):
                await self.pool.discard_read_only(self.conn)
            await self.release()
            raise

    async def release(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(PoolClosed):
                await self.pool.putconn(conn)


def pool(
    url: str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    name: str = "controlplane",
    timeouts: Timeouts | None = None,
) -> Pool:
    """An async pool of autocommit connections returning rows as dicts (open it before use), its
    sessions under `timeouts` (the role's lock and statement timeouts).

    Connections are not checked on every checkout (that costs a round trip per use): one broken
    by a server restart fails its user once (the API answers 503) and is discarded when returned.
    """

    async def configure(conn: AsyncConn) -> None:
        await conn.set_autocommit(True)

    conninfo = libpq_url(url)
    return Pool(
        conninfo if timeouts is None else timeouts.conninfo(conninfo),
        min_size=min_size,
        max_size=max_size,
        kwargs={
            "row_factory": dict_row,
            "cursor_factory": TracedCursor,
            "connect_timeout": CONNECT_TIMEOUT_S,
        },
        configure=configure,
        open=False,
        name=name,
    )
