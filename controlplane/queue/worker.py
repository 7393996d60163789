"""Running jobs: the claim loop, the handlers' slots, heartbeats, cancellation, graceful shutdown.

What became of each job is recorded by `controlplane.queue.outcomes`."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from opentelemetry.trace import SpanKind
from psycopg.rows import DictRow
from psycopg_pool import AsyncConnectionPool

from controlplane.core.retry import RetryPolicy
from controlplane.core.step_errors import PermanentError, StaleFence, TemporaryError
from controlplane.db import connection as db
from controlplane.db import sql, transitions
from controlplane.db.connection import AsyncConn
from controlplane.queue import moves as queue
from controlplane.queue.outcomes import Held, Outcomes
from controlplane.queue.registry import JobContext, JobRegistry
from controlplane.runtime import crashpoints, liveness, metrics, tracing
from controlplane.runtime.settings import Settings

log = logging.getLogger(__name__)

# Longest wait for more free slots before claiming into a backlog (bigger, fewer claim batches).
CLAIM_LINGER_S = 0.05
# Jobs are claimed ahead of free slots only while handlers take less than this on average: a ready
# job must not wait behind long handlers (a provisioning) while another worker has slots free.
PREFETCH_BELOW_S = 0.05
# How often a worker looks for fresh work before its point (FRESH_BEFORE_POINT). Its claims read
# fresh work from just before the fresh jobs it claimed last, so that they do not walk the index
# entries of every job claimed since the oldest open snapshot. What sorts before fresh work
# (reclaimed or retried, a higher priority) is read at every claim; a fresh job left before the
# point (its enqueue's transaction began more than CLAIM_FROM_MARGIN earlier, and committed
# after the claim that moved the point) is found by the look, made on the heartbeat's
# connection (off the claim path), and the next claim then reads the whole queue. Such a job waits
# up to this long, plus a heartbeat interval. A look starts where the database said, at the look
# before, that no job it could not see yet would sort before (sql.LOOK_FROM, less the margin), so
# that under a pinned horizon it reads the dead entries of the last interval's claims, not those of
# every job claimed since the snapshot. Every WHOLE_LOOK_EVERY-th look reads from the start of the
# order, for a fresh job before the point that no enqueue put there (a resumed job reclaimed at its
# first attempt keeps its old run_at; a job skipped while a claim that then died held its lock).
LOOK_BEFORE_POINT_EVERY_S = 10.0
WHOLE_LOOK_EVERY = 6
# Where a worker's next claim starts: CLAIM_FROM_CLOCK before the older of the run_at of the fresh
# jobs it claimed last and the bound that claim returned (sql.LOOK_FROM, taken before its snapshot:
# a job it could not see was inserted by a transaction that held an xid then, with a run_at not
# before that transaction's start, or inserted since), but never more than CLAIM_FROM_MARGIN
# before those jobs: an enqueue by an older transaction that has written is found by the look.
# CLAIM_FROM_CLOCK covers the moment between an insert's clock (its run_at) and its xid. Under a
# pinned xmin horizon, a claim reads the dead index entries of the jobs claimed in that span.
# CLAIM_FROM_MARGIN is also how far before the database's bound a look starts.
CLAIM_FROM_MARGIN = timedelta(seconds=1)
CLAIM_FROM_CLOCK = timedelta(milliseconds=100)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# The lane of the shared slots in the slot metrics (a lane of its own is named after its kind).
SHARED_LANE = "shared"


@dataclass
class Lane:
    """Slots of a worker: the shared ones (`concurrency`), or those of a kind of its own
    (JobKind.own_slots). Its running handlers, and its jobs started and waiting for a slot."""

    name: str
    slots: int
    running: set[asyncio.Task[None]] = field(default_factory=set)
    waiting: collections.deque[Held] = field(default_factory=collections.deque)

    def __post_init__(self) -> None:
        metrics.WORKER_SLOTS.labels(self.name).set(self.slots)
        self.count()

    def free(self) -> int:
        return self.slots - len(self.running) - len(self.waiting)

    def count(self) -> None:
        """The slots in use, for the metrics (after each start and end of a handler)."""
        metrics.WORKER_SLOTS_IN_USE.labels(self.name).set(len(self.running))


class Worker:
    """Runs up to `settings.worker.concurrency` jobs at once, of the kinds in `registry`, and
    beside them, a kind with slots of its own (JobKind.own_slots: deliveries) up to that many.

    Claims when woken by NOTIFY on cp_job_queued (or every poll_interval_s), claiming and starting
    a batch in one statement, and keeps up to its concurrency more started jobs ready (claimed
    while the others run) for the slots that free up; heartbeats all held jobs in one statement on
    its own connection; its `outcomes` are written in batches on a third.
    A kind with slots of its own is claimed, with the others, only while one of its slots is free
    (a claim may take more of it than that, at most the shared free slots: those wait, started, for
    one of its slots); its jobs never take a shared slot. While the shared slots are full it is
    claimed alone, when one of its slots frees up or at the poll interval.
    `request_stop()` begins a graceful shutdown.
    """

    def __init__(
        self,
        worker_id: str,
        settings: Settings,
        pool: AsyncConnectionPool[AsyncConn],
        registry: JobRegistry,
        *,
        services: Mapping[str, Any] | None = None,
        policy: RetryPolicy | None = None,
    ) -> None:
        if not registry.runnable():
            raise ValueError("a worker needs at least one job kind with a handler")
        self.worker_id = worker_id
        self.settings = settings
        self.pool = pool
        self.registry = registry
        self.services = services or {}
        # Dedicated connections (heartbeat, LISTEN) go to the pool's database.
        self._url = pool.conninfo if isinstance(pool.conninfo, str) else db.resolve_database_url(settings)
        self.kinds = registry.runnable()
        self.concurrency = settings.worker.concurrency
        # With a backlog, claim when this many more jobs can be taken (or after CLAIM_LINGER_S): a
        # whole concurrency's worth, so each claim and each write of outcomes carries that many jobs
        # (each statement has a fixed cost on both sides: with half, the CPU per job was a third more).
        self._batch_min = max(1, self.concurrency)
        # Started jobs kept ready for slots to free up: the next batch is claimed while these run.
        self.prefetch = self._batch_min
        # Mean handler time (exponentially weighted; None until one returns): decides the prefetch.
        self._handler_s: float | None = None
        # Where the next claim starts (None: the whole queue); whether the look found fresh work
        # before it (the next claim reads the whole queue), and when the next look is due.
        self._claim_from: queue.ClaimFrom | None = None
        self._full_claim_due = False
        self._look_at = 0.0
        # Where the next look starts (None: the whole range), and the looks made since a whole one.
        self._look_from: datetime | None = None
        self._looks_since_whole = 0
        # The shared slots (with the jobs ready for them), and those of the kinds with slots of their own.
        self._shared = Lane(SHARED_LANE, self.concurrency)
        self._lanes = {name: Lane(name, slots) for name, slots in registry.own_slots(settings).items()}
        # With the shared slots full, when the next claim for the others is due, and whether one of
        # their slots has freed up since the last.
        self._own_claim_at = 0.0
        self._own_slot_freed = False
        # Whether room holds the claims back (the last claim filled it, or there was none): only
        # then does a shared slot that frees up wake the claim loop. Otherwise the last claim took
        # all it could see, and a claim at each freed slot would find nothing: new work wakes the
        # loop by its notification.
        self._wants_room = False
        # What this worker did: claimed, completed, failed, lost, conflicts, handed_back, ...
        self.counts: collections.Counter[str] = collections.Counter()
        self._held: dict[uuid.UUID, Held] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # One connection for claiming and starting; the outcomes are written on one of their own.
        self._claiming = db.Lease(pool)
        self.outcomes = Outcomes(
            worker_id,
            pool,
            registry,
            policy or RetryPolicy(settings.worker.retry_base_delay_s, settings.worker.retry_max_delay_s),
            counts=self.counts,
            forget=self._forget,
            batch_min=self._batch_min,
        )
        self._stop = asyncio.Event()
        self._kick = asyncio.Event()

    # ----------------------------------------------------------------- lifecycle

    def request_stop(self) -> None:
        """Stop claiming; running handlers get shutdown_grace_s, the rest is handed back."""
        if not self._stop.is_set():
            log.info("worker %s stopping", self.worker_id)
            self.outcomes.give_up_at = (
                time.monotonic()
                + self.settings.worker.shutdown_grace_s
                + self.settings.worker.reclaim_after_s
            )
        self._stop.set()
        self._kick.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def held_ids(self) -> set[uuid.UUID]:
        return set(self._held)

    async def run(self) -> None:
        """Work until request_stop(), then shut down gracefully; returns when all is handed back."""
        log.info("worker %s starts: kinds %s, concurrency %d", self.worker_id, self.kinds, self.concurrency)
        listener = asyncio.create_task(self._listen(), name=f"{self.worker_id}-listen")
        beater = asyncio.create_task(self._heartbeat_loop(), name=f"{self.worker_id}-heartbeat")
        writer = asyncio.create_task(self.outcomes.run(), name=f"{self.worker_id}-write")
        try:
            await self._claim_loop()
        finally:
            self.request_stop()  # also when cancelled: writes must not retry forever
            listener.cancel()
            await self._shutdown(writer)
            beater.cancel()
            await asyncio.gather(listener, beater, return_exceptions=True)
            await self._claiming.release()
            await self.outcomes.release()
            log.info("worker %s stopped: %s", self.worker_id, dict(self.counts))

    async def _shutdown(self, writer: asyncio.Task[None]) -> None:
        tasks = set(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.settings.worker.shutdown_grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self.outcomes.close()
        await asyncio.gather(writer, return_exceptions=True)
        back = [h for h in self._held.values() if not h.lost]
        if back:
            await self.outcomes.hand_back(back)

    # ----------------------------------------------------------------- claiming

    def _room(self) -> int:
        """How many more jobs this worker may take: free slots, plus the ready jobs it may keep."""
        quick = self._handler_s is not None and self._handler_s < PREFETCH_BELOW_S
        return self._shared.free() + (self.prefetch if quick else 0)

    async def _claim_loop(self) -> None:
        backlog = False  # the last claim was full: more jobs are likely waiting
        while not self._stop.is_set():
            room = self._room()
            if room <= 0:
                self._wants_room = True
                await self._claim_for_own_slots()
                continue
            if backlog and room < self._batch_min:
                await self._gather_slots()
                if self._stop.is_set():
                    break
                room = self._room()
            self._kick.clear()
            kinds = [kind for kind in self.kinds if kind not in self._lanes or self._lanes[kind].free() > 0]
            backlog = await self._claim_and_start(kinds, room) == room
            self._wants_room = backlog
            if self._stop.is_set():
                break
            if self._room() <= 0:
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.worker.poll_interval_s):
                    await self._kick.wait()

    async def _gather_slots(self) -> None:
        """With a backlog, let a batch's worth of room free up (briefly) so claims come in batches."""
        deadline = time.monotonic() + CLAIM_LINGER_S
        while not self._stop.is_set() and self._room() < self._batch_min:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._kick.wait()

    async def _claim_for_own_slots(self) -> None:
        """The shared slots are full: claim for the kinds with free slots of their own when one of
        those has just freed up, or at the poll interval, not at every wake-up (such a claim reads
        past the other kinds' queued jobs); else wait to be woken."""
        self._kick.clear()
        kinds = [kind for kind, lane in self._lanes.items() if lane.free() > 0]
        wait_s = self._own_claim_at - time.monotonic() if kinds else None
        if wait_s is not None and (wait_s <= 0 or self._own_slot_freed):
            self._own_slot_freed = False
            self._own_claim_at = time.monotonic() + self.settings.worker.poll_interval_s
            await self._claim_and_start(kinds, sum(self._lanes[kind].free() for kind in kinds))
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await self._kick.wait()

    async def _claim_and_start(self, kinds: list[str], room: int) -> int:
        """Claim and start up to `room` jobs of `kinds` in one statement; returns how many were started.

        One round trip per batch on the path to the handlers. The jobs become this worker's
        (heartbeated, handed back at shutdown) once the statement's commit is known; those beyond
        the free slots wait, started, in their lane (a kill -9 leaves them to the supervisor, as it
        does the running ones).
        """
        start = None if self._full_claim_due else self._claim_from
        self._full_claim_due = False

        async def claim_and_start() -> list[DictRow]:
            async with self._claiming.connection() as conn:
                return await queue.claim_and_start(conn, self.worker_id, kinds, room, start)

        sent = time.monotonic()
        try:
            # A claim that loses a race (a deadlock with a writer of the same rows) is run again.
            started = await db.retry_lost_races(claim_and_start)
        except db.DATABASE_GONE as exc:
            # Not applied, or applied with its reply lost: then its jobs go stale and are reclaimed.
            log.warning("worker %s: claim failed (%s)", self.worker_id, exc)
            liveness.LOOP.reached(False)
            await self._pause_after_failure()
            self._kick.set()  # what that claim would have taken is still there: claim again
            return 0
        liveness.LOOP.reached(True)
        self.counts["claims"] += 1
        self.counts["claims_empty"] += not started
        self.counts["claimed"] += len(started)
        fresh = next((row for row in started if row["attempt"] == 1), None)
        # What sorts before fresh work is read at every claim anyway; a claim that left out a kind
        # (its slots full) does not move the point past that kind's queued jobs.
        if fresh is not None and len(kinds) == len(self.kinds):
            self._claim_from = queue.ClaimFrom.before(fresh, CLAIM_FROM_CLOCK, most=CLAIM_FROM_MARGIN)
        for row in started:
            held = Held(row, lease_from=sent)
            self._held[held.id] = held
            self._lanes.get(row["kind"], self._shared).waiting.append(held)
        self._launch_ready()
        return len(started)

    def _launch_ready(self) -> None:
        """Start handlers for ready jobs while their slots are free (none once the worker is stopping)."""
        for lane in (self._shared, *self._lanes.values()):
            while lane.waiting and len(lane.running) < lane.slots and not self._stop.is_set():
                held = lane.waiting.popleft()
                if not held.lost:
                    self._launch(held, lane)

    async def _pause_after_failure(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(1.0, self.settings.worker.poll_interval_s)):
                await self._stop.wait()

    def _launch(self, held: Held, lane: Lane) -> None:
        task = asyncio.create_task(self._run_handler(held), name=f"job-{held.id}")
        held.task = task
        self._tasks.add(task)
        lane.running.add(task)
        lane.count()
        task.add_done_callback(self._slot_freed)

    def _slot_freed(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task in self._shared.running:
            self._shared.running.discard(task)
            self._shared.count()
        for lane in self._lanes.values():
            if task in lane.running:
                lane.running.discard(task)
                lane.count()
                self._own_slot_freed = True
        self._launch_ready()
        if self._own_slot_freed or self._wants_room:
            self._kick.set()

    # ----------------------------------------------------------------- running handlers

    async def _run_handler(self, held: Held) -> None:
        kind = self.registry.get(held.job["kind"])
        assert kind is not None and kind.handler is not None, "claimed a job of a kind this worker cannot run"
        context = JobContext(
            job=held.job,
            worker_id=self.worker_id,
            pool=self.pool,
            settings=self.settings,
            services=self.services,
        )
        began = time.monotonic()
        try:
            with _job_span(held.job):
                verdict = await kind.handler(context)
        except asyncio.CancelledError:
            if not held.lost:
                held.handing_back = True
            return
        except StaleFence as exc:
            log.warning("worker %s: job %s: %s; reporting nothing", self.worker_id, held.id, exc)
            self.counts["stale_fence"] += 1
            self._lose(held)
            return
        except TemporaryError as exc:
            self.outcomes.fail(held, str(exc) or type(exc).__name__, "temporary", exc.delay_s, exc.code)
        except PermanentError as exc:
            self.outcomes.fail(held, str(exc) or type(exc).__name__, "permanent", None, exc.code)
        except Exception as exc:
            log.exception("worker %s: job %s (%s) raised", self.worker_id, held.id, held.job["kind"])
            self.outcomes.fail(held, f"{type(exc).__name__}: {exc}", "temporary", None)
        else:
            crashpoints.reached("worker.after_handler")
            took = time.monotonic() - began
            if held.job["kind"] not in self._lanes:  # the prefetch is for the shared slots
                self._handler_s = took if self._handler_s is None else 0.9 * self._handler_s + 0.1 * took
            self.outcomes.finish(held, verdict)

    def _lose(self, held: Held) -> None:
        """The job is no longer ours: stop its handler, report nothing, stop heartbeating it."""
        if held.lost:
            return
        held.lost = True
        self.counts["lost"] += 1
        if held.task is not None and not held.task.done():
            held.task.cancel()
        self._forget(held)

    def _forget(self, held: Held) -> None:
        if self._held.get(held.id) is held:
            del self._held[held.id]

    # ----------------------------------------------------------------- heartbeats and wake-ups

    async def _heartbeat_loop(self) -> None:
        conn: AsyncConn | None = None
        try:
            interval = self.settings.worker.heartbeat_interval_s
            while True:
                await asyncio.sleep(interval)
                liveness.LOOP.turned()  # what /healthz of the worker's metrics port reports
                self._expire_leases()
                holdings = {h.id: h.fence for h in self._held.values() if not h.lost}
                look = self._claim_from is not None and time.monotonic() >= self._look_at
                if not holdings and not look:
                    continue
                sent = time.monotonic()
                try:
                    # Bounded: across a partition the statement would wait for an answer forever.
                    async with asyncio.timeout(self._beat_timeout_s):
                        if conn is None or conn.closed:
                            conn = await db.connect(self._url)
                    if look:
                        await self._look_before_point(conn)
                    if not holdings:
                        continue
                    async with asyncio.timeout(self._beat_timeout_s):
                        still = await transitions.heartbeat(conn, self.worker_id, holdings)
                except Exception as exc:  # the heartbeat must outlive any failure: reconnect next time
                    liveness.LOOP.reached(False)
                    log.warning("worker %s: heartbeat failed (%s)", self.worker_id, exc or type(exc).__name__)
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            async with asyncio.timeout(1):
                                await conn.close()
                    conn = None
                    continue
                self.counts["heartbeats"] += 1
                liveness.LOOP.reached(True)
                for job_id in holdings.keys() & still:
                    renewed = self._held.get(job_id)
                    if renewed is not None:
                        renewed.lease_from = max(renewed.lease_from, sent)
                for job_id in holdings.keys() - still:
                    held = self._held.get(job_id)
                    if held is not None and not held.writing:
                        log.warning(
                            "worker %s: job %s is no longer held; cancelling it", self.worker_id, job_id
                        )
                        self._lose(held)
        finally:
            if conn is not None:
                await conn.close()

    async def _look_before_point(self, conn: AsyncConn) -> None:
        """Whether fresh work sorts before the point of this worker's claims: if so, the next claim
        reads the whole queue (and is woken for it)."""
        point = self._claim_from
        self._look_at = time.monotonic() + LOOK_BEFORE_POINT_EVERY_S
        if point is None:
            return
        whole = self._look_from is None or self._looks_since_whole + 1 >= WHOLE_LOOK_EVERY
        async with asyncio.timeout(self._beat_timeout_s):
            bound = await queue.look_from(conn)  # before this look's snapshot: for the next one
            found = await queue.fresh_before(conn, self.kinds, point, None if whole else self._look_from)
        self._look_from = bound - CLAIM_FROM_MARGIN
        self._looks_since_whole = 0 if whole else self._looks_since_whole + 1
        self.counts["looks"] += 1
        self.counts["whole_looks"] += whole
        if found:
            self.counts["looks_found"] += 1
            self._full_claim_due = True
            self._kick.set()

    @property
    def _beat_timeout_s(self) -> float:
        return max(self.settings.worker.heartbeat_interval_s, 1.0)

    def _expire_leases(self) -> None:
        """Stop acting on every job whose lease may have run out by now (no heartbeat got through
        for reclaim_after_s): the supervisor may have reclaimed it and another worker may run it,
        so its handler is cancelled here, by this worker's own clock, and nothing is reported."""
        expired_before = time.monotonic() - self.settings.worker.reclaim_after_s
        for held in list(self._held.values()):
            if not held.lost and not held.writing and held.lease_from < expired_before:
                log.warning(
                    "worker %s: job %s: no heartbeat got through for %.1fs (its lease); stopping it",
                    self.worker_id,
                    held.id,
                    self.settings.worker.reclaim_after_s,
                )
                self.counts["lease_expired"] += 1
                self._lose(held)

    async def _listen(self) -> None:
        """LISTEN cp_job_queued on a dedicated connection; reconnect whenever it is lost."""
        delay = 0.1
        while True:
            try:
                conn = await db.connect(self._url)
                async with conn:
                    await conn.execute(sql.LISTEN_JOB_QUEUED)
                    delay = 0.1
                    self._kick.set()  # jobs may have been queued while we were not listening
                    async for _ in conn.notifies():
                        self.counts["notified"] += 1
                        self._kick.set()
            except Exception as exc:  # polling covers the gap; keep trying to listen
                log.warning("worker %s: listener lost (%s); reconnecting", self.worker_id, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)


def _job_span(job: Mapping[str, Any]) -> contextlib.AbstractContextManager[object]:
    """The job's span, in the trace of the request that enqueued it (its payload's `traceparent`),
    else the root of a trace of its own."""
    if not tracing.enabled():
        return contextlib.nullcontext()
    attributes: dict[str, str | int] = {
        "controlplane.job.id": str(job["id"]),
        "controlplane.job.kind": str(job["kind"]),
        "controlplane.job.attempt": int(job["attempt"]),
    }
    if job.get("instance_id") is not None:
        attributes["controlplane.instance.id"] = str(job["instance_id"])
    parent = tracing.parent_of(job.get("payload")) or tracing.ROOT
    return tracing.span(f"job {job['kind']}", kind=SpanKind.CONSUMER, attributes=attributes, parent=parent)


async def worker_pool(
    settings: Settings, url: str, worker_id: str, registry: JobRegistry | None = None
) -> db.Pool:
    """The open pool of a worker: a connection per job it runs at once (of `registry`'s kinds with
    slots of their own too), and a few for its listener and heartbeats; its sessions under the
    background roles' timeouts."""
    own = sum(registry.own_slots(settings).values()) if registry is not None else 0
    pool = db.pool(
        url,
        min_size=2,
        max_size=settings.worker.concurrency + own + 3,
        name=f"worker-{worker_id}",
        timeouts=db.Timeouts.background(settings),
    )
    await pool.open(wait=True, timeout=30)
    return pool
