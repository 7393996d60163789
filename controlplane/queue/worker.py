"""The worker runtime: claims jobs, runs their handlers concurrently, heartbeats, reports, shuts down."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, TypeVar

import psycopg
from psycopg.rows import DictRow
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from controlplane.core.retry import ErrorKind, RetryPolicy
from controlplane.core.step_errors import PermanentError, StaleFence, TemporaryError
from controlplane.db import connection as db
from controlplane.db import sql, transitions
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor, BatchResult
from controlplane.queue import moves as queue
from controlplane.queue.registry import JobContext, JobRegistry, Verdict
from controlplane.runtime import crashpoints, liveness, metrics
from controlplane.runtime.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")
# Errors after which a database write is retried on a fresh connection (a read-only database too:
# a failover in progress, after which the new connections reach the writable server).
DATABASE_GONE = (psycopg.OperationalError, PoolTimeout, db.READ_ONLY)
# How long to wait for a pooled connection before counting the database as unreachable.
CONNECTION_TIMEOUT_S = 5.0
# Longest wait for more free slots before claiming into a backlog (bigger, fewer claim batches).
CLAIM_LINGER_S = 0.05
# Jobs are claimed ahead of free slots only while handlers take less than this on average: a ready
# job must not wait behind long handlers (a provisioning) while another worker has slots free.
PREFETCH_BELOW_S = 0.05
# How often a claim looks at the whole queue (from the start of the claim's order): in between,
# a worker's claims read fresh work from just before the fresh jobs it claimed last, so that they
# do not walk the index entries of every job claimed since the oldest open snapshot. What sorts
# before fresh work (reclaimed or retried, a higher priority) is read at every claim; only a fresh
# job whose enqueue committed more than CLAIM_FROM_MARGIN late waits up to this long.
FULL_CLAIM_EVERY_S = 10.0
# How far before the run_at of the fresh jobs it claimed last a worker's next claim starts.
CLAIM_FROM_MARGIN = timedelta(seconds=1)
# Under a trickle, how long the writer waits for more outcomes to share a statement with.
WRITE_LINGER_S = 0.002


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class Held:
    """A job this worker holds: the row as last written, its handler task, and its fate."""

    job: DictRow
    task: asyncio.Task[None] | None = None
    # The job is no longer ours (reclaimed, paused, abandoned, stale fence): report nothing.
    lost: bool = False
    # Cancelled by the worker's shutdown: to be handed back to the queue.
    handing_back: bool = False
    # A write of its outcome is in flight: the write's result, not a heartbeat, decides its fate.
    writing: bool = False
    # When (this process's monotonic clock) the last statement that renewed its lease was sent:
    # its claim, then each heartbeat that found it still held. The database cannot have reclaimed
    # it before this + reclaim_after_s, so the worker stops acting on it then (see _expire_leases).
    lease_from: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> uuid.UUID:
        value: uuid.UUID = self.job["id"]
        return value

    @property
    def fence(self) -> int:
        return int(self.job["fence"])


class Lease:
    """A pooled connection kept across operations (sparing the pool's check on every checkout),
    given back to the pool, which discards it if broken, when an operation fails on it."""

    def __init__(self, pool: AsyncConnectionPool[AsyncConn]) -> None:
        self.pool = pool
        self.conn: AsyncConn | None = None

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConn]:
        if self.conn is not None and (self.conn.closed or self.conn.broken):
            await self.release()
        if self.conn is None:
            self.conn = await self.pool.getconn(timeout=CONNECTION_TIMEOUT_S)
        try:
            yield self.conn
        except BaseException as exc:
            if isinstance(exc, db.READ_ONLY) and isinstance(self.pool, db.Pool):
                await self.pool.discard_read_only(self.conn)
            await self.release()
            raise

    async def release(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(PoolClosed):
                await self.pool.putconn(conn)


@dataclass
class Outcome:
    held: Held
    kind: Literal["finish", "error"]
    verdict: Verdict | None = None
    failure: queue.JobFailure | None = None


class Worker:
    """Runs up to `settings.worker.concurrency` jobs at once, of the kinds in `registry`.

    Claims when woken by NOTIFY on cp_job_queued (or every poll_interval_s), claiming and starting
    a batch in one statement, and keeps up to half its concurrency more started jobs ready (claimed
    while the others run) for the slots that free up; heartbeats all held jobs in one statement on
    its own connection, and writes completions and errors in batches on a third.
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
        self.policy = policy or RetryPolicy(
            settings.worker.retry_base_delay_s, settings.worker.retry_max_delay_s
        )
        self.actor = Actor("worker", worker_id)
        # Dedicated connections (heartbeat, LISTEN) go to the pool's database.
        self._url = pool.conninfo if isinstance(pool.conninfo, str) else db.resolve_database_url(settings)
        self.kinds = registry.runnable()
        self.concurrency = settings.worker.concurrency
        # With a backlog, claim when at least this many slots are free (or after CLAIM_LINGER_S).
        self._batch_min = max(1, self.concurrency // 2)
        # Started jobs kept ready for slots to free up: the next batch is claimed while these run.
        self.prefetch = self._batch_min
        # Mean handler time (exponentially weighted; None until one returns): decides the prefetch.
        self._handler_s: float | None = None
        # Where the next claim starts (None: the whole queue), and when the next whole one is due.
        self._claim_from: queue.ClaimFrom | None = None
        self._full_claim_at = 0.0
        self._ready: collections.deque[Held] = collections.deque()
        # What this worker did: claimed, completed, failed, lost, conflicts, handed_back, ...
        self.counts: collections.Counter[str] = collections.Counter()
        self._held: dict[uuid.UUID, Held] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._outcomes: list[Outcome] = []
        # One connection for claiming and starting, one for reporting outcomes.
        self._claiming = Lease(pool)
        self._reporting = Lease(pool)
        self._stop = asyncio.Event()
        self._kick = asyncio.Event()
        self._outcome_ready = asyncio.Event()
        self._writer_closing = False
        # Monotonic time after which writes stop retrying (set when stopping): the supervisor's turn.
        self._give_up_at: float | None = None

    # ----------------------------------------------------------------- lifecycle

    def request_stop(self) -> None:
        """Stop claiming; running handlers get shutdown_grace_s, the rest is handed back."""
        if not self._stop.is_set():
            log.info("worker %s stopping", self.worker_id)
            self._give_up_at = (
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
        writer = asyncio.create_task(self._write_loop(), name=f"{self.worker_id}-write")
        try:
            await self._claim_loop()
        finally:
            self.request_stop()  # also when cancelled: writes must not retry forever
            listener.cancel()
            await self._shutdown(writer)
            beater.cancel()
            await asyncio.gather(listener, beater, return_exceptions=True)
            await self._claiming.release()
            await self._reporting.release()
            log.info("worker %s stopped: %s", self.worker_id, dict(self.counts))

    async def _shutdown(self, writer: asyncio.Task[None]) -> None:
        tasks = set(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.settings.worker.shutdown_grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._writer_closing = True
        self._outcome_ready.set()
        await asyncio.gather(writer, return_exceptions=True)
        back = [h for h in self._held.values() if not h.lost]
        if back:
            await self._hand_back(back)

    async def _hand_back(self, back: list[Held]) -> None:
        """reclaim (actor: this worker) every job it still holds, started or not."""

        async def reclaim(conn: AsyncConn) -> BatchResult:
            result = await queue.reclaim_many(conn, [h.job for h in back], self.actor, "worker shutting down")
            return await self._settle(conn, result, {h.id: h.fence for h in back})

        result = await self._with_retry("hand back", reclaim, self._reporting)
        if result is None:
            log.warning(
                "worker %s could not hand back %d job(s): left to the supervisor", self.worker_id, len(back)
            )
        else:
            self.counts["handed_back"] += len(result.moved)
            self.counts["conflicts"] += len(result.failed)
        for held in back:
            self._forget(held)

    # ----------------------------------------------------------------- claiming

    def _room(self) -> int:
        """How many more jobs this worker may take: free slots, plus the ready jobs it may keep."""
        quick = self._handler_s is not None and self._handler_s < PREFETCH_BELOW_S
        return self.concurrency + (self.prefetch if quick else 0) - len(self._tasks) - len(self._ready)

    async def _claim_loop(self) -> None:
        backlog = False  # the last claim was full: more jobs are likely waiting
        while not self._stop.is_set():
            room = self._room()
            if room <= 0:
                self._kick.clear()
                await self._kick.wait()
                continue
            if backlog and room < self._batch_min:
                await self._gather_slots()
                if self._stop.is_set():
                    break
                room = self._room()
            self._kick.clear()
            backlog = await self._claim_and_start(room) == room
            if self._stop.is_set():
                break
            if self._room() <= 0:
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.worker.poll_interval_s):
                    await self._kick.wait()

    async def _gather_slots(self) -> None:
        """With a backlog, let up to half the slots free up (briefly) so claims come in batches."""
        deadline = time.monotonic() + CLAIM_LINGER_S
        while not self._stop.is_set() and self._room() < self._batch_min:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._kick.wait()

    async def _claim_and_start(self, room: int) -> int:
        """Claim and start up to `room` jobs in one statement; returns how many were started.

        One round trip per batch on the path to the handlers. The jobs become this worker's
        (heartbeated, handed back at shutdown) once the statement's commit is known; those beyond
        the free slots wait, started, in `_ready` (a kill -9 leaves them to the supervisor, as it
        does the running ones).
        """
        now = time.monotonic()
        start = self._claim_from if now < self._full_claim_at else None
        if start is None:
            self._full_claim_at = now + FULL_CLAIM_EVERY_S

        async def claim_and_start() -> list[DictRow]:
            async with self._claiming.connection() as conn:
                return await queue.claim_and_start(conn, self.worker_id, self.kinds, room, start)

        sent = time.monotonic()
        try:
            # A claim that loses a race (a deadlock with a writer of the same rows) is run again.
            started = await db.retry_lost_races(claim_and_start)
        except DATABASE_GONE as exc:
            # Not applied, or applied with its reply lost: then its jobs go stale and are reclaimed.
            log.warning("worker %s: claim failed (%s)", self.worker_id, exc)
            liveness.LOOP.reached(False)
            await self._pause_after_failure()
            return 0
        liveness.LOOP.reached(True)
        self.counts["claimed"] += len(started)
        fresh = next((row for row in started if row["attempt"] == 1), None)
        if fresh is not None:  # what sorts before fresh work is read at every claim anyway
            self._claim_from = queue.ClaimFrom.before(fresh, CLAIM_FROM_MARGIN)
        for row in started:
            held = Held(row, lease_from=sent)
            self._held[held.id] = held
            self._ready.append(held)
        self._launch_ready()
        return len(started)

    def _launch_ready(self) -> None:
        """Start handlers for ready jobs while slots are free (none once the worker is stopping)."""
        while self._ready and len(self._tasks) < self.concurrency and not self._stop.is_set():
            held = self._ready.popleft()
            if not held.lost:
                self._launch(held)

    async def _pause_after_failure(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(1.0, self.settings.worker.poll_interval_s)):
                await self._stop.wait()

    def _launch(self, held: Held) -> None:
        task = asyncio.create_task(self._run_handler(held), name=f"job-{held.id}")
        held.task = task
        self._tasks.add(task)
        task.add_done_callback(self._slot_freed)

    def _slot_freed(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._launch_ready()
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
            self._fail(held, str(exc) or type(exc).__name__, "temporary", exc.delay_s, exc.code)
        except PermanentError as exc:
            self._fail(held, str(exc) or type(exc).__name__, "permanent", None, exc.code)
        except Exception as exc:
            log.exception("worker %s: job %s (%s) raised", self.worker_id, held.id, held.job["kind"])
            self._fail(held, f"{type(exc).__name__}: {exc}", "temporary", None)
        else:
            crashpoints.reached("worker.after_handler")
            took = time.monotonic() - began
            self._handler_s = took if self._handler_s is None else 0.9 * self._handler_s + 0.1 * took
            problem = _not_a_verdict(verdict)
            if problem:
                self._fail(held, problem, "temporary", None)
            else:
                self._report(Outcome(held, "finish", verdict=verdict if verdict is not None else {}))

    def _fail(
        self, held: Held, message: str, kind: ErrorKind, delay_s: float | None, code: str | None = None
    ) -> None:
        decision = self.policy.decide(
            attempt=int(held.job["attempt"]),
            max_attempts=queue.attempts_allowed(held.job, self.registry),
            error_kind=kind,
            requested_delay_s=delay_s,
        )
        failure = queue.JobFailure(held.job, message, kind, decision, delay_s, code)
        self._report(Outcome(held, "error", failure=failure))

    def _report(self, outcome: Outcome) -> None:
        if outcome.held.lost:
            return
        self._outcomes.append(outcome)
        self._outcome_ready.set()

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

    # ----------------------------------------------------------------- reporting

    async def _write_loop(self) -> None:
        while True:
            await self._outcome_ready.wait()
            if not self._writer_closing and len(self._outcomes) < self._batch_min:
                await asyncio.sleep(WRITE_LINGER_S)  # more outcomes may share the statement
            self._outcome_ready.clear()
            batch = [o for o in self._outcomes if not o.held.lost]
            self._outcomes = []
            if batch:
                try:
                    await self._write(batch)
                except Exception:  # a bug must not stop all reporting: these are left to the supervisor
                    log.exception("worker %s: writing %d outcome(s) failed", self.worker_id, len(batch))
                    for outcome in batch:
                        outcome.held.writing = False
                        self._forget(outcome.held)
            if self._writer_closing and not self._outcomes:
                return

    async def _write(self, batch: list[Outcome]) -> None:
        for outcome in batch:
            outcome.held.writing = True
        finishes = [o for o in batch if o.kind == "finish"]
        errors = [o for o in batch if o.kind == "error"]
        fences = {o.held.id: o.held.fence for o in batch}

        async def write(conn: AsyncConn) -> tuple[BatchResult, BatchResult]:
            done = await queue.finish_many(
                conn, [(o.held.job, o.verdict or {}) for o in finishes], self.actor
            )
            failed = await queue.error_many(conn, [o.failure for o in errors if o.failure], self.actor)
            return await self._settle(conn, done, fences), await self._settle(conn, failed, fences)

        written = await self._with_retry("report", write, self._reporting)
        for outcome in batch:
            outcome.held.writing = False
            self._forget(outcome.held)
        if written is None:
            log.warning(
                "worker %s: %d outcome(s) not written: left to the supervisor", self.worker_id, len(batch)
            )
            return
        done, failed = written
        by_id = {o.held.id: o for o in batch}
        for row in done.moved:
            metrics.JOBS_FINISHED.labels(row["kind"], "completed").inc()
        for row in failed.moved:
            metrics.JOBS_FINISHED.labels(row["kind"], f"failed_{row['error_kind']}").inc()
        self.counts["completed"] += len(done.moved)
        self.counts["failed"] += len(failed.moved)
        for failure in done.failed + failed.failed:
            held = by_id[queue.move_of(failure).id].held
            held.lost = True
            self.counts["conflicts"] += 1
            log.info("worker %s: outcome of job %s refused: %s", self.worker_id, held.id, failure)

    async def _settle(
        self, conn: AsyncConn, result: BatchResult, fences: Mapping[uuid.UUID, int]
    ) -> BatchResult:
        """Resolve conflicts that do not mean the job was taken from us.

        Our own earlier write (its reply lost with the connection) counts as done; a job still ours
        at a later version (paused and resumed by an operator between two heartbeats) gets the move
        again at its current version.
        """
        if not result.failed:
            return result
        own = await queue.own_conflicts(conn, result.failed, fences, self.worker_id)
        rows = list(own.applied.values())
        settled = own.applied.keys() | {move.id for move in own.again}
        failed = [f for f in result.failed if queue.move_of(f).id not in settled]
        if own.again:
            retried = await queue.apply_again(conn, own.again, self.actor)
            rows += retried.moved
            failed += retried.failed
        return BatchResult(result.moved + rows, failed)

    async def _with_retry(
        self, what: str, operation: Callable[[AsyncConn], Awaitable[T]], lease: Lease
    ) -> T | None:
        """Run `operation` on the lease's connection until it succeeds; None once the worker gives up."""
        delay = 0.05
        while True:
            try:
                async with lease.connection() as conn:
                    return await operation(conn)
            except DATABASE_GONE as exc:
                if isinstance(exc, PoolClosed) or (
                    self._give_up_at is not None and time.monotonic() > self._give_up_at
                ):
                    return None
                log.warning("worker %s: %s failed (%s); retrying", self.worker_id, what, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

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
                if not holdings:
                    continue
                sent = time.monotonic()
                try:
                    # Bounded: across a partition the statement would wait for an answer forever.
                    async with asyncio.timeout(self._beat_timeout_s):
                        if conn is None or conn.closed:
                            conn = await db.connect(self._url)
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
                        self._kick.set()
            except Exception as exc:  # polling covers the gap; keep trying to listen
                log.warning("worker %s: listener lost (%s); reconnecting", self.worker_id, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)


def _not_a_verdict(verdict: object) -> str | None:
    """Why a handler's return value cannot be recorded as a verdict (None when it can)."""
    if verdict is None:
        return None
    if not isinstance(verdict, Mapping):
        return f"handler returned {type(verdict).__name__}, not a verdict mapping"
    try:
        json.dumps(dict(verdict))
    except (TypeError, ValueError) as exc:
        return f"handler returned a verdict that is not JSON: {exc}"
    return None


async def worker_pool(settings: Settings, url: str, worker_id: str) -> db.Pool:
    """The open pool of a worker: a connection per job it runs at once, and a few for its
    listener and heartbeats; its sessions under the background roles' timeouts."""
    pool = db.pool(
        url,
        min_size=2,
        max_size=settings.worker.concurrency + 3,
        name=f"worker-{worker_id}",
        timeouts=db.Timeouts.background(settings),
    )
    await pool.open(wait=True, timeout=30)
    return pool


async def run_worker(
    settings: Settings,
    registry: JobRegistry,
    *,
    services: Mapping[str, Any] | None = None,
    policy: RetryPolicy | None = None,
) -> int:
    """The worker role: a pool, a Worker, SIGTERM/SIGINT for a graceful stop; returns the exit code."""
    crashpoints.arm(crashpoints.parse(settings.crash_points))
    url = db.resolve_database_url(settings)
    worker_id = settings.worker.id or default_worker_id()
    pool = await worker_pool(settings, url, worker_id)
    worker = Worker(worker_id, settings, pool, registry, services=services, policy=policy)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, worker.request_stop)
    try:
        await worker.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await pool.close()
    return 0
