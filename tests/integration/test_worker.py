"""The worker runtime in process: batching, wake-ups, retries, heartbeat loss, fencing, graceful stop."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from controlplane.audit import verify as audit
from controlplane.db import connection as db
from controlplane.db import transitions
from controlplane.db.job_rows import NewJob, enqueue, enqueue_many, get_job
from controlplane.db.transitions import Actor, VersionConflict
from controlplane.queue import moves as queue
from controlplane.queue import worker as worker_module
from controlplane.queue.registry import JobKind, JobRegistry
from controlplane.queue.supervisor import Supervisor
from controlplane.queue.worker import Worker
from controlplane.runtime.fencing import FileFences
from controlplane.runtime.settings import Settings
from tests.factories import TEST_ACTOR
from tests.queue_kinds import (
    Gates,
    build_registry,
    count_in,
    db_now,
    events_of,
    gate,
    gate_registry,
    running_job,
    until,
)
from tests.support import eventually


@pytest.fixture
async def pool(fresh_database: str) -> AsyncIterator[Any]:
    p = db.pool(fresh_database, max_size=12)
    async with p:
        yield p


class Running:
    """A Worker running as a task of the test's event loop."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.task = asyncio.create_task(worker.run())

    async def stop(self) -> None:
        self.worker.request_stop()
        await asyncio.wait_for(self.task, timeout=20)


def start_worker(
    name: str,
    settings: Settings,
    pool: Any,
    registry: JobRegistry | None = None,
    services: Mapping[str, Any] | None = None,
    **changes: Any,
) -> Running:
    tuned = settings.replace(**{"shutdown_grace_s": 0.5, "worker_concurrency": 8, **changes})
    return Running(Worker(name, tuned, pool, registry or build_registry(), services=services))


async def test_worker_runs_jobs_translates_errors_and_batches_writes(
    fresh_database: str, settings: Settings, pool: Any, conn: db.AsyncConn
) -> None:
    await enqueue_many(conn, [NewJob("noop") for _ in range(24)], TEST_ACTOR)
    bad = await enqueue_many(
        conn,
        [
            NewJob("always_fail", payload={"delay_s": 42}),
            NewJob("permanent_fail"),
            NewJob("crash"),
            NewJob("bad_verdict"),
        ],
        TEST_ACTOR,
    )
    running = start_worker("w1", settings, pool)
    await until(fresh_database, count_in("completed", 24))
    await until(fresh_database, count_in("failed", 4))
    await running.stop()
    assert running.worker.counts["completed"] == 24 and running.worker.counts["failed"] == 4

    rows = {r.job["kind"]: await get_job(conn, r.job["id"]) for r in bad}
    temporary, permanent, crash = rows["always_fail"], rows["permanent_fail"], rows["crash"]
    assert temporary is not None and permanent is not None and crash is not None
    assert (temporary["error_kind"], temporary["attempt"]) == ("temporary", 1)
    assert temporary["last_error"] == "failure on attempt 1"
    assert 41 < (temporary["run_at"] - temporary["updated_at"]).total_seconds() < 43
    assert (permanent["error_kind"], permanent["last_error"]) == ("permanent", "this can never work")
    assert (crash["error_kind"], crash["last_error"]) == ("temporary", "RuntimeError: unexpected bug")
    unrecordable = rows["bad_verdict"]
    assert unrecordable is not None and "not JSON" in unrecordable["last_error"]

    cursor = await conn.execute(
        "SELECT event, count(*) AS n, count(DISTINCT at) AS statements FROM job_events"
        " WHERE event IN ('start', 'finish') GROUP BY event"
    )
    for row in await cursor.fetchall():  # several jobs per statement: batched
        assert row["statements"] < row["n"], row
    cursor = await conn.execute("SELECT verdict FROM jobs WHERE kind = 'noop'")
    assert {r["verdict"]["result"] for r in await cursor.fetchall()} == {"nothing to do"}
    assert await audit.verify(conn) == []


async def test_notify_wakes_an_idle_worker(fresh_database: str, settings: Settings, pool: Any) -> None:
    running = start_worker("w1", settings, pool, poll_interval_s=600)
    try:
        conn = await db.connect(fresh_database)
        async with conn:
            await until(fresh_database, lambda c: _listening(c), channels=("cp_job_queued",), timeout=10)
            await enqueue(conn, NewJob("noop"), TEST_ACTOR)
            await until(fresh_database, count_in("completed", 1), timeout=10)
    finally:
        await running.stop()


