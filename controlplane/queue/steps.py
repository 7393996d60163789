"""Step records: what the instance jobs write as each named step starts, finishes or fails (fenced,
append-only, notified), and the progress of instances read back from them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from controlplane.core import failures, progress
from controlplane.core.kinds import DRIVING_JOB
from controlplane.core.records import Instance, StepRecord
from controlplane.core.step_errors import StaleFence, StepError
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.queue.registry import JobContext

# Longest raw error kept on a step record (the job row keeps the whole message).
MAX_ERROR_CHARS = 2000


class NotHeld(StaleFence):
    """The job is no longer running at this fence (reclaimed, paused, abandoned): stop, report nothing."""

    def __init__(self, job_id: uuid.UUID, fence: int) -> None:
        StepError.__init__(self, f"job {job_id} is no longer held at fence {fence}")
        self.resource = f"job {job_id}"
        self.fence = fence
        self.highest = fence


class InstanceMoved(Exception):
    """The instance left the state and version the job read: nothing was recorded."""


def _params(ctx: JobContext, instance_id: uuid.UUID, step: str) -> dict[str, Any]:
    return {
        "job_id": ctx.job_id,
        "fence": ctx.fence,
        "worker": ctx.worker_id,
        "instance_id": instance_id,
        "step": step,
    }


async def started(conn: AsyncConn, ctx: JobContext, inst: Instance, step: str) -> None:
    """Record that `step` starts and show it on the instance; NotHeld or InstanceMoved otherwise."""
    cursor = await conn.execute(
        sql.RECORD_STEP_STARTED,
        {**_params(ctx, inst.id, step), "state": inst.state, "state_version": inst.state_version},
        prepare=True,
    )
    row = await cursor.fetchone()
    assert row is not None
    if not row["held"]:
        raise NotHeld(ctx.job_id, ctx.fence)
    if not row["shown"]:
        raise InstanceMoved(f"instance {inst.id} left {inst.state!r} v{inst.state_version}")


async def ended(
    conn: AsyncConn, ctx: JobContext, instance_id: uuid.UUID, step: str, error: BaseException | None = None
) -> bool:
    """Record that `step` finished (no error) or failed with `error`; False if the job is no longer held.

    A failure is recorded with the code customers are told: the error's own, else the step's.
    """
    code = text = None
    if error is not None:
        own = error.code if isinstance(error, StepError) else None
        code = failures.given_up(str(ctx.job["kind"]), step=step, error_code=own, by_operator=False)
        text = (str(error) or type(error).__name__)[:MAX_ERROR_CHARS]
    cursor = await conn.execute(
        sql.RECORD_STEP_ENDED,
        {
            **_params(ctx, instance_id, step),
            "event": "finished" if error is None else "failed",
            "code": code,
            "error": text,
        },
        prepare=True,
    )
    row = await cursor.fetchone()
    return row is not None and bool(row["held"])


async def expected_durations(
    conn: AsyncConn, pairs: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], float]:
    """The usual duration of each (operation, step) with a history."""
    if not pairs:
        return {}
    cursor = await conn.execute(
        sql.STEP_DURATIONS,
        {
            "kinds": [kind for kind, _ in pairs],
            "steps": [step for _, step in pairs],
            "percentile": progress.PERCENTILE,
            "sample": progress.SAMPLE,
        },
    )
    return {
        (row["kind"], row["step"]): float(row["expected_s"])
        for row in await cursor.fetchall()
        if row["samples"] and row["expected_s"] is not None
    }


# How long a process keeps the fleet's usual step durations it read (FleetDurations).
FLEET_DURATIONS_KEEP_S = 5.0


@dataclass
class FleetDurations:
    """The fleet's usual step durations, read at most once every `keep_s` per (database, operation,
    step) by this process: every document of an instance in a transitional state shows them, and
    they follow the latest runs of the whole fleet, which a few seconds do not change."""

    keep_s: float = FLEET_DURATIONS_KEEP_S
    # (database, (operation, step)) -> (when it was read, the duration, None without history)
    _kept: dict[tuple[str, tuple[str, str]], tuple[float, float | None]] = field(default_factory=dict)

    async def of(self, conn: AsyncConn, pairs: Sequence[tuple[str, str]]) -> dict[tuple[str, str], float]:
        where = f"{conn.info.host}:{conn.info.port}/{conn.info.dbname}"
        now = time.monotonic()
        stale = [
            pair
            for pair in pairs
            if (kept := self._kept.get((where, pair))) is None or now - kept[0] > self.keep_s
        ]
        if stale:
            read = await expected_durations(conn, stale)
            for pair in stale:
                self._kept[(where, pair)] = (now, read.get(pair))
        out: dict[tuple[str, str], float] = {}
        for pair in pairs:
            expected = self._kept[(where, pair)][1]
            if expected is not None:
                out[pair] = expected
        return out


def _now_of(inst: Instance) -> datetime:
    """The database's time when the row was read (its time in state is measured with it)."""
    return inst.state_entered_at + timedelta(seconds=float(inst.time_in_state_s or 0.0))


async def progress_of(
    conn: AsyncConn,
    instances: Sequence[Instance],
    *,
    now: datetime | None = None,
    through_step: int | None = None,
    durations: FleetDurations | None = None,
) -> dict[uuid.UUID, dict[str, Any]]:
    """The progress of each instance in a transitional state, by id (three queries for a page).

    `now` replaces the database's time of the read (tests inject it); `through_step` leaves out
    the step records after that one (the progress as of a step event); `durations` keeps the
    fleet's usual step durations for a few seconds (else they are read).
    """
    moving = [inst for inst in instances if inst.state in DRIVING_JOB]
    if not moving:
        return {}
    ids = [inst.id for inst in moving]
    cursor = await conn.execute(
        sql.STEPS_SINCE, {"ids": ids, "since": [inst.state_entered_at for inst in moving]}
    )
    records: dict[uuid.UUID, list[StepRecord]] = {}
    for row in await cursor.fetchall():
        if through_step is None or row["id"] <= through_step:
            records.setdefault(row["instance_id"], []).append(StepRecord.from_row(row))
    cursor = await conn.execute(
        sql.LIVE_JOBS_OF, {"ids": ids, "kinds": sorted({DRIVING_JOB[inst.state] for inst in moving})}
    )
    jobs = {
        (row["instance_id"], row["kind"]): progress.LiveJob(
            row["id"], row["kind"], row["attempt"], row["state"]
        )
        for row in await cursor.fetchall()
    }
    wanted = progress.wanted(moving)
    expected = await (durations.of(conn, wanted) if durations else expected_durations(conn, wanted))
    out: dict[uuid.UUID, dict[str, Any]] = {}
    for inst in moving:
        job = jobs.get((inst.id, DRIVING_JOB[inst.state]))
        doc = progress.progress(inst, records.get(inst.id, []), job, expected, now or _now_of(inst))
        if doc is not None:
            out[inst.id] = doc
    return out


async def progress_of_created(
    conn: AsyncConn, inst: Instance, job: progress.LiveJob, durations: FleetDurations
) -> dict[str, Any] | None:
    """The progress of an instance the same statement created with its first job (`job`, queued):
    no step has run and the job is the live one, so nothing is read but the usual durations."""
    if inst.state not in DRIVING_JOB:
        return None
    expected = await durations.of(conn, progress.wanted([inst]))
    return progress.progress(inst, [], job, expected, _now_of(inst))
