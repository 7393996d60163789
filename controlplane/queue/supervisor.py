"""The job supervisor: reclaims jobs whose heartbeat went stale, retries or abandons failed jobs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime

import psycopg
from psycopg.rows import DictRow
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from controlplane.core.retry import RetryDecision, RetryPolicy
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor, BatchResult, VersionConflict
from controlplane.queue import moves as queue
from controlplane.queue.registry import JobRegistry
from controlplane.runtime.settings import Settings

log = logging.getLogger(__name__)

# A pass stops after this many full batches of one scan; the next pass goes on.
MAX_BATCHES_PER_PASS = 20


@dataclass
class PassResult:
    """What one supervisor pass did, by job id."""

    reclaimed: list[uuid.UUID] = field(default_factory=list)
    # Stale running jobs claimed more times than their attempts allow: failed (then abandoned).
    errored: list[uuid.UUID] = field(default_factory=list)
    retried: list[uuid.UUID] = field(default_factory=list)
    abandoned: list[uuid.UUID] = field(default_factory=list)
    # Abandoned although their kind is not registered here: no hook ran.
    abandoned_without_hook: list[uuid.UUID] = field(default_factory=list)
    hook_failures: list[uuid.UUID] = field(default_factory=list)
    conflicts: int = 0

    @property
    def acted(self) -> int:
        return len(self.reclaimed) + len(self.errored) + len(self.retried) + len(self.abandoned)


class Supervisor:
    """One pass (`run_once`) over live and failed jobs, and a thin loop around it.

    Works on a connection (e.g. the reconciler's, during its own pass) or a pool. `now` may be
    injected: it replaces the database's now() in the staleness and retry-time comparisons.
    """

    def __init__(
        self,
        db: AsyncConn | AsyncConnectionPool[AsyncConn],
        settings: Settings,
        registry: JobRegistry,
        *,
        supervisor_id: str = "supervisor",
        policy: RetryPolicy | None = None,
        batch_size: int | None = None,
    ) -> None:
        self.db = db
        self.settings = settings
        self.registry = registry
        self.actor = Actor("supervisor", supervisor_id)
        self.policy = policy or RetryPolicy(
            settings.worker.retry_base_delay_s, settings.worker.retry_max_delay_s
        )
        self.batch_size = batch_size or settings.reconciler.batch_size

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[AsyncConn]:
        if isinstance(self.db, AsyncConnectionPool):
            async with self.db.connection() as conn:
                yield conn
        else:
            yield self.db

    async def run_once(self, now: datetime | None = None) -> PassResult:
        result = PassResult()
        async with self._connection() as conn:
            for _ in range(MAX_BATCHES_PER_PASS):
                if await self._reclaim_stale(conn, now, result) < self.batch_size:
                    break
            for _ in range(MAX_BATCHES_PER_PASS):
                if await self._settle_failed(conn, now, result) < self.batch_size:
                    break
        if result.acted:
            log.info(
                "supervisor pass: %d reclaimed, %d errored, %d retried, %d abandoned",
                len(result.reclaimed),
                len(result.errored),
                len(result.retried),
                len(result.abandoned),
            )
        return result

    async def _scan(self, conn: AsyncConn, statement: str, now: datetime | None) -> list[DictRow]:
        cursor = await conn.execute(
            statement,
            {"now": now, "stale_after_s": self.settings.worker.reclaim_after_s, "limit": self.batch_size},
            prepare=True,
        )
        return await cursor.fetchall()

    async def _reclaim_stale(self, conn: AsyncConn, now: datetime | None, result: PassResult) -> int:
        """Stale claimed/running jobs go back to the queue.

        A job whose workers keep dying would loop for ever: once it has been claimed more times
        than its attempts allow, a stale run counts as a failure instead (and it is abandoned).
        The one extra claim leaves room for a job resumed by an operator on its last attempt,
        whose worker had let it go when it was paused.
        """
        async with conn.transaction():
            stale = await self._scan(conn, sql.SCAN_STALE_JOBS, now)
            last = [
                job
                for job in stale
                if job["state"] == "running" and job["attempt"] > queue.attempts_allowed(job, self.registry)
            ]
            last_ids = {job["id"] for job in last}
            reclaim = [job for job in stale if job["id"] not in last_ids]
            reason = f"heartbeat older than {self.settings.worker.reclaim_after_s:g}s"
            moved = await queue.reclaim_many(conn, reclaim, self.actor, reason)
            result.reclaimed += [row["id"] for row in moved.moved]
            failures = [
                queue.JobFailure(
                    job,
                    f"worker {job['claimed_by']} lost ({reason}) on attempt {job['attempt']}",
                    "temporary",
                    RetryDecision("abandon", 0.0, "worker lost beyond the last attempt"),
                )
                for job in last
            ]
            errored = await queue.error_many(conn, failures, self.actor)
            result.errored += [row["id"] for row in errored.moved]
            result.conflicts += _conflicts(moved) + _conflicts(errored)
        return len(stale)

    async def _settle_failed(self, conn: AsyncConn, now: datetime | None, result: PassResult) -> int:
        """Failed jobs whose retry time has come: back to the queue, or abandoned (with the hook)."""
        async with conn.transaction():
            due = await self._scan(conn, sql.SCAN_DUE_FAILED_JOBS, now)
            to_retry: list[DictRow] = []
            for job in due:
                decision = self.policy.decide(
                    attempt=job["attempt"],
                    max_attempts=queue.attempts_allowed(job, self.registry),
                    error_kind=job["error_kind"] or "temporary",
                )
                if decision.action == "retry":
                    to_retry.append(job)
                else:
                    await self._abandon(conn, job, decision, result)
            retried = await queue.retry_many(conn, to_retry, self.actor, "backoff elapsed")
            result.retried += [row["id"] for row in retried.moved]
            result.conflicts += _conflicts(retried)
        return len(due)

    async def _abandon(
        self, conn: AsyncConn, job: DictRow, decision: RetryDecision, result: PassResult
    ) -> None:
        if self.registry.get(job["kind"]) is None:
            log.warning(
                "abandoning job %s of unregistered kind %r: no on_abandoned hook runs",
                job["id"],
                job["kind"],
            )
            result.abandoned_without_hook.append(job["id"])
        try:
            await queue.abandon_job(
                conn,
                job,
                self.actor,
                f"{decision.why}: {job['last_error'] or 'no error recorded'}"[:500],
                self.registry,
                detail={"attempt": job["attempt"], "error_kind": job["error_kind"]},
            )
        except VersionConflict:
            result.conflicts += 1
            return
        except (psycopg.OperationalError, PoolTimeout):
            raise
        except Exception:
            log.exception("on_abandoned hook of job %s (%s) failed; it stays failed", job["id"], job["kind"])
            result.hook_failures.append(job["id"])
            return
        result.abandoned.append(job["id"])

    async def run(self, stop: asyncio.Event, interval_s: float | None = None) -> None:
        """Pass after pass until `stop` is set; a lost database only delays the next pass."""
        interval = interval_s if interval_s is not None else self.settings.worker.heartbeat_interval_s
        while not stop.is_set():
            try:
                await self.run_once()
            except (psycopg.OperationalError, PoolTimeout) as exc:
                log.warning("supervisor pass failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await stop.wait()


def _conflicts(result: BatchResult) -> int:
    return sum(1 for failure in result.failed if isinstance(failure, VersionConflict))
