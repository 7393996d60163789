"""What an abandoned instance job does to its instance, in the abandoning transaction (no provisioner).

The supervisor (attempts over, a permanent error) and an operator's abandon both run these hooks:
a failed provision fails the instance and enqueues the cleanup of what it created; a failed plan
change degrades it (its data is kept); a failed suspend, resume or heal degrades it; a failed
deprovision fails it, leaving what remains to the orphan sweep. Each records the failure code
(`controlplane.core.failures`) of where and why the job was given up, beside the raw reason.
"""

from __future__ import annotations

from psycopg.rows import DictRow

from controlplane.core import failures, kinds, lifecycle
from controlplane.core.kinds import DEPROVISION, HEAL
from controlplane.core.records import Instance, InstancePatch, Job
from controlplane.db import job_rows as jobs
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.instance_rows import transition_instance
from controlplane.db.transitions import Actor


async def provision_abandoned(conn: AsyncConn, row: DictRow, actor: Actor) -> None:
    """pending/provisioning -> failed with the step and error; a cleanup job removes what exists."""
    job = Job.from_row(row)
    inst = await _lock_instance(conn, job)
    if inst is None or inst.state not in lifecycle.PROVISIONING:
        return
    reason = _failure_reason(job, inst)
    await _transition_in(conn, inst, "fail", actor, reason, await _code(conn, job, actor))
    await _enqueue_cleanup(conn, inst, actor, skip_backup=True)


async def update_abandoned(conn: AsyncConn, row: DictRow, actor: Actor) -> None:
    """updating -> degraded: a failed plan change must not destroy a database that holds data.

    The instance keeps its data and its old plan; the reconciler heals it if it is broken and
    recovers it to ready. The generation given up is recorded (`failed_generation`) and not
    tried again by the reconciler: asking for a plan again makes a new generation.
    """
    job = Job.from_row(row)
    inst = await _lock_instance(conn, job)
    if inst is None or inst.state != "updating":
        return
    reason = _failure_reason(job, inst)
    asked = kinds.UpdatePayload.from_json(job.payload).spec_generation
    generation = int(asked or inst.spec_generation)
    code = await _code(conn, job, actor)
    await transition_instance(
        conn,
        inst,
        "degrade",
        actor,
        reason=reason,
        detail={"code": code},
        patch=InstancePatch(failure_reason=reason, failure_code=code, failed_generation=generation),
    )


async def degrade_abandoned(conn: AsyncConn, row: DictRow, actor: Actor) -> None:
    """A failed suspend, resume or heal: ready -> degraded with the reason (never failed)."""
    job = Job.from_row(row)
    inst = await _lock_instance(conn, job)
    if inst is None:
        return
    reason = _failure_reason(job, inst)
    code = await _code(conn, job, actor)
    if inst.state == "ready":
        await _transition_in(conn, inst, "degrade", actor, reason, code)
    elif inst.state == "degraded":
        # Lost data stays lost until a restore brings it back: its code is kept.
        if inst.failure_code == failures.DATA_LOST:
            code = failures.DATA_LOST
        # A heal given up is counted: the reconciler waits longer before each next one.
        await conn.execute(
            sql.RECORD_DEGRADED_FAILURE,
            {"reason": reason, "code": code, "heal": job.kind == HEAL, "id": inst.id},
        )


async def deprovision_abandoned(conn: AsyncConn, row: DictRow, actor: Actor) -> None:
    """deprovisioning -> failed; what remains is left to the orphan sweep and the SREs."""
    job = Job.from_row(row)
    inst = await _lock_instance(conn, job)
    if inst is None or inst.state != "deprovisioning":
        return
    reason = _failure_reason(job, inst)
    await _transition_in(conn, inst, "fail", actor, reason, await _code(conn, job, actor))


async def _lock_instance(conn: AsyncConn, job: Job) -> Instance | None:
    if job.instance_id is None:
        return None
    cursor = await conn.execute(sql.LOCK_INSTANCE, {"id": job.instance_id})
    row = await cursor.fetchone()
    return None if row is None else Instance.from_row(row)


def _failure_reason(job: Job, inst: Instance) -> str:
    """The job's last error, with the step it happened in when the error does not say."""
    error = str(job.last_error or "no error recorded")
    step = inst.progress
    if step and not error.startswith(f"{step}:"):
        error = f"at {step}: {error}"
    return f"{job.kind} failed after {job.attempt} attempt(s): {error}"[:1000]


async def _code(conn: AsyncConn, job: Job, actor: Actor) -> str:
    """The failure code of the job given up: its last error's own code, else the step its last
    attempt was in (a step that finished names none), else the operation's."""
    cursor = await conn.execute(sql.LAST_STEP_OF_JOB, {"job_id": job.id})
    last_step = await cursor.fetchone()
    step = None
    if last_step is not None and last_step["attempt"] == job.attempt and last_step["event"] != "finished":
        step = str(last_step["step"])
    cursor = await conn.execute(sql.LAST_ERROR_OF_JOB, {"job_id": job.id})
    last_error = await cursor.fetchone()
    error_code = None
    if last_error is not None and last_error["attempt"] == job.attempt:
        error_code = last_error["code"]
    return failures.given_up(job.kind, step=step, error_code=error_code, by_operator=actor.kind == "operator")


async def _transition_in(
    conn: AsyncConn, inst: Instance, event: str, actor: Actor, reason: str, code: str
) -> None:
    """`event` with the raw reason (SREs) and the code (what customers are told), in the audit row too."""
    await transition_instance(
        conn,
        inst,
        event,
        actor,
        reason=reason,
        detail={"code": code},
        patch=InstancePatch(failure_reason=reason, failure_code=code),
    )


async def _enqueue_cleanup(conn: AsyncConn, inst: Instance, actor: Actor, *, skip_backup: bool) -> None:
    await jobs.enqueue(
        conn,
        jobs.NewJob(
            DEPROVISION,
            inst.id,
            payload=kinds.DeprovisionPayload(skip_final_backup=skip_backup, cleanup=True),
        ),
        actor,
    )
