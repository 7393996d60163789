"""Recording the outcomes of a worker's jobs: completed, retried, failed, abandoned, handed back.

A handler's end is judged here (the retry policy decides between retry, fail and abandon) and
written in batches through the transition path, with the finished-jobs metric."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from psycopg.rows import DictRow
from psycopg_pool import AsyncConnectionPool, PoolClosed

from controlplane.core.retry import ErrorKind, RetryPolicy
from controlplane.db.connection import DATABASE_GONE, AsyncConn, Lease
from controlplane.db.transitions import Actor, BatchResult
from controlplane.queue import moves as queue
from controlplane.queue.registry import JobRegistry, Verdict
from controlplane.runtime import metrics

log = logging.getLogger(__name__)

T = TypeVar("T")
# Under a trickle, how long the writer waits for more outcomes to share a statement with.
WRITE_LINGER_S = 0.002


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
    # it before this + reclaim_after_s, so the worker stops acting on it then (Worker._expire_leases).
    lease_from: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> uuid.UUID:
        value: uuid.UUID = self.job["id"]
        return value

    @property
    def fence(self) -> int:
        return int(self.job["fence"])


@dataclass
class Outcome:
    held: Held
    kind: Literal["finish", "error"]
    verdict: Verdict | None = None
    failure: queue.JobFailure | None = None


class Outcomes:
    """Records the outcomes of one worker's jobs, on a connection of its own.

    A handler's end is judged at once (a verdict to record, or an error on which the retry policy
    decides: retry, fail or abandon) and queued; `run` writes what is queued in batches,
    completions and errors in one round trip, and counts the finished jobs. Once an outcome is
    written or refused, its job is `forget`-ten by the worker.
    """

    def __init__(
        self,
        worker_id: str,
        pool: AsyncConnectionPool[AsyncConn],
        registry: JobRegistry,
        policy: RetryPolicy,
        *,
        counts: collections.Counter[str],
        forget: Callable[[Held], None],
        batch_min: int,
    ) -> None:
        self.worker_id = worker_id
        self.registry = registry
        self.policy = policy
        self.actor = Actor("worker", worker_id)
        # The worker's counts: completed, failed, conflicts, handed_back.
        self.counts = counts
        self._forget = forget
        # With fewer outcomes queued than this, the writer lingers for more (WRITE_LINGER_S).
        self._batch_min = batch_min
        self._queued: list[Outcome] = []
        self._ready = asyncio.Event()
        self._closing = False
        self._lease = Lease(pool)
        # Monotonic time after which writes stop retrying (set when stopping): the supervisor's turn.
        self.give_up_at: float | None = None

    # ----------------------------------------------------------------- judging a handler's end

    def finish(self, held: Held, verdict: Verdict | None) -> None:
        """The handler returned: its verdict is recorded, or, if it cannot be, a temporary error."""
        problem = _not_a_verdict(verdict)
        if problem:
            self.fail(held, problem, "temporary", None)
        else:
            self._queue(Outcome(held, "finish", verdict=verdict if verdict is not None else {}))

    def fail(
        self, held: Held, message: str, kind: ErrorKind, delay_s: float | None, code: str | None = None
    ) -> None:
        """The handler raised: the retry policy decides whether the job is retried, fails or is abandoned."""
        decision = self.policy.decide(
            attempt=int(held.job["attempt"]),
            max_attempts=queue.attempts_allowed(held.job, self.registry),
            error_kind=kind,
            requested_delay_s=delay_s,
        )
        failure = queue.JobFailure(held.job, message, kind, decision, delay_s, code)
        self._queue(Outcome(held, "error", failure=failure))

    def _queue(self, outcome: Outcome) -> None:
        if outcome.held.lost:
            return
        self._queued.append(outcome)
        self._ready.set()

    # ----------------------------------------------------------------- writing

    async def run(self) -> None:
        """Write the queued outcomes, batch after batch, until closed and nothing is left."""
        while True:
            await self._ready.wait()
            if not self._closing and len(self._queued) < self._batch_min:
                await asyncio.sleep(WRITE_LINGER_S)  # more outcomes may share the statement
            self._ready.clear()
            batch = [o for o in self._queued if not o.held.lost]
            self._queued = []
            if batch:
                try:
                    await self._write(batch)
                except Exception:  # a bug must not stop all reporting: these are left to the supervisor
                    log.exception("worker %s: writing %d outcome(s) failed", self.worker_id, len(batch))
                    for outcome in batch:
                        outcome.held.writing = False
                        self._forget(outcome.held)
            if self._closing and not self._queued:
                return

    def close(self) -> None:
        """No more outcomes come: `run` writes what is queued and returns."""
        self._closing = True
        self._ready.set()

    async def release(self) -> None:
        await self._lease.release()

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

        written = await self._with_retry("report", write)
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

    async def hand_back(self, back: list[Held]) -> None:
        """reclaim (actor: this worker) every job it still holds, started or not."""

        async def reclaim(conn: AsyncConn) -> BatchResult:
            result = await queue.reclaim_many(conn, [h.job for h in back], self.actor, "worker shutting down")
            return await self._settle(conn, result, {h.id: h.fence for h in back})

        result = await self._with_retry("hand back", reclaim)
        if result is None:
            log.warning(
                "worker %s could not hand back %d job(s): left to the supervisor", self.worker_id, len(back)
            )
        else:
            self.counts["handed_back"] += len(result.moved)
            self.counts["conflicts"] += len(result.failed)
        for held in back:
            self._forget(held)

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

    async def _with_retry(self, what: str, operation: Callable[[AsyncConn], Awaitable[T]]) -> T | None:
        """Run `operation` on this writer's connection until it succeeds; None once it gives up."""
        delay = 0.05
        while True:
            try:
                async with self._lease.connection() as conn:
                    return await operation(conn)
            except DATABASE_GONE as exc:
                if isinstance(exc, PoolClosed) or (
                    self.give_up_at is not None and time.monotonic() > self.give_up_at
                ):
                    return None
                log.warning("worker %s: %s failed (%s); retrying", self.worker_id, what, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)


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
