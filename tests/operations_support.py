"""Helpers of the operations tests: run the real worker and supervisor in-process until a condition holds."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from psycopg.rows import DictRow

from controlplane.core.kinds import PROVISION
from controlplane.db import connection as db
from controlplane.db import job_rows as jobs
from controlplane.db.connection import AsyncConn
from controlplane.handlers import operations
from controlplane.queue.registry import JobRegistry
from controlplane.queue.supervisor import Supervisor
from controlplane.queue.worker import Worker
from controlplane.runtime.settings import Settings
from provisioners.base import Provisioner
from tests.factories import TEST_ACTOR, make_instance

Condition = Callable[[AsyncConn], Awaitable[bool]]
# How long a stopping worker may take to hand back what it holds and end.
STOP_S = 60.0


def registry_for(provisioner: Provisioner) -> JobRegistry:
    return operations.registry(provisioner)


async def run_until(
    settings: Settings,
    registry: JobRegistry,
    done: Condition,
    *,
    timeout_s: float = 60,
    worker: bool = True,
    supervise_at: datetime | None = None,
) -> None:
    """Run a worker and supervisor passes until `done` holds (or fail after `timeout_s`); the
    supervisor's passes take `supervise_at` as now when given (failed jobs due at once)."""
    assert settings.database.url_value is not None
    pool = db.pool(settings.database.url_value, min_size=1, max_size=8, name="ops-test")
    await pool.open(wait=True)
    runner = Worker(f"test-{uuid.uuid4().hex[:6]}", settings, pool, registry) if worker else None
    task = asyncio.create_task(runner.run()) if runner else None
    supervisor = Supervisor(pool, settings, registry)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            await supervisor.run_once(supervise_at)
            async with pool.connection() as conn:
                if await done(conn):
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached within {timeout_s}s")
            if task is not None and task.done():
                task.result()
            await asyncio.sleep(0.05)
    finally:
        if runner is not None and task is not None:
            runner.request_stop()
            async with asyncio.timeout(STOP_S):  # a worker that does not stop fails the test
                await task
        await pool.close()


def instance_in(instance_id: uuid.UUID, *states: str) -> Condition:
    async def check(conn: AsyncConn) -> bool:
        cursor = await conn.execute("SELECT state FROM instances WHERE id = %s", (instance_id,))
        row = await cursor.fetchone()
        return row is not None and row["state"] in states

    return check


def job_finished(job_id: uuid.UUID) -> Condition:
    async def check(conn: AsyncConn) -> bool:
        cursor = await conn.execute("SELECT state FROM jobs WHERE id = %s", (job_id,))
        row = await cursor.fetchone()
        return row is not None and row["state"] in ("completed", "abandoned")

    return check


async def enqueue(conn: AsyncConn, kind: str, instance_id: uuid.UUID, **payload: Any) -> DictRow:
    result = await jobs.enqueue(conn, jobs.NewJob(kind, instance_id, payload=payload), TEST_ACTOR)
    return result.job


async def ready_instance(
    conn: AsyncConn, settings: Settings, registry: JobRegistry, org_id: uuid.UUID | None = None
) -> uuid.UUID:
    """A new instance provisioned by a worker over `registry`: its id, once it is ready."""
    iid: uuid.UUID = (await make_instance(conn, org_id))["id"]
    await enqueue(conn, PROVISION, iid)
    await run_until(settings, registry, instance_in(iid, "ready"))
    return iid


async def instance(conn: AsyncConn, instance_id: uuid.UUID) -> DictRow:
    cursor = await conn.execute("SELECT * FROM instances WHERE id = %s", (instance_id,))
    row = await cursor.fetchone()
    assert row is not None
    return row


async def job(conn: AsyncConn, job_id: uuid.UUID) -> DictRow:
    cursor = await conn.execute("SELECT * FROM jobs WHERE id = %s", (job_id,))
    row = await cursor.fetchone()
    assert row is not None
    return row


async def scalar(conn: AsyncConn, query: str, params: Any = None) -> Any:
    """The first column of the one row `query` returns."""
    cursor = await conn.execute(query, params)
    row = await cursor.fetchone()
    assert row is not None
    return next(iter(row.values()))
