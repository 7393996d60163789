"""The job queue's moves: claim, start, finish, error, reclaim, abandon, and the operator's actions."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from psycopg.rows import DictRow

from controlplane.core import lifecycle
from controlplane.core.records import JobPatch
from controlplane.core.refusals import InvalidRequest, InvalidState, NotFound
from controlplane.core.retry import ErrorKind, RetryDecision
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.job_rows import get_job
from controlplane.db.transitions import (
    Actor,
    BatchResult,
    InvariantViolation,
    Move,
    TransitionError,
    VersionConflict,
    observe_transition,
    transition_many,
)
from controlplane.queue.registry import JobRegistry, Verdict
from controlplane.runtime import metrics

log = logging.getLogger(__name__)

# What an operator may do to a job; each is an event of the job lifecycle.
OPERATOR_ACTIONS = lifecycle.JOB_OPERATOR_ACTIONS
# Longest error message kept on the job row (the full text is the handler's to log).
MAX_ERROR_CHARS = 4000


class JobNotFound(NotFound):
    def __init__(self, job_id: uuid.UUID) -> None:
        super().__init__(f"job {job_id} does not exist")
        self.job_id = job_id

    @property
    def detail(self) -> str:
        return f"no job {self.job_id}"


class ActionRefused(InvalidState):
    """An operator action the job's current state does not allow (or cannot be done safely)."""

    def __init__(self, job_id: uuid.UUID, action: str, state: str, why: str | None = None) -> None:
        allowed = [a for a in OPERATOR_ACTIONS if a in lifecycle.JOB.allowed_events(state)]
        self.job_id = job_id
        self.action = action
        self.state = state
        self.allowed = allowed
        detail = why or f"allowed from {state!r}: {', '.join(allowed) or 'nothing (it is final)'}"
        super().__init__(
            f"cannot {action} job {job_id}: it is {state!r}; {detail}",
            current_state=state,
            allowed_actions=allowed,
        )


def _move(job: Mapping[str, Any], event: str, **kwargs: Any) -> Move:
    return Move(job["id"], job["state"], job["state_version"], event, **kwargs)


async def _batch(conn: AsyncConn, moves: list[Move], actor: Actor) -> BatchResult:
    """Many job moves in one statement, in id order, so that concurrent batches over the same rows
    (a worker's heartbeat and its completions, two supervisors) tend to lock them in one order."""
    return await transition_many(conn, "job", sorted(moves, key=lambda m: m.id), actor)


async def claim(conn: AsyncConn, worker_id: str, kinds: Sequence[str], limit: int) -> list[DictRow]:
    """Claim up to `limit` due queued jobs of `kinds` in one statement; each gets a new fence.

    Returned in claim order: priority, work already begun first, then run_at.
    """
    if limit <= 0 or not kinds:
        return []
    cursor = await conn.execute(
        sql.CLAIM_JOBS,
        {
            "kinds": list(kinds),
            "limit": limit,
            "worker": worker_id,
            "actor_kind": "worker",
            "actor_id": worker_id,
            "request_id": None,
        },
        prepare=True,
    )
    rows = await cursor.fetchall()
    rows.sort(key=_claim_order)
    for row in rows:
        observe_transition("job", row)
    return rows


@dataclass(frozen=True)
class ClaimFrom:
    """A point in the claim's order (priority, fresh work, run_at) where a claim may start."""

    priority: int
    fresh: bool
    run_at: datetime

    @classmethod
    def before(cls, job: Mapping[str, Any], margin: timedelta, most: timedelta) -> ClaimFrom:
        """Just before a job claim_and_start returned (its attempt counts this claim): `margin`
        before the older of the job's run_at and the bound the claim returned with it
        (`_look_from`: no job that claim could not see sorts before it), but never more than
        `most` before the job."""
        run_at: datetime = job["run_at"]
        start = max(min(run_at, job["_look_from"]) - margin, run_at - most)
        return cls(int(job["priority"]), int(job["attempt"]) == 1, start)

    def params(self) -> dict[str, Any]:
        return {"from_priority": self.priority, "from_fresh": self.fresh, "from_run_at": self.run_at}


