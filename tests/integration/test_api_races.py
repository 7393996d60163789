"""Faults to prove: a PATCH racing a billing suspension, and a password that never leaks."""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid

import httpx
import pytest

from controlplane.audit import verify as audit
from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor, VersionConflict, transition
from controlplane.runtime.settings import Settings
from tests.api_support import Tenant, create, deliver, drive, make_ready, stripe_event

pytest_plugins = ("tests.api_fixtures",)


async def _live_jobs(conn: AsyncConn, instance_id: str) -> dict[str, object]:
    cursor = await conn.execute(
        "SELECT kind, id FROM jobs WHERE instance_id = %s AND state = 'queued'", (instance_id,)
    )
    return {r["kind"]: r["id"] for r in await cursor.fetchall()}


async def test_patch_and_billing_suspension_race_one_transition_wins(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, fresh_database: str, api_settings: Settings
) -> None:
    made = await create(client, tenant, "orders")
    await make_ready(conn, api_settings, made["id"])
    patch, hook = await asyncio.gather(
        client.patch(f"/v1/instances/{made['id']}", json={"plan": "small"}, headers=tenant.headers),
        deliver(client, stripe_event("evt_race", tenant.stripe_customer_id, "unpaid", 100)),
    )
    assert patch.status_code == 202 and hook.json()["outcome"] == "hold"
    jobs = await _live_jobs(conn, made["id"])
    assert {"update", "suspend"} <= set(jobs)  # both intents recorded, each as its job

    # Two workers run the two jobs at once; each moves the ready instance it read at version 2.
    async def worker_moves(event: str, worker: str) -> str:
        own = await db.connect(fresh_database)
        async with own:
            try:
                await transition(
                    own,
                    "instance",
                    uuid.UUID(made["id"]),
                    event,
                    2,
                    expected_state="ready",
                    actor=Actor("worker", worker),
                )
            except VersionConflict:
                return "conflict"
            return "moved"

    outcomes = await asyncio.gather(worker_moves("update", "w-update"), worker_moves("suspend", "w-suspend"))
    assert sorted(outcomes) == ["conflict", "moved"]
    shown = (await client.get(f"/v1/instances/{made['id']}", headers=tenant.headers)).json()
    assert shown["state"] in ("updating", "suspended") and shown["state_version"] == 3
    assert shown["spec_generation"] == 2 and shown["billing_hold"] is True
    cursor = await conn.execute(
        "SELECT count(*) AS n FROM instance_events WHERE instance_id = %s AND state_version = 3",
        (made["id"],),
    )
    assert (await cursor.fetchone()) == {"n": 1}
    assert await audit.verify(conn) == []


async def test_a_generated_password_never_appears_in_logs_audit_rows_or_job_payloads(
    client: httpx.AsyncClient,
    tenant: Tenant,
    conn: AsyncConn,
    api_settings: Settings,
    admin_headers: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    password = secrets.token_urlsafe(24)
    caplog.set_level(logging.DEBUG)
    made = await create(client, tenant, "orders")
    await make_ready(conn, api_settings, made["id"], password=password)
    shown = await client.get(f"/v1/instances/{made['id']}", headers=tenant.headers)
    assert shown.json()["connection"]["password"] == password  # the one place it is shown
    other_responses = [
        await client.get("/v1/instances", headers=tenant.headers),
        await client.patch(f"/v1/instances/{made['id']}", json={"plan": "small"}, headers=tenant.headers),
        await client.get(f"/v1/instances/{made['id']}/events", headers=tenant.headers),
        await client.get("/v1/admin/events", headers=admin_headers),
        await client.get("/v1/admin/jobs", headers=admin_headers),
        await deliver(client, stripe_event("evt_pw", tenant.stripe_customer_id, "unpaid", 100)),
    ]
    await drive(conn, made["id"], "suspend", suspended_by_billing=True)
    other_responses.append(await client.delete(f"/v1/instances/{made['id']}", headers=tenant.headers))
    for response in other_responses:
        assert response.status_code < 300, response.text
        assert password not in response.text
    assert password not in caplog.text
    assert all(password not in str(record.__dict__) for record in caplog.records)
    for query in (
        "SELECT reason, detail::text AS detail FROM instance_events",
        "SELECT payload::text AS payload, last_error, verdict::text AS verdict FROM jobs",
        "SELECT reason, detail::text AS detail FROM job_events",
        "SELECT connection::text AS connection, spec::text AS spec, failure_reason FROM instances",
        "SELECT response::text AS response, headers::text AS headers FROM idempotency_keys",
        "SELECT * FROM stripe_events",
    ):
        rows = await (await conn.execute(query)).fetchall()
        assert rows or "idempotency" in query or "stripe" in query
        assert password not in repr(rows), query
    cursor = await conn.execute("SELECT secret FROM instances WHERE id = %s", (made["id"],))
    row = await cursor.fetchone()
    assert row is not None and password.encode() not in bytes(row["secret"])  # encrypted at rest


async def test_patch_and_billing_suspension_through_the_real_operations(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn, fresh_database: str, api_settings: Settings
) -> None:
    """The same race, run by the instance operations: one moves first, the other defers or follows."""
    from controlplane.handlers.operations import Operations
    from controlplane.queue import moves as queue
    from controlplane.queue.registry import JobContext
    from provisioners.noop import NoopProvisioner

    made = await create(client, tenant, "orders")
    await make_ready(conn, api_settings, made["id"])
    await asyncio.gather(
        client.patch(f"/v1/instances/{made['id']}", json={"plan": "small"}, headers=tenant.headers),
        deliver(client, stripe_event("evt_ops", tenant.stripe_customer_id, "unpaid", 100)),
    )
    claimed = await queue.claim(conn, "w-race", ["update", "suspend"], 10)
    started = (await queue.start_many(conn, claimed, Actor("worker", "w-race"))).moved
    assert sorted(j["kind"] for j in started) == ["suspend", "update"]
    operations = Operations(NoopProvisioner())
    pool = db.pool(fresh_database, max_size=4)
    await pool.open()
    try:
        contexts = {j["kind"]: JobContext(j, "w-race", pool, api_settings) for j in started}
        verdicts = await asyncio.gather(
            operations.update(contexts["update"]), operations.suspend(contexts["suspend"])
        )
    finally:
        await pool.close()
    results = sorted(str(v["result"]) for v in verdicts)
    assert results in (["ready", "suspended"], ["deferred", "ready"], ["deferred", "suspended"]), verdicts
    cursor = await conn.execute(
        "SELECT event, state_version FROM instance_events WHERE instance_id = %s AND state_version > 2"
        " ORDER BY id",
        (made["id"],),
    )
    moves = [r["event"] for r in await cursor.fetchall()]
    assert moves[0] in ("update", "suspend")  # exactly one first move out of ready v2
    shown = (await client.get(f"/v1/instances/{made['id']}", headers=tenant.headers)).json()
    assert shown["state"] in ("ready", "suspended") and shown["billing_hold"] is True
    assert await audit.verify(conn) == []