async def test_a_freed_slot_wakes_no_claim_after_a_claim_that_took_all_it_could_see(
    fresh_database: str, settings: Settings, pool: Any
) -> None:
    # Each job's notification wakes one claim, which takes it; its slot freeing up makes no second
    # claim (it would find nothing: the last one left no job behind). Only the claims made when the
    # worker began listening may be empty.
    running = start_worker("w1", settings, pool, poll_interval_s=600)
    try:
        conn = await db.connect(fresh_database)
        async with conn:
            await until(fresh_database, lambda c: _listening(c), channels=("cp_job_queued",), timeout=10)
            for n in range(1, 9):
                await enqueue(conn, NewJob("noop"), TEST_ACTOR)
                await until(fresh_database, count_in("completed", n), timeout=10)
        counts = running.worker.counts
        assert counts["claimed"] == 8
        assert counts["claims_empty"] <= 2, dict(counts)
        assert counts["claims"] - counts["claims_empty"] == 8
    finally:
        await running.stop()


async def test_a_job_announced_while_every_slot_was_taken_is_claimed_when_one_frees_up(
    fresh_database: str, settings: Settings, pool: Any, conn: db.AsyncConn
) -> None:
    # One slot, taken by a job that waits at its gate (a slow handler keeps no job ready beside
    # it): the second job's notification comes while the worker has no room, and nothing but the
    # slot freeing up wakes it again (no poll within the test).
    gates = Gates()
    running = start_worker(
        "w1", settings, pool, gate_registry(), {"gates": gates}, worker_concurrency=1, poll_interval_s=600
    )
    try:
        await until(fresh_database, lambda c: _listening(c), channels=("cp_job_queued",), timeout=10)
        await enqueue(conn, NewJob("gate"), TEST_ACTOR)
        first = await asyncio.wait_for(gates.contexts.get(), timeout=10)
        await enqueue(conn, NewJob("gate"), TEST_ACTOR)
        await eventually(lambda: running.worker.counts["notified"] >= 2, "the second job's notification")
        gates.open(first.job_id)
        second = await asyncio.wait_for(gates.contexts.get(), timeout=10)
        assert second.job_id != first.job_id
        gates.open(second.job_id)
        await until(fresh_database, count_in("completed", 2), timeout=10)
    finally:
        await running.stop()


async def _listening(conn: db.AsyncConn) -> bool:
    """Some session of this database has run LISTEN cp_job_queued (the worker's listener)."""
    cursor = await conn.execute(
        "SELECT count(*) AS n FROM pg_stat_activity"
        " WHERE datname = current_database() AND query = 'LISTEN cp_job_queued'"
    )
    row = await cursor.fetchone()
    return row is not None and row["n"] > 0