async def claim_and_start(
    conn: AsyncConn,
    worker_id: str,
    kinds: Sequence[str],
    limit: int,
    start: ClaimFrom | None = None,
) -> list[DictRow]:
    """Claim up to `limit` due jobs of `kinds` and start them: one statement, one round trip.

    Each job makes both moves of the transition path (queued -> claimed with a new fence, then
    claimed -> running), each with its event row; returned as started, in claim order. With
    `start`, only jobs at that point of the claim's order or after it are looked at.
    """
    if limit <= 0 or not kinds:
        return []
    params = {"kinds": list(kinds), "limit": limit, "worker": worker_id}
    params.update(start.params() if start is not None else sql.CLAIM_FROM_START)
    cursor = await conn.execute(sql.CLAIM_AND_START, params, prepare=True)
    rows = await cursor.fetchall()
    if rows:
        rows.sort(key=_claim_order)
        observe_claims_and_starts(rows)
    return rows


async def fresh_before(
    conn: AsyncConn, kinds: Sequence[str], point: ClaimFrom, look_from: datetime | None = None
) -> bool:
    """Whether due fresh work of `kinds` sorts before `point` (a claim from it would leave it out),
    of that priority with run_at at `look_from` or later (None: any run_at)."""
    params = {"kinds": list(kinds), "look_from": look_from or "-infinity", **point.params()}
    cursor = await conn.execute(sql.FRESH_BEFORE_POINT, params, prepare=True)
    return await cursor.fetchone() is not None


async def look_from(conn: AsyncConn) -> datetime:
    """Where a look made after this call may start (sql.LOOK_FROM), before any margin."""
    cursor = await conn.execute(sql.LOOK_FROM, prepare=True)
    row = await cursor.fetchone()
    assert row is not None  # an aggregate: always one row
    return cast(datetime, row["look_from"])


def _claim_order(row: Mapping[str, Any]) -> tuple[Any, ...]:
    return (row["priority"], row["attempt"] == 1, row["run_at"], row["fence"])


def observe_claims_and_starts(rows: Sequence[Mapping[str, Any]]) -> None:
    """The metrics of both moves of claim_and_start (what observe_transition records for each)."""
    metrics.TRANSITIONS.labels("job", "queued", "claimed", "claim").inc(len(rows))
    metrics.TRANSITIONS.labels("job", "claimed", "running", "start").inc(len(rows))
    queued = metrics.TIME_IN_STATE.labels("job", "queued")
    claimed = metrics.TIME_IN_STATE.labels("job", "claimed")
    for row in rows:
        queued.observe(max(0.0, row["_queued_s"]))
        claimed.observe(0.0)


async def start_many(conn: AsyncConn, jobs: Sequence[Mapping[str, Any]], actor: Actor) -> BatchResult:
    """claimed -> running for all `jobs` in one statement."""
    return await _batch(conn, [_move(job, "start") for job in jobs], actor)


async def finish_many(
    conn: AsyncConn, done: Sequence[tuple[Mapping[str, Any], Verdict]], actor: Actor
) -> BatchResult:
    """running -> completed, each with its verdict ("nothing to do" is a completion too)."""
    moves = [_move(job, "finish", patch=JobPatch(verdict=dict(verdict))) for job, verdict in done]
    return await _batch(conn, moves, actor)


@dataclass(frozen=True)
class JobFailure:
    """One failed run: the job as the worker holds it, what went wrong, and what happens next."""

    job: Mapping[str, Any]
    message: str
    kind: ErrorKind
    decision: RetryDecision
    requested_delay_s: float | None = None
    # The failure code the error carried (controlplane.core.failures), if any: kept in the event.
    code: str | None = None

    def move(self) -> Move:
        attempt = int(self.job["attempt"])
        message = self.message[:MAX_ERROR_CHARS]
        return _move(
            self.job,
            "error",
            reason=message[:500],
            detail={
                "error_kind": self.kind,
                "attempt": attempt,
                "next": self.decision.action,
                "retry_in_s": self.decision.delay_s,
                "requested_delay_s": self.requested_delay_s,
                "why": self.decision.why,
                **({"code": self.code} if self.code else {}),
            },
            # delay_s sets run_at: the moment the supervisor retries (or abandons) the job.
            patch=JobPatch(
                attempt=attempt, last_error=message, error_kind=self.kind, delay_s=self.decision.delay_s
            ),
        )


async def error_many(conn: AsyncConn, failures: Sequence[JobFailure], actor: Actor) -> BatchResult:
    """running -> failed, with the message, the error kind, the attempt and the retry time."""
    return await _batch(conn, [f.move() for f in failures], actor)


