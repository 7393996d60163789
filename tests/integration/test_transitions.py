"""The one transition path on a real server: results, audit rows, conflicts, races, heartbeats."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest
from psycopg.rows import DictRow

from controlplane.audit import verify as audit
from controlplane.core.lifecycle import IllegalTransition
from controlplane.db import connection as db
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.job_rows import NewJob, enqueue, get_job
from controlplane.db.transitions import (
    Actor,
    InvariantViolation,
    Move,
    VersionConflict,
    heartbeat,
    transition,
    transition_many,
)
from tests.factories import TEST_ACTOR, make_instance

WORKER = Actor("worker", "worker-1")
SUPERVISOR = Actor("supervisor", "supervisor-1")


async def fetch_all(conn: AsyncConn, query: str, params: Any = None) -> list[DictRow]:
    cursor = await conn.execute(query, params)
    return await cursor.fetchall()


async def events_of(conn: AsyncConn, entity: str, entity_id: uuid.UUID) -> list[DictRow]:
    table, fk = ("instance_events", "instance_id") if entity == "instance" else ("job_events", "job_id")
    return await fetch_all(conn, f"SELECT * FROM {table} WHERE {fk} = %s ORDER BY id", (entity_id,))


async def row_of(conn: AsyncConn, entity: str, entity_id: uuid.UUID) -> DictRow:
    table = "instances" if entity == "instance" else "jobs"
    (row,) = await fetch_all(conn, f"SELECT * FROM {table} WHERE id = %s", (entity_id,))
    return row


async def claim(conn: AsyncConn, worker: str, kinds: list[str]) -> list[DictRow]:
    return await fetch_all(
        conn,
        sql.CLAIM_JOBS,
        {
            "kinds": kinds,
            "limit": 10,
            "worker": worker,
            "actor_kind": "worker",
            "actor_id": worker,
            "request_id": None,
        },
    )


async def step(conn: AsyncConn, entity: str, row: DictRow, event: str, actor: Actor = TEST_ACTOR) -> DictRow:
    """Move `row` by `event` from where it is now."""
    return await transition(
        conn, entity, row["id"], event, row["state_version"], expected_state=row["state"], actor=actor
    )


async def test_transition_returns_the_new_row_and_writes_one_event(conn: AsyncConn) -> None:
    inst = await make_instance(conn)
    row = await transition(
        conn,
        "instance",
        inst["id"],
        "start_provisioning",
        0,
        expected_state="pending",
        actor=WORKER,
        reason="picked up by a worker",
        detail={"job": "provision", "attempt": 1},
        request_id="req-42",
    )
    assert (row["id"], row["state"], row["state_version"]) == (inst["id"], "provisioning", 1)
    assert row["state_entered_at"] >= inst["state_entered_at"]
    assert row["spec"] == inst["spec"] and row["name"] == inst["name"]
    assert row == await row_of(conn, "instance", inst["id"]) | {
        k: v for k, v in row.items() if k.startswith("_")
    }

    creation, move = await events_of(conn, "instance", inst["id"])
    assert (creation["event"], creation["state_version"]) == ("create", 0)
    assert int(move["xid"]) > 0  # the writing transaction, for the consumers' positions
    assert {k: move[k] for k in move if k not in ("id", "at", "hash", "xid")} == {
        "instance_id": inst["id"],
        "from_state": "pending",
        "to_state": "provisioning",
        "event": "start_provisioning",
        "actor_kind": "worker",
        "actor_id": "worker-1",
        "reason": "picked up by a worker",
        "detail": {"job": "provision", "attempt": 1},
        "request_id": "req-42",
        "state_version": 1,
        "seq": 1,
        "prev_hash": creation["hash"],
    }
    # The row keeps its chain head: the event just written.
    assert (row["chain_seq"], row["chain_head"]) == (1, move["hash"])
    assert move["at"] == row["state_entered_at"]


async def test_job_transition_writes_its_own_event_row(conn: AsyncConn) -> None:
    job = (await enqueue(conn, NewJob("probe"), TEST_ACTOR)).job
    moved = await step(conn, "job", job, "claim", WORKER)
    assert (moved["state"], moved["state_version"]) == ("claimed", 1)
    assert moved["heartbeat_at"] is not None
    events = await events_of(conn, "job", job["id"])
    assert [(e["from_state"], e["to_state"], e["event"], e["state_version"]) for e in events] == [
        (None, "queued", "enqueue", 0),
        ("queued", "claimed", "claim", 1),
    ]
    assert events[1]["detail"] == {} and events[1]["actor_id"] == "worker-1"


async def test_a_moved_version_raises_conflict_and_writes_nothing(conn: AsyncConn) -> None:
    inst = await make_instance(conn)
    await step(conn, "instance", inst, "start_provisioning")
    before_row = await row_of(conn, "instance", inst["id"])
    before_events = await events_of(conn, "instance", inst["id"])
    with pytest.raises(VersionConflict) as caught:
        await transition(conn, "instance", inst["id"], "fail", 0, expected_state="pending", actor=TEST_ACTOR)
    assert (caught.value.current_state, caught.value.current_version) == ("provisioning", 1)
    assert "version 0" in str(caught.value) and str(inst["id"]) in str(caught.value)
    assert await row_of(conn, "instance", inst["id"]) == before_row
    assert await events_of(conn, "instance", inst["id"]) == before_events


async def test_a_missing_row_is_a_conflict(conn: AsyncConn) -> None:
    missing = uuid.uuid4()
    with pytest.raises(VersionConflict, match="no longer exists") as caught:
        await transition(conn, "job", missing, "claim", 0, expected_state="queued", actor=TEST_ACTOR)
    assert caught.value.current_state is None and caught.value.current_version is None


async def test_same_version_other_state_is_an_invariant_violation(
    conn: AsyncConn, caplog: pytest.LogCaptureFixture
) -> None:
    inst = await make_instance(conn)
    await conn.execute("ALTER TABLE instances DISABLE TRIGGER instances_guard_state")
    await conn.execute("UPDATE instances SET state = 'ready' WHERE id = %s", (inst["id"],))
    await conn.execute("ALTER TABLE instances ENABLE TRIGGER instances_guard_state")
    before_events = await events_of(conn, "instance", inst["id"])

    with (
        caplog.at_level(logging.CRITICAL, logger="controlplane.db.transitions"),
        pytest.raises(InvariantViolation) as caught,
    ):
        await transition(
            conn, "instance", inst["id"], "start_provisioning", 0, expected_state="pending", actor=TEST_ACTOR
        )
    assert not isinstance(caught.value, VersionConflict)
    assert caught.value.current_state == "ready"
    critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(critical) == 1
    assert str(inst["id"]) in critical[0].getMessage() and "'ready'" in critical[0].getMessage()
    assert await events_of(conn, "instance", inst["id"]) == before_events
    row = await row_of(conn, "instance", inst["id"])
    assert (row["state"], row["state_version"]) == ("ready", 0)


async def test_illegal_transition_is_refused_before_any_sql(fresh_database: str) -> None:
    conn = await db.connect(fresh_database)
    async with conn:
        inst = await make_instance(conn)
    assert conn.closed  # any statement on this connection would now fail with OperationalError
    with pytest.raises(IllegalTransition, match="start_provisioning"):
        await transition(
            conn, "instance", inst["id"], "start_provisioning", 0, expected_state="ready", actor=TEST_ACTOR
        )
    good = Move(inst["id"], "pending", 0, "start_provisioning")
    bad = Move(inst["id"], "deleted", 5, "recover")
    with pytest.raises(IllegalTransition) as caught:
        await transition_many(conn, "instance", [good, bad], TEST_ACTOR)
    assert (caught.value.entity, caught.value.entity_id, caught.value.state) == (
        "instance",
        inst["id"],
        "deleted",
    )


async def test_illegal_move_in_a_batch_moves_nothing(conn: AsyncConn) -> None:
    inst = await make_instance(conn)
    good = Move(inst["id"], "pending", 0, "start_provisioning")
    bad = Move(inst["id"], "pending", 0, "provisioned")
    with pytest.raises(IllegalTransition):
        await transition_many(conn, "instance", [good, bad], TEST_ACTOR)
    row = await row_of(conn, "instance", inst["id"])
    assert (row["state"], row["state_version"]) == ("pending", 0)
    assert len(await events_of(conn, "instance", inst["id"])) == 1


async def test_transition_notifies_the_new_state(conn: AsyncConn, fresh_database: str) -> None:
    inst = await make_instance(conn)
    listener = await db.connect(fresh_database)
    async with listener:
        await listener.execute("LISTEN cp_instance_provisioning")
        await step(conn, "instance", inst, "start_provisioning")
        received = [n async for n in listener.notifies(timeout=5, stop_after=1)]
    assert [(n.channel, n.payload) for n in received] == [("cp_instance_provisioning", f"{inst['id']}:1")]


async def test_a_batch_notifies_once_per_moved_row(conn: AsyncConn, fresh_database: str) -> None:
    jobs = [(await enqueue(conn, NewJob("probe"), TEST_ACTOR)).job for _ in range(3)]
    listener = await db.connect(fresh_database)
    async with listener:
        await listener.execute("LISTEN cp_job_claimed")
        moves = [Move(job["id"], "queued", 0, "claim") for job in jobs]
        result = await transition_many(conn, "job", moves, WORKER)
        assert len(result.moved) == 3
        received = [n async for n in listener.notifies(timeout=5, stop_after=3)]
    assert sorted(n.payload for n in received) == sorted(f"{job['id']}:1" for job in jobs)


async def test_transition_many_returns_moved_rows_and_failures(conn: AsyncConn) -> None:
    first, second, stale = [await make_instance(conn) for _ in range(3)]
    stale_now = await step(conn, "instance", stale, "start_provisioning")
    missing = uuid.uuid4()
    moves = [
        Move(first["id"], "pending", 0, "start_provisioning", reason="batch"),
        Move(stale["id"], "pending", 0, "start_provisioning"),
        Move(second["id"], "pending", 0, "fail", reason="quota", patch={"failure_reason": "quota"}),
        Move(missing, "pending", 0, "fail"),
    ]
    result = await transition_many(conn, "instance", moves, TEST_ACTOR, request_id="batch-1")

    moved = {row["id"]: row for row in result.moved}
    assert set(moved) == {first["id"], second["id"]}
    assert (moved[first["id"]]["state"], moved[first["id"]]["state_version"]) == ("provisioning", 1)
    assert (moved[second["id"]]["state"], moved[second["id"]]["failure_reason"]) == ("failed", "quota")
    assert all(isinstance(f, VersionConflict) for f in result.failed)
    failures = {f.move.id: f for f in result.failed if isinstance(f, VersionConflict)}
    assert set(failures) == {stale["id"], missing}
    assert (failures[stale["id"]].current_state, failures[stale["id"]].current_version) == ("provisioning", 1)
    assert failures[missing].current_state is None

    assert await row_of(conn, "instance", stale["id"]) == await row_of(conn, "instance", stale_now["id"])
    assert len(await events_of(conn, "instance", stale["id"])) == 2
    for inst in (first, second):
        _, move = await events_of(conn, "instance", inst["id"])
        assert move["request_id"] == "batch-1" and move["state_version"] == 1
    assert await audit.verify(conn) == []


async def test_two_moves_of_one_row_in_a_batch_one_moves_one_fails(conn: AsyncConn) -> None:
    inst = await make_instance(conn)
    first = Move(inst["id"], "pending", 0, "start_provisioning")
    result = await transition_many(conn, "instance", [first, first], TEST_ACTOR)
    assert len(result.moved) == 1 and len(result.failed) == 1
    assert isinstance(result.failed[0], VersionConflict) and result.failed[0].current_version == 1

    provisioned = Move(inst["id"], "provisioning", 1, "provisioned")
    failed = Move(inst["id"], "provisioning", 1, "fail")
    result = await transition_many(conn, "instance", [provisioned, failed], TEST_ACTOR)
    assert len(result.moved) == 1 and len(result.failed) == 1
    (row,) = result.moved
    (lost,) = result.failed
    assert isinstance(lost, VersionConflict) and lost.move.event != row["_event"]
    assert (lost.current_state, lost.current_version) == (row["state"], 2)
    assert len(await events_of(conn, "instance", inst["id"])) == 3
    assert await audit.verify(conn) == []


async def test_transition_many_of_nothing_does_nothing(conn: AsyncConn) -> None:
    result = await transition_many(conn, "job", [], TEST_ACTOR)
    assert (result.moved, result.failed) == ([], [])


async def test_heartbeat_touches_only_heartbeat_at(conn: AsyncConn) -> None:
    job = (await enqueue(conn, NewJob("probe"), TEST_ACTOR)).job
    (claimed,) = await claim(conn, "worker-1", ["probe"])
    assert claimed["id"] == job["id"] and claimed["fence"] is not None
    await conn.execute("UPDATE jobs SET heartbeat_at = now() - interval '1 hour' WHERE id = %s", (job["id"],))
    before = await row_of(conn, "job", job["id"])
    events_before = await events_of(conn, "job", job["id"])

    held = await heartbeat(conn, "worker-1", {job["id"]: claimed["fence"]})

    assert held == {job["id"]}
    after = await row_of(conn, "job", job["id"])
    assert after["heartbeat_at"] > before["heartbeat_at"]
    assert {k: v for k, v in after.items() if k != "heartbeat_at"} == {
        k: v for k, v in before.items() if k != "heartbeat_at"
    }
    assert after["state_version"] == claimed["state_version"] == 1
    assert await events_of(conn, "job", job["id"]) == events_before


async def test_a_heartbeat_does_not_wait_for_a_row_another_writer_holds(
    conn: AsyncConn, fresh_database: str
) -> None:
    """A worker's batch of finishes and its heartbeat run on two connections; when each held a
    row the other needed next, both waited (a deadlock, a second lost). A heartbeat skips a row
    another transaction holds locked: reported as held, beaten next time."""
    first = (await enqueue(conn, NewJob("probe"), TEST_ACTOR)).job
    second = (await enqueue(conn, NewJob("probe"), TEST_ACTOR)).job
    claimed = {row["id"]: row["fence"] for row in await claim(conn, "worker-1", ["probe"])}
    assert set(claimed) == {first["id"], second["id"]}
    await conn.execute("UPDATE jobs SET heartbeat_at = now() - interval '1 hour'")
    other = await db.connect(fresh_database)
    try:
        await other.set_autocommit(False)
        await other.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (first["id"],))
        await conn.execute("SET lock_timeout = '2s'")  # the heartbeat used to wait for the lock
        assert await heartbeat(conn, "worker-1", claimed) == set(claimed)
        beaten = await fetch_all(conn, "SELECT id FROM jobs WHERE heartbeat_at > now() - interval '1 minute'")
        assert [row["id"] for row in beaten] == [second["id"]]
    finally:
        # The lock is gone once the rollback is answered (a close alone returns before the server
        # has ended the transaction, and the next heartbeat could still find the row held).
        await other.rollback()
        await other.close()
        await conn.execute("RESET lock_timeout")
    assert await heartbeat(conn, "worker-1", claimed) == set(claimed)
    beaten = await fetch_all(conn, "SELECT id FROM jobs WHERE heartbeat_at > now() - interval '1 minute'")
    assert {row["id"] for row in beaten} == set(claimed)


async def test_heartbeat_reports_a_lost_job(conn: AsyncConn) -> None:
    job = (await enqueue(conn, NewJob("probe"), TEST_ACTOR)).job
    (claimed,) = await claim(conn, "worker-1", ["probe"])
    fence = claimed["fence"]
    assert await heartbeat(conn, "worker-1", {job["id"]: fence}) == {job["id"]}
    assert await heartbeat(conn, "worker-2", {job["id"]: fence}) == set()
    assert await heartbeat(conn, "worker-1", {job["id"]: fence + 1000}) == set()
    assert await heartbeat(conn, "worker-1", {}) == set()

    await step(conn, "job", claimed, "reclaim", SUPERVISOR)
    assert await heartbeat(conn, "worker-1", {job["id"]: fence}) == set()

    (again,) = await claim(conn, "worker-1", ["probe"])
    assert again["fence"] > fence
    assert await heartbeat(conn, "worker-1", {job["id"]: fence}) == set()
    assert await heartbeat(conn, "worker-1", {job["id"]: again["fence"]}) == {job["id"]}
    other = (await enqueue(conn, NewJob("probe"), TEST_ACTOR)).job
    (other_claimed,) = await claim(conn, "worker-1", ["probe"])
    assert other_claimed["id"] == other["id"]
    holdings = {job["id"]: fence, other["id"]: other_claimed["fence"]}
    assert await heartbeat(conn, "worker-1", holdings) == {other["id"]}
    row = await row_of(conn, "job", job["id"])
    assert row["state_version"] == again["state_version"] == 3


async def wait_until_blocked(monitor: AsyncConn, pids: list[int]) -> None:
    """Return once every backend in `pids` waits on a lock (polls the server, never a clock)."""
    while True:
        cursor = await monitor.execute(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE pid = ANY(%s) AND wait_event_type = 'Lock'",
            (pids,),
        )
        row = await cursor.fetchone()
        assert row is not None
        if row["n"] == len(pids):
            return


async def test_sixteen_concurrent_writers_exactly_one_wins(conn: AsyncConn, fresh_database: str) -> None:
    inst = await make_instance(conn)
    writers = [await db.connect(fresh_database) for _ in range(16)]
    locker = await db.connect(fresh_database)
    try:
        # Hold the row so that all sixteen statements are queued on it when it is released.
        async with locker.transaction():
            await locker.execute("SELECT 1 FROM instances WHERE id = %s FOR UPDATE", (inst["id"],))
            racers = [
                asyncio.ensure_future(
                    transition(
                        writer,
                        "instance",
                        inst["id"],
                        "start_provisioning",
                        0,
                        expected_state="pending",
                        actor=Actor("worker", f"worker-{i}"),
                    )
                )
                for i, writer in enumerate(writers)
            ]
            await asyncio.wait_for(
                wait_until_blocked(conn, [writer.info.backend_pid for writer in writers]), timeout=30
            )
            assert not any(racer.done() for racer in racers)
        outcomes = await asyncio.gather(*racers, return_exceptions=True)
    finally:
        for writer in [*writers, locker]:
            await writer.close()

    winners = [i for i, outcome in enumerate(outcomes) if not isinstance(outcome, BaseException)]
    conflicts = [outcome for outcome in outcomes if isinstance(outcome, VersionConflict)]
    assert len(winners) == 1 and len(conflicts) == 15, outcomes
    assert all((c.current_state, c.current_version) == ("provisioning", 1) for c in conflicts)
    moves = await fetch_all(
        conn,
        "SELECT * FROM instance_events WHERE instance_id = %s AND event = 'start_provisioning'",
        (inst["id"],),
    )
    assert len(moves) == 1
    assert (moves[0]["actor_id"], moves[0]["state_version"]) == (f"worker-{winners[0]}", 1)
    row = await row_of(conn, "instance", inst["id"])
    assert (row["state"], row["state_version"]) == ("provisioning", 1)
    assert await audit.verify(conn) == []


async def test_stale_worker_finish_loses_to_supervisor_reclaim(conn: AsyncConn) -> None:
    """The sequence diagram of the job write-up: both hold version 7; reclaim lands first."""
    job = (await enqueue(conn, NewJob("provision"), TEST_ACTOR)).job
    (row,) = await claim(conn, "worker-1", ["provision"])
    for event in ("start", "pause", "resume"):
        row = await step(conn, "job", row, event, WORKER)
    row = await step(conn, "job", row, "reclaim", SUPERVISOR)
    (row,) = await claim(conn, "worker-1", ["provision"])
    row = await step(conn, "job", row, "start", WORKER)
    assert (row["state"], row["state_version"]) == ("running", 7)

    worker_view = await get_job(conn, job["id"])
    supervisor_view = await get_job(conn, job["id"])
    assert worker_view is not None and supervisor_view is not None
    assert worker_view["state_version"] == supervisor_view["state_version"] == 7

    reclaimed = await transition(
        conn,
        "job",
        job["id"],
        "reclaim",
        supervisor_view["state_version"],
        expected_state=supervisor_view["state"],
        actor=SUPERVISOR,
        reason="heartbeat stale",
    )
    assert (reclaimed["state"], reclaimed["state_version"], reclaimed["claimed_by"]) == ("queued", 8, None)
    after_reclaim = await row_of(conn, "job", job["id"])
    events_after_reclaim = await events_of(conn, "job", job["id"])

    with pytest.raises(VersionConflict) as caught:
        await transition(
            conn,
            "job",
            job["id"],
            "finish",
            worker_view["state_version"],
            expected_state=worker_view["state"],
            actor=WORKER,
            patch={"verdict": {"result": "done"}},
        )
    assert (caught.value.current_state, caught.value.current_version) == ("queued", 8)
    assert await row_of(conn, "job", job["id"]) == after_reclaim
    assert await events_of(conn, "job", job["id"]) == events_after_reclaim
    assert [e["event"] for e in events_after_reclaim].count("finish") == 0
    assert await audit.verify(conn) == []
