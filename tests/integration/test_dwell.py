"""Dwell-time statistics per state from the event logs."""

from __future__ import annotations

import pytest

from controlplane.audit import dwell
from controlplane.db import connection as db
from controlplane.db.job_rows import NewJob, enqueue_many
from controlplane.db.transitions import Actor, transition
from controlplane.queue import moves as queue
from tests.factories import TEST_ACTOR, append_event, make_instance
from tests.queue_kinds import WORKER


async def _job_with_history(conn: db.AsyncConn, history: list[tuple[str | None, str, str, float]]) -> None:
    """A job row and its events at chosen ages (seconds ago): (from, to, event, age).

    One transaction, so every age is counted from the same now(): the stays between its events
    are exactly the differences of their ages."""
    async with conn.transaction():
        cursor = await conn.execute("INSERT INTO jobs (kind, state) VALUES ('noop', 'queued') RETURNING id")
        row = await cursor.fetchone()
        assert row is not None
        for version, (src, dst, event, age) in enumerate(history):
            await append_event(conn, "job", row["id"], src, dst, event, version, actor=TEST_ACTOR, age_s=age)


async def test_dwell_per_state_from_consecutive_events(conn: db.AsyncConn) -> None:
    await _job_with_history(
        conn,
        [
            (None, "queued", "enqueue", 100),
            ("queued", "claimed", "claim", 90),
            ("claimed", "running", "start", 88),
            ("running", "completed", "finish", 80),
        ],
    )
    await _job_with_history(
        conn,
        [
            (None, "queued", "enqueue", 100),
            ("queued", "claimed", "claim", 97),
            ("claimed", "running", "start", 96),
        ],
    )
    await _job_with_history(conn, [(None, "queued", "enqueue", 50)])
    stats = {s.state: s for s in await dwell.dwell_stats(conn, "job")}
    assert list(stats) == ["queued", "claimed", "running"]  # lifecycle order; terminal states are no stay
    queued, claimed, running = stats["queued"], stats["claimed"], stats["running"]
    assert (queued.count, queued.current) == (3, 1)
    assert queued.p50_s == pytest.approx(10, abs=0.01)
    assert queued.max_s == pytest.approx(50, abs=1)  # still queued: measured to now
    assert (claimed.count, claimed.current) == (2, 0)
    assert claimed.p50_s == pytest.approx(1.5, abs=0.01) and claimed.max_s == pytest.approx(2, abs=0.01)
    assert claimed.p95_s == pytest.approx(1.95, abs=0.01)
    assert (running.count, running.current) == (2, 1)
    assert running.max_s == pytest.approx(96, abs=1)


async def test_dwell_of_real_job_and_instance_flows(conn: db.AsyncConn) -> None:
    await enqueue_many(conn, [NewJob("noop") for _ in range(4)], TEST_ACTOR)
    claimed = await queue.claim(conn, WORKER, ["noop"], 3)
    started = await queue.start_many(conn, claimed[:2], Actor("worker", WORKER))
    await queue.finish_many(conn, [(started.moved[0], {"result": "ok"})], Actor("worker", WORKER))
    stats = {s.state: (s.count, s.current) for s in await dwell.dwell_stats(conn, "job")}
    assert stats == {"queued": (4, 1), "claimed": (3, 1), "running": (2, 1)}

    inst = await make_instance(conn)
    await make_instance(conn)
    await transition(
        conn, "instance", inst["id"], "start_provisioning", 0, expected_state="pending", actor=TEST_ACTOR
    )
    stats = {s.state: (s.count, s.current) for s in await dwell.dwell_stats(conn, "instance")}
    assert stats == {"pending": (2, 1), "provisioning": (1, 1)}


async def test_unknown_entity_is_refused(conn: db.AsyncConn) -> None:
    with pytest.raises(ValueError):
        await dwell.dwell_stats(conn, "widget")