async def test_a_job_whose_enqueue_committed_late_is_found_off_the_claim_path(
    fresh_database: str, settings: Settings, pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker's claims read fresh work from just before the fresh jobs it claimed last; a job
    # enqueued earlier but committed later sorts before that point. The worker's look (on its
    # heartbeat's connection) finds it, and its next claim reads the whole queue. With no margin,
    # the point is the run_at of the job the worker claimed: any enqueue begun before that one
    # sorts before it, with no wait for the clock to pass a margin.
    monkeypatch.setattr(worker_module, "LOOK_BEFORE_POINT_EVERY_S", 0.2)
    monkeypatch.setattr(worker_module, "CLAIM_FROM_MARGIN", timedelta(0))
    running = start_worker("w1", settings, pool, heartbeat_interval_s=0.1)
    try:
        late = await db.connect(fresh_database, autocommit=False)
        conn = await db.connect(fresh_database)
        async with late, conn:
            held_back = (await enqueue(late, NewJob("noop"), TEST_ACTOR)).job
            await enqueue(conn, NewJob("noop"), TEST_ACTOR)
            await until(fresh_database, count_in("completed", 1), timeout=10)
            assert running.worker._claim_from is not None
            assert held_back["run_at"] < running.worker._claim_from.run_at
            # A look from that point has found nothing yet (the job is not committed).
            await eventually(lambda: running.worker.counts["looks"] > 0, "a look before the point")
            assert running.worker.counts["looks_found"] == 0
            await late.commit()
            await until(fresh_database, count_in("completed", 2), timeout=10)
        assert running.worker.counts["looks_found"] >= 1
    finally:
        await running.stop()


async def test_a_fresh_job_no_enqueue_put_before_the_point_is_found_by_the_look_at_the_whole_range(
    fresh_database: str, settings: Settings, pool: Any, conn: db.AsyncConn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A job paused on its first attempt and resumed is reclaimed at attempt 0 with its old run_at:
    # fresh work before the worker's point, and before where its looks start (the database's bound,
    # taken when that job was committed long since). Every WHOLE_LOOK_EVERY-th look reads the range
    # from the start of the order, and finds it.
    monkeypatch.setattr(worker_module, "LOOK_BEFORE_POINT_EVERY_S", 0.2)
    monkeypatch.setattr(worker_module, "WHOLE_LOOK_EVERY", 3)
    monkeypatch.setattr(worker_module, "CLAIM_FROM_MARGIN", timedelta(0))
    resumed = await running_job(conn, worker="w-dead")
    await queue.pause(conn, resumed["id"], "alice", "looks stuck")
    resumed = await queue.resume(conn, resumed["id"], "alice", "false alarm")
    assert resumed["attempt"] == 0
    running = start_worker("w1", settings, pool, heartbeat_interval_s=0.1)
    try:
        await enqueue(conn, NewJob("noop"), TEST_ACTOR)
        await until(fresh_database, count_in("completed", 1), timeout=10)
        point = running.worker._claim_from
        assert point is not None and resumed["run_at"] < point.run_at
        # Its looks start from a bound now (after a whole look), past the resumed job's run_at.
        await eventually(lambda: running.worker.counts["looks"] >= 2, "a look from the bound")
        assert running.worker._look_from is not None and running.worker._look_from > resumed["run_at"]
        found = running.worker.counts["looks_found"]
        (reclaimed,) = (
            await queue.reclaim_many(conn, [resumed], Actor("supervisor", "sup"), "worker died")
        ).moved
        assert (reclaimed["state"], reclaimed["attempt"]) == ("queued", 0)
        await until(fresh_database, count_in("completed", 2), timeout=10)
        assert running.worker.counts["looks_found"] > found
        assert running.worker.counts["whole_looks"] >= 2
    finally:
        await running.stop()


async def test_failed_jobs_are_retried_by_the_supervisor_and_run_again(
    fresh_database: str, settings: Settings, pool: Any, conn: db.AsyncConn
) -> None:
    job = (await enqueue(conn, NewJob("always_fail", max_attempts=2, payload={"delay_s": 0}), TEST_ACTOR)).job
    sup = Supervisor(conn, settings, build_registry())
    running = start_worker("w1", settings, pool)
    try:
        await until(fresh_database, count_in("failed", 1))
        assert (await sup.run_once()).retried == [job["id"]]
        await until(fresh_database, lambda c: _attempt_failed(c, job["id"], 2))
        assert (await sup.run_once()).abandoned == [job["id"]]
    finally:
        await running.stop()
    events = [e for e, _, _ in await events_of(conn, job["id"])]
    assert events == ["enqueue", "claim", "start", "error", "retry", "claim", "start", "error", "abandon"]


async def _attempt_failed(conn: db.AsyncConn, job_id: uuid.UUID, attempt: int) -> bool:
    row = await get_job(conn, job_id)
    return row is not None and row["state"] == "failed" and row["attempt"] == attempt


async def test_heartbeat_loss_cancels_the_handler_and_reports_nothing(
    settings: Settings, pool: Any, conn: db.AsyncConn
) -> None:
    gates = Gates()
    job = (await enqueue(conn, NewJob("gate"), TEST_ACTOR)).job
    running = start_worker("w1", settings, pool, gate_registry(), {"gates": gates})
    try:
        ctx = await asyncio.wait_for(gates.contexts.get(), timeout=10)
        assert ctx.job_id == job["id"] and ctx.job["state"] == "running"
        await queue.pause(conn, job["id"], "alice", "hold everything")
        cancelled = await asyncio.wait_for(gates.cancelled.get(), timeout=10)
        assert cancelled == job["id"]
        assert running.worker.counts["lost"] == 1
    finally:
        await running.stop()
    assert running.worker.counts["handed_back"] == 0 and running.worker.counts["conflicts"] == 0
    assert await events_of(conn, job["id"]) == [
        ("enqueue", "system", "tests"),
        ("claim", "worker", "w1"),
        ("start", "worker", "w1"),
        ("pause", "operator", "alice"),
    ]


async def test_a_job_paused_and_resumed_between_two_heartbeats_is_finished_by_its_worker(
    fresh_database: str, settings: Settings, pool: Any, conn: db.AsyncConn
) -> None:
    gates = Gates()
    job = (await enqueue(conn, NewJob("gate"), TEST_ACTOR)).job
    # No heartbeat runs while the test acts: the worker never sees the job paused.
    running = start_worker("w1", settings, pool, gate_registry(), {"gates": gates}, heartbeat_interval_s=3600)
    try:
        ctx = await asyncio.wait_for(gates.contexts.get(), timeout=10)
        await queue.pause(conn, job["id"], "alice", "hold on")
        await queue.resume(conn, job["id"], "alice", "carry on")
        gates.open(ctx.job_id)
        await until(fresh_database, count_in("completed", 1), channels=("cp_job_completed",))
    finally:
        await running.stop()
    assert running.worker.counts["conflicts"] == 0 and running.worker.counts["completed"] == 1
    assert await events_of(conn, job["id"]) == [
        ("enqueue", "system", "tests"),
        ("claim", "worker", "w1"),
        ("start", "worker", "w1"),
        ("pause", "operator", "alice"),
        ("resume", "operator", "alice"),
        ("finish", "worker", "w1"),
    ]
    finished = await (await conn.execute("SELECT verdict FROM jobs WHERE id = %s", (job["id"],))).fetchone()
    assert finished == {"verdict": {"result": "gate opened"}}


async def test_a_hung_worker_is_fenced_off_after_reclaim(
    fresh_database: str, settings: Settings, pool: Any, conn: db.AsyncConn, tmp_path: Path
) -> None:
    fences = FileFences(tmp_path / "fences")
    resource = tmp_path / "resource"
    hung, healthy = Gates(), Gates(open_all=True)
    job = (await enqueue(conn, NewJob("fenced_gate"), TEST_ACTOR)).job
    # Worker A never heartbeats (as if hung) and has no slot to claim more: its handler is blocked.
    a = start_worker(
        "w-a",
        settings,
        pool,
        gate_registry(),
        {"gates": hung, "fences": fences, "resource": resource},
        heartbeat_interval_s=3600,
        worker_concurrency=1,
    )
    ctx_a = await asyncio.wait_for(hung.contexts.get(), timeout=10)
    sup = Supervisor(conn, settings, gate_registry(), supervisor_id="sup")
    later = await db_now(conn) + timedelta(seconds=settings.worker.reclaim_after_s + 1)
    assert (await sup.run_once(later)).reclaimed == [job["id"]]

    b = start_worker(
        "w-b", settings, pool, gate_registry(), {"gates": healthy, "fences": fences, "resource": resource}
    )
    await until(fresh_database, count_in("completed", 1))
    ctx_b = healthy.contexts.get_nowait()
    assert ctx_b.fence > ctx_a.fence
    assert resource.read_text() == f"w-b:{ctx_b.fence}"

    hung.open(job["id"])  # A wakes up
    await a.stop()
    await b.stop()
    assert a.worker.counts["stale_fence"] == 1 and a.worker.counts["completed"] == 0
    assert resource.read_text() == f"w-b:{ctx_b.fence}"  # A's write was refused
    late = await queue.finish_many(conn, [(ctx_a.job, {"result": "late"})], a.worker.outcomes.actor)
    assert late.moved == [] and isinstance(late.failed[0], VersionConflict)
    assert [(e, who) for e, _, who in await events_of(conn, job["id"])] == [
        ("enqueue", "tests"),
        ("claim", "w-a"),
        ("start", "w-a"),
        ("reclaim", "sup"),
        ("claim", "w-b"),
        ("start", "w-b"),
        ("finish", "w-b"),
    ]
    final = await get_job(conn, job["id"])
    assert final is not None and final["verdict"] == {"result": "written", "fence": ctx_b.fence}


async def test_a_heartbeat_cancelled_as_its_answer_arrives_still_ends(
    settings: Settings, pool: Any, conn: db.AsyncConn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopping worker cancels its heartbeat; a cancel that lands as a beat's answer comes back
    must end the task. (Python 3.11's wait_for returned the answer instead, the task beat on, and
    the worker's stop waited for it forever.)"""
    gates = Gates()
    await enqueue(conn, NewJob("gate"), TEST_ACTOR)
    beaters: list[asyncio.Task[Any]] = []
    beaten = asyncio.Event()
    real = transitions.heartbeat

    async def answered_then_cancelled(*args: Any) -> Any:
        still = await real(*args)
        beater = next(t for t in asyncio.all_tasks() if t.get_name() == "w1-heartbeat")
        beater.cancel()  # the cancel arrives in the same turn as the answer
        beaters.append(beater)
        beaten.set()
        return still

    monkeypatch.setattr(transitions, "heartbeat", answered_then_cancelled)
    running = start_worker("w1", settings, pool, gate_registry(), {"gates": gates}, heartbeat_interval_s=0.05)
    try:
        await asyncio.wait_for(gates.contexts.get(), timeout=10)
        await asyncio.wait_for(beaten.wait(), timeout=10)
        done, _ = await asyncio.wait({beaters[0]}, timeout=10)
        assert done == {beaters[0]} and beaters[0].cancelled()
        assert len(beaters) == 1  # it beat once, then ended
    finally:
        await running.stop()


async def test_stopping_hands_back_what_did_not_finish_within_the_grace(
    fresh_database: str, settings: Settings, pool: Any, conn: db.AsyncConn
) -> None:
    gates = Gates()
    jobs = await enqueue_many(conn, [NewJob("gate"), NewJob("gate")], TEST_ACTOR)
    running = start_worker("w1", settings, pool, gate_registry(), {"gates": gates})
    first = await asyncio.wait_for(gates.contexts.get(), timeout=10)
    await asyncio.wait_for(gates.contexts.get(), timeout=10)
    gates.open(first.job_id)  # this one finishes; the other is still blocked at shutdown
    await running.stop()
    other = next(j.job["id"] for j in jobs if j.job["id"] != first.job_id)
    assert await gates.cancelled.get() == other
    assert running.worker.counts["handed_back"] == 1
    assert (await events_of(conn, first.job_id))[-1] == ("finish", "worker", "w1")
    assert (await events_of(conn, other))[-1] == ("reclaim", "worker", "w1")
    row = await get_job(conn, other)
    assert row is not None and row["state"] == "queued"


async def test_a_kind_with_slots_of_its_own_never_takes_nor_waits_for_a_shared_one(
    fresh_database: str, settings: Settings, pool: Any, conn: db.AsyncConn
) -> None:
    """One shared slot and one of `side`'s own: three `side` jobs queued before a `gate` job. The
    first `side` runs in its slot, the `gate` job in the shared one, the other two wait, queued;
    when the first `side` ends the next one takes its slot, while the `gate` job still holds its."""
    gates = Gates()
    registry = JobRegistry([JobKind("gate", gate), JobKind("side", gate, own_slots=lambda s: 1)])
    sides = await enqueue_many(conn, [NewJob("side") for _ in range(3)], TEST_ACTOR)
    await enqueue(conn, NewJob("gate"), TEST_ACTOR)
    running = start_worker("w1", settings, pool, registry, {"gates": gates}, worker_concurrency=1)
    try:
        async with asyncio.timeout(20):
            started = [await gates.contexts.get(), await gates.contexts.get()]
        assert sorted(ctx.job["kind"] for ctx in started) == ["gate", "side"]
        assert await count_in("queued", 2)(conn)  # the other two sides: not claimed into a backlog
        for lane in ("shared", "side"):  # the slot metrics: one slot each, in use
            assert REGISTRY.get_sample_value("controlplane_worker_slots", {"lane": lane}) == 1
            assert REGISTRY.get_sample_value("controlplane_worker_slots_in_use", {"lane": lane}) == 1
        side = next(ctx for ctx in started if ctx.job["kind"] == "side")
        assert side.job_id == sides[0].job["id"]
        gates.open(side.job_id)
        async with asyncio.timeout(20):
            after = await gates.contexts.get()
        assert after.job_id == sides[1].job["id"]
        gates.open(after.job_id)
        gates.open(next(ctx for ctx in started if ctx.job["kind"] == "gate").job_id)
        async with asyncio.timeout(20):
            third = await gates.contexts.get()
        gates.open(third.job_id)
        await eventually(lambda: in_use("side") == 0 and in_use("shared") == 0, "every slot free again")
    finally:
        await running.stop()


def in_use(lane: str) -> float | None:
    return REGISTRY.get_sample_value("controlplane_worker_slots_in_use", {"lane": lane})
