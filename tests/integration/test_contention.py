"""Lock contention: the PATCH storm against a real worker, a race lost to a deadlock, a long lock
holder (F22), and the lock and statement timeouts of each role's sessions."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx
import pytest
from prometheus_client import REGISTRY

from controlplane.api.app import create_app
from controlplane.audit import verify as audit
from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.handlers import operations
from controlplane.queue.worker import Worker
from controlplane.runtime.settings import Settings
from provisioners.noop import NoopProvisioner
from tests.api_support import Tenant, create, make_ready, make_tenant, serving

# The storm: six writers toggling the plan of one ready instance while a real worker runs the updates,
# for STORM_S and until the worker has applied two of them (at most STORM_MAX_S): it overlaps real
# updates however fast the machine is, and no rate limit meets it (the settings have none).
STORM_S = 3.0
STORM_MAX_S = 60.0
WRITERS = 6


def _count(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _ready_instance(
    client: httpx.AsyncClient, conn: AsyncConn, settings: Settings
) -> tuple[Tenant, str]:
    tenant = await make_tenant(conn)
    made = await create(client, tenant, f"db-{uuid.uuid4().hex[:6]}")
    await make_ready(conn, settings, made["id"])
    return tenant, f"/v1/instances/{made['id']}"


async def _waiting_for_a_lock(conn: AsyncConn, blocker_pid: int) -> bool:
    cursor = await conn.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (blocker_pid,)
    )
    row = await cursor.fetchone()
    return bool(row and row["n"])


async def _until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + 10
    while not await check():
        assert time.monotonic() < deadline, f"not within 10s: {what}"
        await asyncio.sleep(0.02)


async def test_patch_storm_against_a_real_worker_never_deadlocks_nor_answers_503(
    settings: Settings, conn: AsyncConn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    url = settings.database.url_value
    assert url is not None
    tenant = await make_tenant(conn)
    app = create_app(settings)
    pool = db.pool(
        url, min_size=2, max_size=12, name="storm-worker", timeouts=db.Timeouts.background(settings)
    )
    worker = Worker(
        "storm-worker", settings.replace(worker_concurrency=4), pool, operations.registry(NoopProvisioner())
    )
    statuses: collections.Counter[int] = collections.Counter()
    async with app.router.lifespan_context(app):
        await pool.open(wait=True)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        running = asyncio.create_task(worker.run())
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                made = await create(client, tenant, "storm")
                path = f"/v1/instances/{made['id']}"

                async def ready() -> bool:
                    return bool((await client.get(path, headers=tenant.headers)).json()["state"] == "ready")

                await _until(ready, "the instance is provisioned by the worker")

                def storming(began: float) -> bool:
                    now = time.monotonic()
                    assert now < began + STORM_MAX_S, f"no change applied amid the storm: {worker.counts}"
                    return now < began + STORM_S or worker.counts["completed"] < 3  # the provision, 2 updates

                async def toggle(n: int) -> None:
                    plans = ("dev", "small") if n % 2 else ("small", "dev")
                    began, i = time.monotonic(), 0
                    while storming(began):
                        response = await client.patch(
                            path, json={"plan": plans[i % 2]}, headers=tenant.headers
                        )
                        statuses[response.status_code] += 1
                        i += 1

                await asyncio.gather(*(toggle(n) for n in range(WRITERS)))
        finally:
            worker.request_stop()
            await running
            await pool.close()
    # Every change is accepted (202) or refused as a problem a client acts on (409 while updating
    # is not refused: a change is recorded in any live state); no 5xx, and no deadlock anywhere.
    assert statuses and set(statuses) <= {202}, statuses
    assert worker.counts["completed"] > 1, worker.counts
    assert not [r.getMessage() for r in caplog.records if "deadlock" in r.getMessage()]
    assert not [r.getMessage() for r in caplog.records if "lost a race" in r.getMessage()]
    assert await audit.verify(conn) == []


async def test_a_change_that_loses_a_deadlock_is_run_again_and_accepted_never_a_503(
    conn: AsyncConn, settings: Settings, fresh_database: str
) -> None:
    # The lock timeout is longer than the server's deadlock_timeout (1 s): the deadlock is found first.
    async with serving(settings, api_lock_timeout_s=10) as client:
        await _lose_a_deadlock_then_go_through(client, conn, settings, fresh_database)


async def _lose_a_deadlock_then_go_through(
    client: httpx.AsyncClient, conn: AsyncConn, settings: Settings, fresh_database: str
) -> None:
    tenant, path = await _ready_instance(client, conn, settings)
    instance_id = path.rsplit("/", 1)[1]
    assert (await client.patch(path, json={"plan": "small"}, headers=tenant.headers)).status_code == 202
    cursor = await conn.execute(
        "SELECT id FROM jobs WHERE instance_id = %s AND kind = 'update'", (instance_id,)
    )
    job = await cursor.fetchone()
    assert job is not None
    retried = _count("controlplane_lost_races_total", outcome="retried")

    # An outside transaction updates the live update job (the change's job insert will wait for
    # it) and then wants the instance's row, which the change holds: a real deadlock. Its own
    # deadlock_timeout is long, so the change's session is the one the server picks to abort.
    other = await db.connect(fresh_database, autocommit=False)
    async with other:
        await other.execute("SET deadlock_timeout = '30s'")
        await other.execute("UPDATE jobs SET updated_at = now() WHERE id = %s", (job["id"],))
        pid = other.info.backend_pid
        patch = asyncio.create_task(client.patch(path, json={"plan": "medium"}, headers=tenant.headers))
        await _until(lambda: _waiting_for_a_lock(conn, pid), "the change waits for the outside transaction")
        await other.execute("SELECT 1 FROM instances WHERE id = %s FOR UPDATE", (instance_id,))
        await other.rollback()
        response = await patch
    assert response.status_code == 202, response.text
    assert response.json()["plan"] == "medium"
    assert _count("controlplane_lost_races_total", outcome="retried") == retried + 1
    assert await audit.verify(conn) == []


async def test_f22_long_lock_holder(conn: AsyncConn, settings: Settings, fresh_database: str) -> None:
    """An outside session holds FOR UPDATE on an instance row: the API answers within its lock
    timeout (409 busy with Retry-After, while the lock is still held), reads are not blocked, the
    request is not retried (one lock wait each, no retry storm), and it goes through once released."""
    async with serving(settings, api_lock_timeout_s=0.3) as client:
        await _refused_while_locked_then_accepted(client, conn, settings, fresh_database)


async def _refused_while_locked_then_accepted(
    client: httpx.AsyncClient, conn: AsyncConn, settings: Settings, fresh_database: str
) -> None:
    tenant, path = await _ready_instance(client, conn, settings)
    instance_id = path.rsplit("/", 1)[1]
    timeouts = _count("controlplane_api_database_refusals_total", reason="lock_timeout")
    races = _count("controlplane_lost_races_total", outcome="retried")

    holder = await db.connect(fresh_database, autocommit=False)
    async with holder:
        await holder.execute("SELECT 1 FROM instances WHERE id = %s FOR UPDATE", (instance_id,))
        for response in (
            await client.patch(path, json={"plan": "small"}, headers=tenant.headers),
            await client.patch(path, json={"deletion_protection": True}, headers=tenant.headers),
            await client.delete(path, headers=tenant.headers),
        ):
            assert response.status_code == 409, response.text
            assert response.headers["content-type"] == "application/problem+json"
            assert response.json()["type"] == "urn:controlplane:problem:busy"
            assert int(response.headers["retry-after"]) >= 1
        assert (await client.get(path, headers=tenant.headers)).status_code == 200
        # The lock is still held: every answer came by the lock timeout, not by the holder letting go.
        assert holder.info.transaction_status.name == "INTRANS"
        await holder.rollback()
    assert _count("controlplane_api_database_refusals_total", reason="lock_timeout") == timeouts + 3
    assert _count("controlplane_lost_races_total", outcome="retried") == races
    changed = await client.patch(path, json={"plan": "small"}, headers=tenant.headers)
    assert changed.status_code == 202 and changed.json()["plan"] == "small"
    cursor = await conn.execute(
        "SELECT count(*) AS n FROM jobs WHERE instance_id = %s AND kind = 'update'", (instance_id,)
    )
    assert await cursor.fetchone() == {"n": 1}  # nothing of the refused requests was written
    assert await audit.verify(conn) == []


async def test_a_statement_past_the_api_statement_timeout_is_a_503_with_retry_after(
    settings: Settings, conn: AsyncConn, fresh_database: str
) -> None:
    app = create_app(settings.replace(api_lock_timeout_s=0, api_statement_timeout_s=0.3))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            tenant, path = await _ready_instance(client, conn, settings)
            holder = await db.connect(fresh_database, autocommit=False)
            async with holder:
                await holder.execute(
                    "SELECT 1 FROM instances WHERE id = %s FOR UPDATE", (path.rsplit("/", 1)[1],)
                )
                response = await client.patch(path, json={"plan": "small"}, headers=tenant.headers)
                assert holder.info.transaction_status.name == "INTRANS"
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert int(response.headers["retry-after"]) >= 1


async def test_each_role_has_its_own_lock_and_statement_timeouts(settings: Settings) -> None:
    url = settings.database.url_value
    assert url is not None
    configured = settings.replace(
        api_lock_timeout_s=1.5,
        api_statement_timeout_s=7,
        background_lock_timeout_s=20,
        background_statement_timeout_s=0,
    )
    app = create_app(configured)
    async with app.router.lifespan_context(app), app.state.controlplane.pool.connection() as api:
        assert await _show(api, "lock_timeout") == "1500ms"
        assert await _show(api, "statement_timeout") == "7s"
    # The background roles' pools; 0 leaves the server's own (here: none), and options the URL
    # carries itself are kept.
    background = db.Timeouts.background(configured)
    pool = db.pool(f"{url}?options=-c%20work_mem%3D8MB", name="background", timeouts=background)
    await pool.open(wait=True)
    try:
        async with pool.connection() as worker:
            assert await _show(worker, "lock_timeout") == "20s"
            assert await _show(worker, "statement_timeout") == "0"
            assert await _show(worker, "work_mem") == "8MB"
    finally:
        await pool.close()


async def _show(conn: AsyncConn, name: str) -> str:
    cursor = await conn.execute(f"SHOW {name}")
    row = await cursor.fetchone()
    assert row is not None
    return str(row[name])
