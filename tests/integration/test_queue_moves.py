"""Queue moves against a real database: enqueue, claim (order, SKIP LOCKED, fences), start, finish, error."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from controlplane.audit import verify as audit
from controlplane.core import lifecycle
from controlplane.core.retry import RetryDecision
from controlplane.db import connection as db
from controlplane.db.job_rows import NewJob, enqueue, enqueue_many, get_job
from controlplane.db.transitions import Actor, VersionConflict, transition
from controlplane.queue import moves as queue
from tests.factories import TEST_ACTOR, make_instance
from tests.operations_support import scalar
from tests.queue_kinds import WORKER, events_of

ACTOR = Actor("worker", WORKER)


async def test_enqueue_commits_with_the_instance_change_or_not_at_all(conn: db.AsyncConn) -> None:
    inst = await make_instance(conn)
    with pytest.raises(RuntimeError):
        async with conn.transaction():
            await transition(
                conn,
                "instance",
                inst["id"],
                "start_provisioning",
                0,
                expected_state="pending",
                actor=TEST_ACTOR,
            )
            await enqueue(conn, NewJob("provision", inst["id"]), TEST_ACTOR)
            raise RuntimeError("the request failed after both writes")
    row = await conn.execute("SELECT state FROM instances WHERE id = %s", (inst["id"],))
    assert (await row.fetchone()) == {"state": "pending"}
    count = await conn.execute("SELECT count(*) AS n FROM jobs")
    assert (await count.fetchone()) == {"n": 0}

    async with conn.transaction():
        await transition(
            conn, "instance", inst["id"], "start_provisioning", 0, expected_state="pending", actor=TEST_ACTOR
        )
        made = await enqueue(conn, NewJob("provision", inst["id"]), TEST_ACTOR)
    assert made.created and made.job["state"] == "queued"
    assert await events_of(conn, made.job["id"]) == [("enqueue", "system", "tests")]


async def test_bulk_enqueue_deduplicates_live_jobs_per_instance_and_kind(conn: db.AsyncConn) -> None:
    a, b = await make_instance(conn), await make_instance(conn)
    first = await enqueue(conn, NewJob("provision", a["id"]), TEST_ACTOR)
    results = await enqueue_many(
        conn,
        [
            NewJob("provision", a["id"]),  # already live
            NewJob("provision", b["id"]),
            NewJob("provision", b["id"]),  # duplicate inside the batch
            NewJob("heal", a["id"]),  # another kind: its own job
            NewJob("noop"),
            NewJob("noop"),  # no instance: never de-duplicated
        ],
        TEST_ACTOR,
    )
    assert [r.created for r in results] == [False, True, False, True, True, True]
    assert results[0].job["id"] == first.job["id"]
    assert results[1].job["id"] == results[2].job["id"]
    count = await conn.execute("SELECT count(*) AS n FROM jobs")
    assert (await count.fetchone()) == {"n": 5}


async def test_claim_takes_due_jobs_by_priority_then_run_at(conn: db.AsyncConn) -> None:
    late = await enqueue(conn, NewJob("noop", priority=100), TEST_ACTOR)
    urgent = await enqueue(conn, NewJob("noop", priority=10), TEST_ACTOR)
    later = await enqueue(conn, NewJob("noop", priority=100), TEST_ACTOR)
    await enqueue(conn, NewJob("noop", priority=1, delay_s=3600), TEST_ACTOR)  # not due
    await enqueue(conn, NewJob("other", priority=1), TEST_ACTOR)  # a kind not asked for
    (first,) = await queue.claim(conn, WORKER, ["noop"], 1)
    assert first["id"] == urgent.job["id"]
    claimed = await queue.claim(conn, WORKER, ["noop"], 10)
    assert [r["id"] for r in claimed] == [late.job["id"], later.job["id"]]
    assert all(r["state"] == "claimed" and r["claimed_by"] == WORKER and r["attempt"] == 1 for r in claimed)
    assert first["fence"] < min(r["fence"] for r in claimed)
    assert len({r["fence"] for r in claimed}) == 2
    assert await queue.claim(conn, WORKER, ["noop"], 10) == []
    assert await events_of(conn, urgent.job["id"]) == [
        ("enqueue", "system", "tests"),
        ("claim", "worker", WORKER),
    ]


async def test_concurrent_claimers_skip_locked_rows_and_never_share_a_job(fresh_database: str) -> None:
    setup = await db.connect(fresh_database)
    async with setup:
        await enqueue_many(setup, [NewJob("noop") for _ in range(400)], TEST_ACTOR)
        holder = await db.connect(fresh_database)
        other = await db.connect(fresh_database)
        async with holder, other:
            # One claimer holds its batch uncommitted: the other skips those rows instead of waiting.
            async with holder.transaction():
                held = await queue.claim(holder, "w-a", ["noop"], 50)
                passed = await asyncio.wait_for(queue.claim(other, "w-b", ["noop"], 50), timeout=5)
            assert len(held) == len(passed) == 50
            assert not {r["id"] for r in held} & {r["id"] for r in passed}

        conns = [await db.connect(fresh_database) for _ in range(6)]

        async def drain(c: db.AsyncConn, name: str) -> list[psycopg.rows.DictRow]:
            got: list[psycopg.rows.DictRow] = []
            while batch := await queue.claim(c, name, ["noop"], 7):
                got += batch
            return got

        try:
            batches = await asyncio.gather(*(drain(c, f"w{i}") for i, c in enumerate(conns)))
        finally:
            for c in conns:
                await c.close()
        ids = [r["id"] for batch in batches for r in batch]
        assert len(ids) == len(set(ids)) == 300
        cursor = await setup.execute(
            "SELECT job_id FROM job_events WHERE event = 'claim' GROUP BY job_id HAVING count(*) > 1"
        )
        assert await cursor.fetchall() == []
        fences = [r["fence"] for r in held + passed] + [r["fence"] for batch in batches for r in batch]
        assert len(set(fences)) == 400
        for batch in batches:  # each claimer sees its fences strictly increase
            own = [r["fence"] for r in batch]
            assert own == sorted(own) and len(set(own)) == len(own)


async def test_every_claim_gets_a_higher_fence(conn: db.AsyncConn) -> None:
    job = (await enqueue(conn, NewJob("noop"), TEST_ACTOR)).job
    fences = []
    for _ in range(3):
        (claimed,) = await queue.claim(conn, WORKER, ["noop"], 1)
        fences.append(claimed["fence"])
        await queue.reclaim_many(conn, [claimed], Actor("supervisor", "s"), "test")
    assert fences == sorted(fences) and len(set(fences)) == 3
    row = await get_job(conn, job["id"])
    assert row is not None and row["attempt"] == 3 and row["claimed_by"] is None


async def test_start_and_finish_are_batched_and_record_the_verdict(conn: db.AsyncConn) -> None:
    await enqueue_many(conn, [NewJob("noop") for _ in range(5)], TEST_ACTOR)
    claimed = await queue.claim(conn, WORKER, ["noop"], 5)
    started = await queue.start_many(conn, claimed, ACTOR)
    assert len(started.moved) == 5 and not started.failed
    assert all(r["state"] == "running" and r["heartbeat_at"] is not None for r in started.moved)
    done = await queue.finish_many(conn, [(row, {"result": "nothing to do"}) for row in started.moved], ACTOR)
    assert len(done.moved) == 5 and not done.failed
    for row in done.moved:
        assert row["state"] == "completed" and row["verdict"] == {"result": "nothing to do"}
        assert row["heartbeat_at"] is None
        assert [e for e, _, _ in await events_of(conn, row["id"])] == ["enqueue", "claim", "start", "finish"]
    # A stale copy cannot finish twice: it conflicts, nothing is written.
    again = await queue.finish_many(conn, [(started.moved[0], {"result": "again"})], ACTOR)
    assert not again.moved and isinstance(again.failed[0], VersionConflict)
    assert await audit.verify(conn) == []


async def test_error_stores_message_kind_attempt_and_retry_time(conn: db.AsyncConn) -> None:
    await enqueue(conn, NewJob("noop"), TEST_ACTOR)
    (claimed,) = await queue.claim(conn, WORKER, ["noop"], 1)
    (running,) = (await queue.start_many(conn, [claimed], ACTOR)).moved
    failure = queue.JobFailure(
        running, "disk full", "temporary", RetryDecision("retry", 30.0, "backoff"), 30.0
    )
    failed = await queue.error(conn, failure, ACTOR)
    assert failed["state"] == "failed"
    assert (failed["last_error"], failed["error_kind"], failed["attempt"]) == ("disk full", "temporary", 1)
    gap = (failed["run_at"] - failed["updated_at"]).total_seconds()
    assert 29 < gap < 31
    cursor = await conn.execute(
        "SELECT reason, detail FROM job_events WHERE job_id = %s AND event = 'error'", (failed["id"],)
    )
    event = await cursor.fetchone()
    assert event is not None and event["reason"] == "disk full"
    assert event["detail"]["attempt"] == 1 and event["detail"]["requested_delay_s"] == 30.0
    with pytest.raises(VersionConflict):
        await queue.error(conn, failure, ACTOR)


def test_operator_actions_are_exactly_the_job_lifecycle_events() -> None:
    for action in queue.OPERATOR_ACTIONS:
        assert action in lifecycle.JOB.events()


async def test_unknown_job_is_reported(conn: db.AsyncConn) -> None:
    with pytest.raises(queue.JobNotFound):
        await queue.pause(conn, uuid.uuid4(), "alice", "checking")


async def test_claim_and_start_takes_reclaimed_work_before_a_backlog_enqueued_with_it(
    conn: db.AsyncConn,
) -> None:
    # One statement: every job has the same run_at, so only the claim's order decides.
    made = await enqueue_many(conn, [NewJob("noop") for _ in range(20)], TEST_ACTOR)
    (first,) = await queue.claim_and_start(conn, "w-dead", ["noop"], 1)
    assert first["state"] == "running" and first["claimed_by"] == "w-dead"
    assert (await queue.reclaim_many(conn, [first], Actor("supervisor", "sup"), "worker died")).moved
    (again,) = await queue.claim_and_start(conn, "w-next", ["noop"], 1)
    assert again["id"] == first["id"] and again["attempt"] == 2
    rest = await queue.claim_and_start(conn, "w-next", ["noop"], 30)
    assert len(rest) == 19 and {r["id"] for r in rest} == {m.job["id"] for m in made} - {first["id"]}
    events = await events_of(conn, first["id"])
    assert [e for e, _, _ in events] == ["enqueue", "claim", "start", "reclaim", "claim", "start"]
    assert await audit.verify(conn) == []


async def test_a_claim_from_a_point_reads_what_sorts_before_fresh_work_but_no_older_fresh_job(
    conn: db.AsyncConn,
) -> None:
    # A worker's claims read fresh work from just before the fresh jobs it claimed last; work that
    # sorts before fresh work (a reclaimed job, a higher priority) is read at every claim, and a
    # fresh job before the point only by a claim from the start of the order.
    await enqueue_many(conn, [NewJob("noop"), NewJob("noop")], TEST_ACTOR)
    (died,) = await queue.claim_and_start(conn, "w-dead", ["noop"], 1)
    assert (await queue.reclaim_many(conn, [died], Actor("supervisor", "sup"), "worker died")).moved
    urgent = (await enqueue(conn, NewJob("noop", priority=10), TEST_ACTOR)).job
    cursor = await conn.execute("SELECT now() + interval '1 hour' AS later")
    row = await cursor.fetchone()
    assert row is not None
    point = queue.ClaimFrom(priority=100, fresh=True, run_at=row["later"])

    taken = await queue.claim_and_start(conn, "w-next", ["noop"], 10, point)
    assert [(r["id"], r["attempt"]) for r in taken] == [(urgent["id"], 1), (died["id"], 2)]
    assert await queue.claim_and_start(conn, "w-next", ["noop"], 10, point) == []
    # The look off the claim path finds that fresh job before the point (of the kinds asked for).
    assert await queue.fresh_before(conn, ["noop"], point)
    assert not await queue.fresh_before(conn, ["other"], point)
    (older,) = await queue.claim_and_start(conn, "w-next", ["noop"], 10)
    assert not await queue.fresh_before(conn, ["noop"], point)
    assert older["attempt"] == 1 and older["id"] not in {urgent["id"], died["id"]}
    assert await audit.verify(conn) == []


async def test_a_claim_from_a_point_in_begun_work_takes_the_begun_work_before_it_too(
    conn: db.AsyncConn,
) -> None:
    # Begun work sorts before fresh work of its priority; from a point inside it, the claim reads
    # the begun work before the point (its own range) and everything from the point on.
    await enqueue_many(conn, [NewJob("noop"), NewJob("noop")], TEST_ACTOR)
    died = await queue.claim_and_start(conn, "w-dead", ["noop"], 2)
    assert len((await queue.reclaim_many(conn, died, Actor("supervisor", "sup"), "worker died")).moved) == 2
    earlier, later = sorted(died, key=lambda job: job["run_at"])
    assert earlier["run_at"] < later["run_at"]
    fresh = (await enqueue(conn, NewJob("noop"), TEST_ACTOR)).job
    point = queue.ClaimFrom(priority=100, fresh=False, run_at=later["run_at"])
    taken = await queue.claim_and_start(conn, "w-next", ["noop"], 10, point)
    assert [r["id"] for r in taken] == [earlier["id"], later["id"], fresh["id"]]
    assert await audit.verify(conn) == []


BACKLOG = 20_000


async def test_a_claim_and_a_look_read_the_index_up_to_their_point_not_the_backlog_behind_it(
    conn: db.AsyncConn,
) -> None:
    # What sorts before a worker's point is read at every claim, and the look reads up to the
    # point: each index scan stops there. Bounded by a row comparison decided by run_at, the scans
    # read every entry of the point's priority, the whole backlog (and under a pinned xmin horizon
    # every dead entry). Counted in index blocks, against the index's size.
    for _ in range(BACKLOG // 1000):
        await enqueue_many(conn, [NewJob("noop") for _ in range(1000)], TEST_ACTOR)
    (first,) = await queue.claim_and_start(conn, "w1", ["noop"], 1)
    point = queue.ClaimFrom.before(first, timedelta(0), most=timedelta(0))
    pages = await scalar(conn, "SELECT pg_relation_size('ix_jobs_queued_order') / 8192")
    assert pages > 40

    async def claim() -> None:
        (taken,) = await queue.claim_and_start(conn, "w1", ["noop"], 1, point)
        assert taken["run_at"] >= first["run_at"]

    async def look() -> None:
        assert not await queue.fresh_before(conn, ["noop"], point, first["run_at"] - timedelta(hours=1))

    for work in (claim, look):
        read = await _index_blocks_read(conn, work)
        assert 0 < read * 8 < pages, (work.__name__, read, pages)
    assert await audit.verify(conn) == []


async def _index_blocks_read(conn: db.AsyncConn, work: Any) -> int:
    """The blocks of ix_jobs_queued_order this session read while `work` ran (its own counts,
    within one transaction: no other session's, autovacuum's included)."""
    fetched = "SELECT pg_stat_get_xact_blocks_fetched('ix_jobs_queued_order'::regclass)"
    async with conn.transaction():
        before = await scalar(conn, fetched)
        await work()
        return int(await scalar(conn, fetched)) - int(before)


async def test_a_claim_returns_its_bound_and_a_claim_from_before_it_takes_the_enqueue_that_committed_late(
    fresh_database: str, conn: db.AsyncConn
) -> None:
    # The claim reads the database's bound before its snapshot: the start of a transaction that has
    # written (its enqueue, invisible to the claim, may commit later with a run_at from before the
    # jobs claimed). A claim from just before that bound takes such a job once it commits.
    writer = await db.connect(fresh_database, autocommit=False)
    async with writer:
        late = (await enqueue(writer, NewJob("noop"), TEST_ACTOR)).job
        write_since = await _transaction_start(writer)
        await enqueue(conn, NewJob("noop"), TEST_ACTOR)
        (seen,) = await queue.claim_and_start(conn, "w1", ["noop"], 10)
        assert seen["_look_from"] == write_since <= late["run_at"] < seen["run_at"]
        point = queue.ClaimFrom.before(seen, timedelta(0), most=timedelta(hours=1))
        assert point.run_at == write_since
        assert await queue.claim_and_start(conn, "w1", ["noop"], 10, point) == []
        await writer.commit()
    (taken,) = await queue.claim_and_start(conn, "w1", ["noop"], 10, point)
    assert taken["id"] == late["id"]
    # With no transaction that has written, the bound is the claim's own start, after its jobs.
    await enqueue(conn, NewJob("noop"), TEST_ACTOR)
    (alone,) = await queue.claim_and_start(conn, "w1", ["noop"], 10, point)
    assert alone["run_at"] < alone["_look_from"]
    assert await audit.verify(conn) == []


async def test_a_look_may_start_where_no_unseen_enqueue_sorts_before_whatever_snapshot_is_open(
    fresh_database: str, conn: db.AsyncConn
) -> None:
    # A worker's look starts where the database said, at the look before, that no job it could not
    # see yet would sort before: held back by a transaction that has written (its enqueue may commit
    # later, with a run_at from before), never by one that only reads (a report's old snapshot).
    reader = await db.connect(fresh_database, autocommit=False)
    writer = await db.connect(fresh_database, autocommit=False)
    async with reader, writer:
        await reader.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        await (await reader.execute("SELECT count(*) FROM jobs")).fetchone()  # its snapshot taken
        read_since = await _transaction_start(reader)
        assert await queue.look_from(conn) > read_since
        late = (await enqueue(writer, NewJob("noop"), TEST_ACTOR)).job
        write_since = await _transaction_start(writer)
        bound = await queue.look_from(conn)
        assert read_since < bound == write_since <= late["run_at"]
        await writer.commit()
        # Committed now, before a worker's point: a look from the bound finds it, one from after
        # its run_at does not, and the bound has moved past it.
        point = queue.ClaimFrom(priority=100, fresh=True, run_at=late["run_at"] + timedelta(hours=1))
        assert await queue.fresh_before(conn, ["noop"], point, bound)
        assert not await queue.fresh_before(conn, ["noop"], point, late["run_at"] + timedelta(microseconds=1))
        assert await queue.look_from(conn) > late["run_at"]


async def _transaction_start(conn: db.AsyncConn) -> Any:
    row = await (await conn.execute("SELECT now() AS t")).fetchone()
    assert row is not None
    return row["t"]
