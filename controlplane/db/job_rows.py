"""Job records: enqueue (single and bulk, inside the caller's transaction) and look-ups."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg.rows import DictRow

from controlplane.core.kinds import Payload
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor
from controlplane.runtime import tracing


@dataclass(frozen=True)
class NewJob:
    """A job to enqueue: an instance job kind takes its payload dataclass; other kinds a mapping."""

    kind: str
    instance_id: uuid.UUID | None = None
    payload: Payload | Mapping[str, Any] = field(default_factory=dict)
    priority: int = 100
    max_attempts: int = 5
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.payload, Payload) and self.payload.kind != self.kind:
            raise ValueError(f"a {self.kind} job cannot take a {type(self.payload).__name__}")

    def payload_json(self) -> str:
        """The payload column; with tracing on, it carries the trace context of the enqueuer (its
        `traceparent`): the job's span continues the trace of the request that asked for it."""
        payload = self.payload.to_json() if isinstance(self.payload, Payload) else dict(self.payload)
        return json.dumps({**payload, **tracing.carrier()})


@dataclass(frozen=True)
class Enqueued:
    """The outcome of one enqueue: the new job, or the live one that already does this work."""

    job: DictRow
    created: bool


# How many times an enqueue inserts again when the live job it collided with finished before the
# look-up that follows (each statement sees the latest commits: the next insert goes through).
ENQUEUE_ATTEMPTS = 3


async def enqueue_many(
    conn: AsyncConn, jobs: Sequence[NewJob], actor: Actor, *, request_id: str | None = None
) -> list[Enqueued]:
    """Insert jobs in the caller's transaction; a duplicate live (instance, kind) is not created."""
    if not jobs:
        return []
    results: list[Enqueued | None] = [None] * len(jobs)
    pending = list(range(len(jobs)))
    for _ in range(ENQUEUE_ATTEMPTS):
        outcomes = await _enqueue_once(conn, [jobs[i] for i in pending], actor, request_id)
        for i, outcome in zip(pending, outcomes, strict=True):
            results[i] = outcome
        pending = [i for i in pending if results[i] is None]
        if not pending:
            return [r for r in results if r is not None]
    job = jobs[pending[0]]
    raise RuntimeError(f"enqueue of {job.kind} for {job.instance_id} neither created nor found")


async def _enqueue_once(
    conn: AsyncConn, jobs: Sequence[NewJob], actor: Actor, request_id: str | None
) -> list[Enqueued | None]:
    """One insert of `jobs`: each created, or the live job it collided with, or None when that
    job finished between the insert and the look-up (to insert again)."""
    if len(jobs) == 1:
        (one,) = jobs
        params: dict[str, Any] = {
            "kinds": one.kind,
            "instance_ids": one.instance_id,
            "payloads": one.payload_json(),
            "priorities": one.priority,
            "max_attempts": one.max_attempts,
            "delays": one.delay_s,
        }
    else:
        params = {
            "kinds": [j.kind for j in jobs],
            "instance_ids": [j.instance_id for j in jobs],
            "payloads": [j.payload_json() for j in jobs],
            "priorities": [j.priority for j in jobs],
            "max_attempts": [j.max_attempts for j in jobs],
            "delays": [j.delay_s for j in jobs],
        }
    params.update(actor_kind=actor.kind, actor_id=actor.id, request_id=request_id)
    statement = sql.ENQUEUE_JOB if len(jobs) == 1 else sql.ENQUEUE_JOBS
    cursor = await conn.execute(statement, params, prepare=True)
    created = await cursor.fetchall()
    by_key = {(row["instance_id"], row["kind"]): row for row in created if row["instance_id"]}
    unkeyed = iter(row for row in created if row["instance_id"] is None)
    missing = [j for j in jobs if j.instance_id is not None and (j.instance_id, j.kind) not in by_key]
    existing: dict[tuple[Any, str], DictRow] = {}
    if missing:
        cursor = await conn.execute(
            sql.LIVE_JOBS_FOR,
            {"instance_ids": [j.instance_id for j in missing], "kinds": [j.kind for j in missing]},
        )
        existing = {(row["instance_id"], row["kind"]): row for row in await cursor.fetchall()}
    results: list[Enqueued | None] = []
    claimed_keys: set[tuple[Any, str]] = set()
    for job in jobs:
        if job.instance_id is None:
            results.append(Enqueued(next(unkeyed), True))
            continue
        key = (job.instance_id, job.kind)
        if key in by_key and key not in claimed_keys:
            claimed_keys.add(key)
            results.append(Enqueued(by_key[key], True))
        else:
            live = by_key.get(key) or existing.get(key)
            results.append(None if live is None else Enqueued(live, False))
    return results


async def enqueue(conn: AsyncConn, job: NewJob, actor: Actor, *, request_id: str | None = None) -> Enqueued:
    (result,) = await enqueue_many(conn, [job], actor, request_id=request_id)
    return result


async def get_job(conn: AsyncConn, job_id: uuid.UUID) -> DictRow | None:
    cursor = await conn.execute(sql.JOB_BY_ID, {"id": job_id})
    return await cursor.fetchone()
