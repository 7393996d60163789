"""Consumers of the event log: an event that commits late is never skipped; one runner per consumer."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.queue.consumers import Consumer, ConsumerRunner, LogEvent, lag_of
from tests.factories import make_instance, walk


async def _recording_table(conn: AsyncConn) -> None:
    await conn.execute("CREATE TABLE seen (event_id bigint PRIMARY KEY, instance_id uuid, seq bigint)")
    await conn.execute("GRANT SELECT, INSERT ON seen TO controlplane_app")


async def record(conn: AsyncConn, event: LogEvent) -> None:
    await conn.execute(
        "INSERT INTO seen VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
        (event.id, event.instance_id, event.seq),
    )


async def _seen(conn: AsyncConn) -> set[int]:
    cursor = await conn.execute("SELECT event_id FROM seen")
    return {row["event_id"] for row in await cursor.fetchall()}


async def _all_events(conn: AsyncConn) -> set[int]:
    cursor = await conn.execute("SELECT id FROM instance_events")
    return {row["id"] for row in await cursor.fetchall()}


async def test_an_event_that_commits_after_a_later_id_is_not_skipped(
    conn: AsyncConn, fresh_database: str, runtime_url: str
) -> None:
    await _recording_table(conn)
    early = await make_instance(conn)
    late = await make_instance(conn)
    pool = db.pool(runtime_url, min_size=1, max_size=3, name="consumer-test")
    await pool.open(wait=True)
    runner = ConsumerRunner(pool, [Consumer("recorder", record)], batch_size=2)
    try:
        assert (await runner.run_once())["recorder"] == 2  # the two creations
        # A transaction takes the next event id and stays open; a later one commits after it.
        holder = await psycopg.AsyncConnection.connect(fresh_database, row_factory=psycopg.rows.dict_row)
        await holder.execute("BEGIN")
        held = await walk(holder, early["id"], "start_provisioning")
        committed = await walk(conn, late["id"], "start_provisioning")
        cursor = await conn.execute(
            "SELECT id, instance_id FROM instance_events WHERE instance_id = ANY(%s) AND seq = 1",
            ([early["id"], late["id"]],),
        )
        ids = {row["instance_id"]: row["id"] for row in await cursor.fetchall()}
        assert early["id"] not in ids  # not visible yet: the holder has not committed
        assert held["state"] == committed["state"] == "provisioning"
        # The committed event has the higher id; reading `id > last` now would step over the other.
        assert (await runner.run_once())["recorder"] == 0
        assert await _seen(conn) == await _all_events(conn) - {ids[late["id"]]}
        lag = await lag_of(conn, "recorder")
        assert lag.events == 1
        await holder.commit()
        await holder.close()
        assert (await runner.run_once())["recorder"] == 2
        everything = await _all_events(conn)
        assert await _seen(conn) == everything and len(everything) == 4
        cursor = await conn.execute(
            "SELECT id FROM instance_events WHERE instance_id = %s AND seq = 1", (early["id"],)
        )
        row = await cursor.fetchone()
        assert row is not None and row["id"] < ids[late["id"]]
        assert (await lag_of(conn, "recorder")).events == 0
        assert (await runner.run_once())["recorder"] == 0
    finally:
        await pool.close()


async def test_one_runner_per_consumer_at_a_time(conn: AsyncConn, runtime_url: str) -> None:
    await _recording_table(conn)
    await make_instance(conn)
    pool = db.pool(runtime_url, min_size=1, max_size=3, name="consumer-test")
    await pool.open(wait=True)
    other = await db.connect(runtime_url)
    try:
        cursor = await other.execute(
            "SELECT pg_try_advisory_lock(hashtextextended('cp_consumer:' || 'recorder', 0))"
        )
        assert (await cursor.fetchone()) is not None
        runner = ConsumerRunner(pool, [Consumer("recorder", record)])
        assert (await runner.run_once())["recorder"] == 0  # another replica holds it
        await other.execute("SELECT pg_advisory_unlock(hashtextextended('cp_consumer:' || 'recorder', 0))")
        assert (await runner.run_once())["recorder"] == 1
    finally:
        await pool.close()
        if not other.closed:
            await other.close()


@pytest.mark.parametrize("batch", [1, 50])
async def test_a_consumer_applies_every_event_once_in_order_per_instance(
    conn: AsyncConn, runtime_url: str, batch: int
) -> None:
    await _recording_table(conn)
    first = await make_instance(conn)
    await walk(conn, first["id"], "start_provisioning", "provisioned", "suspend", "resume")
    second = await make_instance(conn)
    await walk(conn, second["id"], "start_provisioning", "fail")
    pool = db.pool(runtime_url, min_size=1, max_size=2, name="consumer-test")
    await pool.open(wait=True)
    order: list[tuple[uuid.UUID, int]] = []

    async def ordered(c: AsyncConn, event: LogEvent) -> None:
        order.append((event.instance_id, event.seq))
        await record(c, event)

    try:
        runner = ConsumerRunner(pool, [Consumer("recorder", ordered)], batch_size=batch)
        assert (await runner.run_once())["recorder"] == 8
        for instance in (first["id"], second["id"]):
            seqs = [seq for iid, seq in order if iid == instance]
            assert seqs == sorted(seqs)
        assert await _seen(conn) == await _all_events(conn)
    finally:
        await pool.close()
