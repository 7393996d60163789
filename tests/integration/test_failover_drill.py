"""The control plane rides a failover of its own database, as on CloudNativePG: a primary with a
synchronous streaming standby (pg_basebackup -R), a loopback proxy in the place of the -rw Service.
The primary is killed with SIGKILL mid-load, the standby promoted, the proxy repointed: no
acknowledged job is lost, the pools reconnect, the reconciler leads again and the worker's LISTEN
comes back (its poll interval is far longer than the test waits)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from controlplane.audit import verify as audit
from controlplane.db import connection as db
from controlplane.db import job_rows as jobs
from controlplane.db import sql
from controlplane.queue.registry import JobRegistry
from controlplane.queue.worker import Worker
from controlplane.runtime.postgres import (
    PostgresError,
    PostgresServer,
    free_port,
    make_owned_dir,
    server_user,
    url,
)
from controlplane.runtime.settings import Settings
from provisioners.noop import NoopProvisioner
from reconciler.leader import LeaderElection
from reconciler.maintenance import Maintenance
from reconciler.reconciler import PassSummary, Reconciler
from tests.factories import TEST_ACTOR
from tests.queue_kinds import build_registry, create_tables
from tests.support import eventually
from tests.tcp_proxy import Proxy

SUPERUSER = "drill"
# Synchronous commits to the standby: an acknowledged commit is on it when the primary dies.
PRIMARY_SETTINGS = {
    "wal_level": "replica",
    "max_wal_senders": "4",
    "synchronous_standby_names": "*",
    "synchronous_commit": "on",
    "hot_standby": "on",
    "max_connections": "60",
    "fsync": "off",  # a killed process, not a lost machine: the standby's page cache survives
    "log_min_messages": "warning",
}


@dataclass
class Pair:
    primary: PostgresServer
    standby: PostgresServer
    password: str

    def url(self, port: int, dbname: str = "controlplane") -> str:
        return url(SUPERUSER, self.password, "127.0.0.1", port, dbname)


@pytest.fixture
def pair(pg_root: Path) -> Iterator[Pair]:
    run_as = server_user()
    root = Path(tempfile.mkdtemp(prefix="drill-", dir=pg_root))
    os.chmod(root, 0o755)
    password = secrets.token_urlsafe(16)
    primary = PostgresServer(root / "primary", free_port(), run_as=run_as)
    make_owned_dir(primary.datadir, run_as)
    primary.initdb(SUPERUSER, password, PRIMARY_SETTINGS)
    primary.start()
    standby = PostgresServer(root / "standby", free_port(), run_as=run_as)
    make_owned_dir(standby.datadir, run_as)
    source = url(SUPERUSER, password, "127.0.0.1", primary.port, "postgres") + "?application_name=standby"
    backup = primary.run_tool(
        "pg_basebackup", ["-D", str(standby.datadir), "-R", "-X", "stream", "-c", "fast", "-d", source]
    )
    assert backup.returncode == 0, backup.stdout
    # Promoted, it runs alone (the old primary is gone): its own commits must not wait for a standby.
    standby.write_settings({k: v for k, v in PRIMARY_SETTINGS.items() if k != "synchronous_standby_names"})
    standby.start()
    yield Pair(primary, standby, password)
    for server in (primary, standby):
        with contextlib.suppress(PostgresError):
            server.stop("immediate")


async def scalar(target: str, query: str, params: tuple[object, ...] = ()) -> Any:
    async with await db.connect(target) as conn:
        row = await (await conn.execute(query, params)).fetchone()
        return None if row is None else next(iter(row.values()))


async def test_the_control_plane_rides_a_failover_of_its_database(pair: Pair) -> None:
    with psycopg.connect(pair.url(pair.primary.port, "postgres"), autocommit=True) as admin:
        admin.execute("CREATE DATABASE controlplane")
    db.migrate(pair.url(pair.primary.port))
    async with await db.connect(pair.url(pair.primary.port)) as conn:
        await create_tables(conn)
    await eventually(
        lambda: _sync_standby(pair.url(pair.primary.port, "postgres")), "the standby streams synchronously"
    )

    proxy = await Proxy(pair.primary.port).start()
    through = pair.url(proxy.port)
    settings = Settings(
        database_url=through,
        heartbeat_interval_s=0.2,
        poll_interval_s=30.0,  # only a NOTIFY wakes the worker within the test's waits
        worker_concurrency=4,
        retry_base_delay_s=0.05,
        retry_max_delay_s=0.2,
        reconcile_interval_s=0.1,
        shutdown_grace_s=1.0,
    )
    registry: JobRegistry = build_registry()
    pool = db.pool(through, min_size=1, max_size=8, name="drill")
    await pool.open(wait=True)
    worker = Worker("drill-worker", settings, pool, registry)
    maintenance = Maintenance(settings, pool, NoopProvisioner(), registry, maintainer_id="drill-reconciler")
    reconciler = Reconciler(
        settings, pool, NoopProvisioner(), reconciler_id="drill-reconciler", maintenance=maintenance
    )
    passes: list[float] = []
    real_pass = reconciler.run_once

    async def counted_pass(now: datetime | None = None, **kwargs: Any) -> PassSummary:
        summary = await real_pass(now, **kwargs)
        passes.append(time.monotonic())
        return summary

    reconciler.run_once = counted_pass  # type: ignore[method-assign]
    election = LeaderElection(through)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(worker.run()), asyncio.create_task(reconciler.run(stop, election))]
    acknowledged: list[uuid.UUID] = []
    try:
        await enqueue(pool, acknowledged, 20)
        await eventually(lambda: _completed_at_least(through, 5), "jobs run before the failover")
        await eventually(_async(lambda: election.is_leader), "a reconciler leads")

        # Jobs that take a while: some are running (claimed, started) when the primary dies.
        load = asyncio.create_task(enqueue(pool, acknowledged, 30, pause_s=0.02, seconds=0.3))
        await eventually(lambda: _running(pair.url(pair.primary.port)), "a job runs when the primary dies")
        os.kill(pair.primary.pid() or 0, signal.SIGKILL)
        pair.primary.wait_until_down()
        promoted = pair.standby.run_tool("pg_ctl", ["-D", str(pair.standby.datadir), "promote", "-w"])
        assert promoted.returncode == 0, promoted.stdout
        failed_over_at = time.monotonic()
        before = len(acknowledged)
        proxy.repoint(pair.standby.port)
        await load
        # The load ran into the failover: some jobs were acknowledged before it, some after.
        assert 20 < before < 50, before
        # The jobs that were running come back: reclaimed after their heartbeats stop, run again.

        new_primary = pair.url(pair.standby.port)
        assert await scalar(new_primary, "SELECT NOT pg_is_in_recovery()") is True
        # Every acknowledged job is on the new primary and runs to completion there.
        await eventually(
            lambda: _all_completed(new_primary, acknowledged), "every acknowledged job completed", 60
        )
        # The reconciler is re-elected: passes run again after the failover, on the new primary.
        await eventually(
            _async(lambda: bool(passes) and passes[-1] > failed_over_at), "a pass after the failover"
        )
        assert election.is_leader
        holder = await scalar(
            new_primary, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
        )
        assert holder == 1
        # The worker listens again; a job queued now is picked up by its NOTIFY, not by polling.
        await eventually(lambda: _listening(new_primary), "the worker's LISTEN is back on the new primary")
        probe: list[uuid.UUID] = []
        await enqueue(pool, probe, 1)
        started = time.monotonic()
        await eventually(lambda: _all_completed(new_primary, probe), "the probe job, woken by NOTIFY", 10)
        assert time.monotonic() - started < settings.worker.poll_interval_s / 3
        # The pool serves again (the worker's and reconciler's connections came through it).
        async with pool.connection() as conn:
            assert await (await conn.execute("SELECT 1 AS one")).fetchone() == {"one": 1}
        async with await db.connect(new_primary) as conn:
            assert await audit.verify(conn) == []  # the event log replays to the current rows
            lost = await conn.execute(
                "SELECT count(*) AS n FROM unnest(%s::uuid[]) AS a(id)"
                " LEFT JOIN jobs j USING (id) WHERE j.id IS NULL",
                (acknowledged,),
            )
            assert await lost.fetchone() == {"n": 0}
        assert len(acknowledged) == 50
    finally:
        worker.request_stop()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await election.release()
        await pool.close()
        await proxy.stop()


async def enqueue(
    pool: object, acknowledged: list[uuid.UUID], count: int, pause_s: float = 0.0, seconds: float = 0.0
) -> None:
    """Enqueue `count` jobs; a job counts once its commit returned (an error means: not acknowledged)."""
    from psycopg_pool import AsyncConnectionPool, PoolTimeout

    assert isinstance(pool, AsyncConnectionPool)
    deadline = time.monotonic() + 60
    done = 0
    while done < count:
        assert time.monotonic() < deadline, "enqueueing did not recover"
        try:
            async with pool.connection(timeout=2) as conn:
                result = await jobs.enqueue(
                    conn, jobs.NewJob("record", payload={"seconds": seconds}), TEST_ACTOR
                )
        except (psycopg.Error, PoolTimeout):
            await asyncio.sleep(0.05)
            continue
        acknowledged.append(result.job["id"])
        done += 1
        if pause_s:
            await asyncio.sleep(pause_s)


def _async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def wrapped() -> bool:
        return check()

    return wrapped


async def _sync_standby(target: str) -> bool:
    return bool(
        await scalar(target, "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'") == 1
    )


async def _completed_at_least(target: str, n: int) -> bool:
    return bool(await scalar(target, "SELECT count(*) FROM jobs WHERE state = 'completed'") >= n)


async def _all_completed(target: str, ids: list[uuid.UUID]) -> bool:
    try:
        count = await scalar(
            target, "SELECT count(*) FROM jobs WHERE state = 'completed' AND id = ANY(%s)", (ids,)
        )
    except psycopg.OperationalError:
        return False
    return bool(count == len(ids))


async def _listening(target: str) -> bool:
    query = "SELECT count(*) FROM pg_stat_activity WHERE query = %s"
    return bool(await scalar(target, query, (sql.LISTEN_JOB_QUEUED,)) == 1)


async def _running(target: str) -> bool:
    return bool(await scalar(target, "SELECT count(*) FROM jobs WHERE state = 'running'") != 0)