async def error(conn: AsyncConn, failure: JobFailure, actor: Actor) -> DictRow:
    """One running -> failed; raises VersionConflict when the job is no longer where the caller saw it."""
    result = await error_many(conn, [failure], actor)
    if result.failed:
        raise result.failed[0]
    return result.moved[0]


async def reclaim_many(
    conn: AsyncConn, jobs: Sequence[Mapping[str, Any]], actor: Actor, reason: str
) -> BatchResult:
    """claimed/running -> queued: hand jobs back to the queue (dead worker, shutdown)."""
    return await _batch(conn, [_move(job, "reclaim", reason=reason) for job in jobs], actor)


async def retry_many(
    conn: AsyncConn, jobs: Sequence[Mapping[str, Any]], actor: Actor, reason: str
) -> BatchResult:
    """failed -> queued, due now (run_at = now())."""
    moves = [_move(job, "retry", reason=reason, patch=JobPatch(delay_s=0)) for job in jobs]
    return await _batch(conn, moves, actor)


def attempts_allowed(job: Mapping[str, Any], registry: JobRegistry | None) -> int:
    """The job's max_attempts, lowered by its kind's when the kind is registered."""
    allowed = int(job["max_attempts"])
    kind = registry.get(job["kind"]) if registry else None
    return min(allowed, kind.max_attempts) if kind else allowed


async def abandon_job(
    conn: AsyncConn,
    job: Mapping[str, Any],
    actor: Actor,
    reason: str,
    registry: JobRegistry | None,
    *,
    detail: Mapping[str, Any] | None = None,
) -> DictRow:
    """failed/paused -> abandoned and the kind's on_abandoned hook, in one transaction.

    Raises VersionConflict (nothing done) when the job moved meanwhile; a failing hook rolls the
    abandonment back.
    """
    kind = registry.get(job["kind"]) if registry else None
    async with conn.transaction():
        result = await transition_many(
            conn, "job", [_move(job, "abandon", reason=reason, detail=detail)], actor
        )
        if result.failed:
            raise result.failed[0]
        row = result.moved[0]
        if kind is not None and kind.on_abandoned is not None:
            await kind.on_abandoned(conn, row, actor)
    return row


@dataclass(frozen=True)
class OwnConflicts:
    """Conflicts of a holder's writes that do not mean the job was taken from it."""

    # Its own earlier writes, applied although the reply was lost with the connection: the rows.
    applied: dict[uuid.UUID, DictRow]
    # Moves whose job is still its own a few versions on, with the current version to retry at.
    again: list[Move]


async def own_conflicts(
    conn: AsyncConn, failures: Iterable[TransitionError], fences: Mapping[uuid.UUID, int], worker_id: str
) -> OwnConflicts:
    """Of these conflicts, the ones the holder (`worker_id`, `fences`) can settle itself.

    - After a write whose reply was lost, retrying it conflicts with itself: the row is at the
      target state, one version on, with the same fence. That move is done.
    - An operator who pauses and resumes a running job between two of its worker's heartbeats
      leaves it in the same state, claimed by the same worker with the same fence, a few versions
      on: the worker's outcome is still the job's, to be applied again at the current version.
    """
    conflicts = [f for f in failures if isinstance(f, VersionConflict) and f.move.id in fences]
    if not conflicts:
        return OwnConflicts({}, [])
    cursor = await conn.execute(sql.JOBS_BY_IDS, {"ids": [c.move.id for c in conflicts]})
    rows = {row["id"]: row for row in await cursor.fetchall()}
    applied: dict[uuid.UUID, DictRow] = {}
    again: list[Move] = []
    for conflict in conflicts:
        move, row = conflict.move, rows.get(conflict.move.id)
        if row is None or row["fence"] != fences[move.id]:
            continue
        if (
            row["state"] == lifecycle.JOB.apply(move.expected_state, move.event)
            and row["state_version"] == move.expected_version + 1
        ):
            applied[move.id] = row
        elif (
            row["state"] == move.expected_state
            and row["state_version"] > move.expected_version
            and row["claimed_by"] == worker_id
        ):
            again.append(dataclasses.replace(move, expected_version=row["state_version"]))
    return OwnConflicts(applied, again)


async def apply_again(conn: AsyncConn, moves: list[Move], actor: Actor) -> BatchResult:
    """The `again` moves of `own_conflicts`, in one statement."""
    return await _batch(conn, moves, actor)


def move_of(failure: TransitionError) -> Move:
    """The move a failed transition was asked to make."""
    assert isinstance(failure, VersionConflict | InvariantViolation)
    return failure.move


def _require_reason(reason: str | None) -> str:
    text = (reason or "").strip()
    if not text:
        raise InvalidRequest("reason", "an operator action needs a reason")
    return text


async def operator_action(
    conn: AsyncConn,
    job_id: uuid.UUID,
    action: str,
    operator: str,
    reason: str,
    *,
    registry: JobRegistry | None = None,
    force: bool = False,
) -> DictRow:
    """Pause, resume, retry or abandon a job as `operator`, with a required reason.

    Refuses (ActionRefused, naming the current state) what the lifecycle does not allow. Abandon
    runs the kind's on_abandoned hook in the same transaction; when the kind is not in `registry`
    the hook cannot run and abandon is refused unless `force`.
    """
    if action not in OPERATOR_ACTIONS:
        raise ValueError(f"unknown action {action!r}; expected one of {', '.join(OPERATOR_ACTIONS)}")
    why = _require_reason(reason)
    actor = Actor("operator", operator)
    last_state = ""
    for _ in range(5):
        job = await get_job(conn, job_id)
        if job is None:
            raise JobNotFound(job_id)
        last_state = job["state"]
        try:
            lifecycle.JOB.apply(job["state"], action, job_id)
        except lifecycle.IllegalTransition as exc:
            raise ActionRefused(job_id, action, job["state"]) from exc
        try:
            if action == "abandon":
                if not force and (registry is None or registry.get(job["kind"]) is None):
                    raise ActionRefused(
                        job_id,
                        action,
                        job["state"],
                        f"kind {job['kind']!r} is not registered here, so its abandonment hook "
                        "cannot run (force to abandon without it)",
                    )
                return await abandon_job(conn, job, actor, why, registry)
            patch = JobPatch()
            if action == "retry":
                patch = JobPatch(delay_s=0)
            elif action == "resume":
                # A pause is not a failure: the paused attempt is not counted. The resumed job is
                # reclaimed and claimed again (which counts one), at the attempt it was paused on.
                patch = JobPatch(attempt=max(int(job["attempt"]) - 1, 0))
            result = await transition_many(conn, "job", [_move(job, action, reason=why, patch=patch)], actor)
            if result.failed:
                raise result.failed[0]
            return result.moved[0]
        except VersionConflict:
            log.info("job %s moved while %s was applying %s; re-reading", job_id, operator, action)
    raise ActionRefused(job_id, action, last_state, "the job keeps changing; try again")


async def pause(conn: AsyncConn, job_id: uuid.UUID, operator: str, reason: str) -> DictRow:
    return await operator_action(conn, job_id, "pause", operator, reason)


async def resume(conn: AsyncConn, job_id: uuid.UUID, operator: str, reason: str) -> DictRow:
    return await operator_action(conn, job_id, "resume", operator, reason)


async def retry(conn: AsyncConn, job_id: uuid.UUID, operator: str, reason: str) -> DictRow:
    return await operator_action(conn, job_id, "retry", operator, reason)


async def abandon(
    conn: AsyncConn,
    job_id: uuid.UUID,
    operator: str,
    reason: str,
    registry: JobRegistry | None,
    *,
    force: bool = False,
) -> DictRow:
    return await operator_action(conn, job_id, "abandon", operator, reason, registry=registry, force=force)


async def list_jobs(
    conn: AsyncConn,
    *,
    state: str | None = None,
    kind: str | None = None,
    instance_id: uuid.UUID | None = None,
    limit: int = 100,
) -> list[DictRow]:
    """Jobs newest first, optionally of one state, kind and/or instance."""
    if state is not None and state not in lifecycle.JOB.states:
        raise ValueError(f"unknown job state {state!r}; expected one of {', '.join(lifecycle.JOB.states)}")
    cursor = await conn.execute(
        sql.LIST_JOBS, {"state": state, "kind": kind, "instance": instance_id, "limit": limit}
    )
    return await cursor.fetchall()


async def job_events(conn: AsyncConn, job_id: uuid.UUID, limit: int = 1000) -> list[DictRow]:
    """One job's event history, oldest first (empty when there is no such job)."""
    cursor = await conn.execute(sql.JOB_EVENTS, {"id": job_id, "limit": limit})
    return await cursor.fetchall()
