"""The instance use cases: create, change (plan, deletion protection), request deletion (of a failed
instance: archive it and remove what it left), retry a failed instance, and the pages an
organisation reads (its instances, an instance's audit log).

Each runs in one transaction: the instance row, its audit row and the job that carries the
request out commit together or not at all. A request that cannot run now is recorded on the
instance (a new spec generation, a deletion request) and carried out as soon as it can.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from psycopg.rows import DictRow
from psycopg_pool import AsyncConnectionPool

from controlplane.core import actions, cursors, failures, kinds, lifecycle, plans
from controlplane.core.records import Instance, RecoveryWindow
from controlplane.core.refusals import (
    AlreadyReplaced,
    AmbiguousName,
    Conflict,
    DeletionProtected,
    InvalidRequest,
    InvalidState,
    NotFound,
    NotRetryable,
    OutsideWindow,
    PreconditionFailed,
    Unsupported,
)
from controlplane.db import connection as db
from controlplane.db import instance_rows as instances
from controlplane.db import job_rows as jobs
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.constraints import unique_violations
from controlplane.db.transitions import Actor
from controlplane.services import idempotency
from controlplane.services.policy import Policy
from provisioners.base import RestoreSource

# Deletion can start at once from these states; from the others it waits (the reconciler enqueues it).
DEPROVISIONABLE_NOW = lifecycle.INSTANCE.states_allowing("deprovision")
# Where an instance is once its deletion has started.
DEPROVISIONING = lifecycle.INSTANCE.targets_of("deprovision")


@dataclass(frozen=True)
class Versions:
    """The versions of the instance a change was asked against (its ETags, `Instance.etag`, as an
    If-Match names them): the change is made only if the instance is still at one of them."""

    allowed: frozenset[str]
    # The precondition as the caller gave it, for the refusal.
    given: str


@dataclass(frozen=True)
class CreateInstance:
    org_id: uuid.UUID
    name: str
    plan: str
    region: str | None = None
    deletion_protection: bool = False
    # Fill the new instance from another instance's backup or point in time (of the same organisation).
    restore_from: RestoreSource | None = None


@dataclass(frozen=True)
class ChangeInstance:
    org_id: uuid.UUID
    instance_id: uuid.UUID
    # A plan other than the declared one (or the declared one again after its update was given up).
    plan: str | None = None
    deletion_protection: bool | None = None
    if_versions: Versions | None = None


@dataclass(frozen=True)
class RequestDeletion:
    org_id: uuid.UUID
    instance_id: uuid.UUID
    skip_final_backup: bool = False
    if_versions: Versions | None = None


@dataclass(frozen=True)
class RetryInstance:
    org_id: uuid.UUID
    instance_id: uuid.UUID


@dataclass(frozen=True)
class InstanceResult:
    """The instance as the use case left it, and the kind of the job it enqueued (if any)."""

    instance: Instance
    enqueued: str | None = None
    # The id of the job enqueued by the statement that created the instance (its first job, still
    # queued): the instance's progress is then known without reading it.
    first_job: uuid.UUID | None = None


async def create(
    conn: AsyncConn, actor: Actor, request_id: str | None, request: CreateInstance, policy: Policy
) -> InstanceResult:
    """A new instance in `pending` and its `provision` job; NameTaken if a live one has the name.

    A `restore_from` names an instance of the same organisation (NotFound otherwise, as for a read)
    and needs a provisioner that restores into a new instance (Unsupported otherwise)."""
    spec: dict[str, object] = {"plan": request.plan, "region": request.region}
    if request.restore_from is not None:
        spec["restore_from"] = request.restore_from.as_dict()
    payload = kinds.ProvisionPayload()
    # The instance, its provision job and their events are one statement: one round trip.
    job = jobs.NewJob(payload.kind, payload=payload, max_attempts=policy.job_max_attempts)
    with unique_violations(name=request.name):
        async with db.transaction(conn) if request.restore_from is not None else contextlib.nullcontext():
            if request.restore_from is not None:
                await _check_restore_source(conn, request.org_id, request.restore_from, policy)
            row = await instances.create_instance(
                conn,
                request.org_id,
                request.name,
                spec,
                actor,
                deadline_s=policy.pending_deadline_s,
                deletion_protection=request.deletion_protection,
                request_id=request_id,
                first_job=job,
            )
    return InstanceResult(Instance.from_row(row), payload.kind, row["_job_id"])


async def change(
    conn: AsyncConn, actor: Actor, request_id: str | None, request: ChangeInstance, policy: Policy
) -> InstanceResult:
    """Record a new plan (a new spec generation) and/or deletion protection; enqueue the update
    when the instance can take it now (else the reconciler does once it is ready)."""
    async with db.transaction(conn):
        inst = await _load_to_change(conn, request.org_id, request.instance_id, request.if_versions)
        if inst.deletion_requested or not actions.can_still_update(inst.state):
            why = "its deletion has been requested" if inst.deletion_requested else f"it is {inst.state}"
            raise InvalidState(
                f"instance {inst.id} cannot be changed: {why}",
                current_state=inst.state,
                allowed_actions=actions.of(inst),
            )
        # A plan other than the declared one, or the declared one again after its update was
        # given up (a retry): either makes a new spec generation.
        new_plan = request.plan is not None and (
            request.plan != inst.plan or inst.failed_generation == inst.spec_generation
        )
        protection = request.deletion_protection
        if new_plan or (protection is not None and protection != inst.deletion_protection):
            await conn.execute(
                sql.CHANGE_INSTANCE_SPEC,
                {
                    "new_plan": new_plan,
                    "plan": request.plan,
                    "protection": protection,
                    "id": inst.id,
                    "org": request.org_id,
                },
            )
        inst = await load(conn, request.org_id, request.instance_id)
        enqueued = None
        if new_plan and "update" in lifecycle.INSTANCE.allowed_events(inst.state):
            payload = kinds.UpdatePayload(spec_generation=inst.spec_generation)
            enqueued = await _enqueue(conn, actor, request_id, policy, inst, payload)
    return InstanceResult(inst, enqueued)


async def request_deletion(
    conn: AsyncConn, actor: Actor, request_id: str | None, request: RequestDeletion, policy: Policy
) -> InstanceResult:
    """Record the deletion request; enqueue the deprovision when it can start now (else as soon as
    it can). Asking again while the deletion is recorded or running changes nothing."""
    async with db.transaction(conn):
        inst = await _load_to_change(conn, request.org_id, request.instance_id, request.if_versions)
        if inst.state == "failed":
            return await _archive(conn, actor, request_id, request, policy, inst)
        if inst.state in lifecycle.INSTANCE.terminal:
            raise InvalidState(
                f"instance {inst.id} is {inst.state}",
                current_state=inst.state,
                allowed_actions=actions.of(inst),
            )
        if inst.deletion_protection:
            raise DeletionProtected(
                f"instance {inst.id} has deletion protection on; turn it off with PATCH first",
                current_state=inst.state,
                allowed_actions=actions.of(inst),
            )
        enqueued = None
        if not inst.deletion_requested and inst.state not in DEPROVISIONING:
            await conn.execute(
                sql.REQUEST_DELETION,
                {"skip_final_backup": request.skip_final_backup, "id": inst.id, "org": request.org_id},
            )
            if inst.state in DEPROVISIONABLE_NOW:
                payload = kinds.DeprovisionPayload(skip_final_backup=request.skip_final_backup)
                enqueued = await _enqueue(conn, actor, request_id, policy, inst, payload)
            inst = await load(conn, request.org_id, request.instance_id)
    return InstanceResult(inst, enqueued)


async def _archive(
    conn: AsyncConn,
    actor: Actor,
    request_id: str | None,
    request: RequestDeletion,
    policy: Policy,
    inst: Instance,
) -> InstanceResult:
    """A failed instance deleted: archived (no state change: `failed` is terminal), and a cleanup
    job removes what its failure left, through the provisioner, fenced like every job. Asking
    again changes nothing but enqueues the cleanup again if none is live (removal is idempotent).
    Deletion protection guards data a failed instance can no longer serve: it does not block this.
    A final backup is taken only of an instance that was once ready (one that never was holds none).
    """
    await conn.execute(sql.ARCHIVE_INSTANCE, {"id": inst.id, "org": request.org_id})
    skip = request.skip_final_backup or inst.observed_generation == 0
    payload = kinds.DeprovisionPayload(reason="deleted by its customer", skip_final_backup=skip, cleanup=True)
    enqueued = await _enqueue(conn, actor, request_id, policy, inst, payload)
    return InstanceResult(await load(conn, request.org_id, request.instance_id), enqueued)


async def retry(
    conn: AsyncConn, actor: Actor, request_id: str | None, request: RetryInstance, policy: Policy
) -> InstanceResult:
    """A new instance from a failed one's spec, name and deletion protection, linked both ways (the
    new one `replaces` it; it is then `replaced_by` the new one) and provisioned like a created one.

    The failed instance stays as it is (terminal). Refused when it is not failed or archived
    (InvalidState), when its reason says a retry cannot help (NotRetryable), when it was retried
    already (AlreadyReplaced), or when a live instance has its name now (NameTaken).
    """
    with unique_violations(replaces=request.instance_id):
        async with db.transaction(conn):
            # Locked (not changed): two retries of one instance run one after the other.
            old = await load(conn, request.org_id, request.instance_id, lock=True)
            if old.state != "failed" or old.archived_at is not None:
                why = "it was deleted (archived)" if old.archived_at is not None else f"it is {old.state}"
                raise InvalidState(
                    f"instance {old.id} cannot be retried: {why}",
                    current_state=old.state,
                    allowed_actions=actions.of(old),
                )
            reason = failures.reason(old.failure_code)
            if not reason.retryable:
                raise NotRetryable(
                    f"instance {old.id} cannot be retried: {reason.message} {reason.hint}",
                    current_state=old.state,
                    allowed_actions=actions.of(old),
                    failure=reason.as_dict(),
                )
            if old.replaced_by is not None:
                raise AlreadyReplaced(
                    f"instance {old.id} has been retried already: instance {old.replaced_by}",
                    replaced_by=old.replaced_by,
                )
            # A unique violation aborts the transaction, which then rolls back on the way out.
            with unique_violations(name=old.name):
                row = await instances.create_instance(
                    conn,
                    request.org_id,
                    old.name,
                    old.spec,
                    actor,
                    deadline_s=policy.pending_deadline_s,
                    deletion_protection=old.deletion_protection,
                    request_id=request_id,
                    replaces=old.id,
                )
            new = Instance.from_row(row)
            enqueued = await _enqueue(conn, actor, request_id, policy, new, kinds.ProvisionPayload())
    return InstanceResult(new, enqueued)


async def load(
    conn: AsyncConn, org_id: uuid.UUID | None, instance_id: uuid.UUID, *, lock: bool = False
) -> Instance:
    """The organisation's instance (scoped in SQL), or NotFound; `org_id` None: of any organisation
    (an SRE's request)."""
    if org_id is None:
        statement = sql.LOCK_ANY_INSTANCE if lock else sql.ANY_INSTANCE
    else:
        statement = sql.LOCK_ORG_INSTANCE if lock else sql.ORG_INSTANCE
    cursor = await conn.execute(statement, {"id": instance_id, "org": org_id})
    row = await cursor.fetchone()
    if row is None:
        raise NotFound(f"no instance {instance_id}")
    return Instance.from_row(row)


async def resolve(conn: AsyncConn, org_id: uuid.UUID, ref: str) -> uuid.UUID:
    """The id an organisation's reference names: an id as it is, a name by one look-up (its live
    instance; else its one instance of that name neither archived nor retried). NotFound for a
    name none has; AmbiguousName when several dead ones had it and none is live."""
    try:
        return uuid.UUID(ref)
    except ValueError:
        pass
    rows = await (await conn.execute(sql.INSTANCES_NAMED, {"org": org_id, "name": ref})).fetchall()
    if not rows:
        raise NotFound(f"no instance named {ref!r}")
    if rows[0]["live"] or len(rows) == 1:
        found: uuid.UUID = rows[0]["id"]
        return found
    ids = [row["id"] for row in rows]
    raise AmbiguousName(
        f"{len(ids)} instances named {ref!r}, none of them live: use an id ({', '.join(map(str, ids))})",
        candidates=ids,
    )


async def resolve_any(conn: AsyncConn, ref: str) -> uuid.UUID:
    """The id an SRE's reference names: an id as it is, or the name of one live instance of any
    organisation (NotFound for none; AmbiguousName for several: use an id)."""
    try:
        return uuid.UUID(ref)
    except ValueError:
        pass
    rows = await (await conn.execute(sql.LIVE_INSTANCES_NAMED_ANYWHERE, {"name": ref})).fetchall()
    if not rows:
        raise NotFound(f"no live instance named {ref!r}")
    if len(rows) > 1:
        ids = [row["id"] for row in rows]
        raise AmbiguousName(
            f"{len(ids)} live instances named {ref!r}: use an id ({', '.join(map(str, ids))})", candidates=ids
        )
    found: uuid.UUID = rows[0]["id"]
    return found


async def request_switchover(
    conn: AsyncConn, ref: str, actor: Actor, reason: str, request_id: str | None = None
) -> uuid.UUID:
    """An SRE's switchover of a ready HA instance: an update job that moves its primary to a standby
    (ready -> updating -> ready, the plan unchanged), audited with who asked and why. Returns the
    job's id; refused for an instance that is not ready, has no standby, or is being changed."""
    instance_id = await resolve_any(conn, ref)
    inst = await load(conn, None, instance_id, lock=True)
    plan = plans.SHAPES.get(str(inst.plan))
    if plan is None or plan.instances <= 1:
        raise Unsupported(f"instance {inst.id} (plan {inst.plan}) has one server: nothing to switch over to")
    if inst.state != "ready":
        raise InvalidState(
            f"a switchover needs a ready instance; {inst.id} is {inst.state}",
            current_state=inst.state,
            allowed_actions=[],
        )
    payload = kinds.UpdatePayload(reason=f"switchover asked by {actor}: {reason}", switchover=True)
    job = jobs.NewJob(payload.kind, inst.id, payload=payload)
    result = await jobs.enqueue(conn, job, actor, request_id=request_id)
    if not result.created:
        raise Conflict(f"instance {inst.id} has an update under way already")
    job_id: uuid.UUID = result.job["id"]
    return job_id


async def _check_restore_source(
    conn: AsyncConn, org_id: uuid.UUID, source: RestoreSource, policy: Policy
) -> None:
    """The source is the organisation's (live or deleted), and what is asked of it is held: the
    named backup, and the point in time inside its recoverable window (where the provisioner
    reports one)."""
    cursor = await conn.execute(sql.ORG_HAS_INSTANCE, {"id": source.instance_id, "org": org_id})
    if await cursor.fetchone() is None:
        raise NotFound(f"restore_from.instance_id: no instance {source.instance_id}")
    if not policy.supports_restore:
        raise Unsupported(
            f"restore_from is not supported by the {policy.provisioner} provisioner of this service"
        )
    backup = None
    if source.backup is not None and policy.supports_backups:
        cursor = await conn.execute(
            sql.HELD_BACKUP, {"instance_id": source.instance_id, "backup_id": source.backup}
        )
        backup = await cursor.fetchone()
        if backup is None:
            raise InvalidRequest(
                "restore_from.backup", f"instance {source.instance_id} holds no backup {source.backup!r}"
            )
    if not policy.reports_windows or (source.backup is not None and source.point_in_time is None):
        return
    row = await (await conn.execute(sql.RECOVERY_WINDOW, {"instance_id": source.instance_id})).fetchone()
    window = None if row is None else RecoveryWindow.from_row(row)
    shown = None if window is None else (_rfc3339(window.earliest_at), _rfc3339(window.latest_at))
    if source.point_in_time is None:
        if window is None or window.earliest_at is None:
            raise OutsideWindow(
                "restore_from.instance_id",
                f"instance {source.instance_id} has nothing to restore yet (no backup of it is held)",
                shown,
            )
        return
    moment = datetime.fromisoformat(source.point_in_time)
    if backup is not None and moment < backup["taken_at"] + timedelta(seconds=1):
        raise OutsideWindow(
            "restore_from.point_in_time",
            f"{source.point_in_time} is before backup {source.backup} ended ({_rfc3339(backup['taken_at'])})",
            shown,
        )
    if window is None or not window.covers(moment):
        span = "none: nothing is restorable yet" if shown is None else f"from {shown[0]} to {shown[1]}"
        raise OutsideWindow(
            "restore_from.point_in_time",
            f"{source.point_in_time} is outside the recoverable window of instance {source.instance_id}"
            f" ({span})",
            shown,
        )


def _rfc3339(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat().replace("+00:00", "Z")


async def _enqueue(
    conn: AsyncConn,
    actor: Actor,
    request_id: str | None,
    policy: Policy,
    inst: Instance,
    payload: kinds.Payload,
) -> str:
    """The job that carries the request out, in the use case's transaction; returns its kind."""
    job = jobs.NewJob(payload.kind, inst.id, payload=payload, max_attempts=policy.job_max_attempts)
    await jobs.enqueue(conn, job, actor, request_id=request_id)
    return payload.kind


async def _load_to_change(
    conn: AsyncConn, org_id: uuid.UUID, instance_id: uuid.UUID, if_versions: Versions | None
) -> Instance:
    """The instance locked for a change, once its version precondition (if any) holds."""
    inst = await load(conn, org_id, instance_id, lock=True)
    if if_versions is not None and inst.etag not in if_versions.allowed:
        raise PreconditionFailed(
            f'If-Match {if_versions.given} does not match the instance\'s ETag "{inst.etag}"',
            current_state=inst.state,
            current_version=inst.state_version,
        )
    return inst


# ---- behind an Idempotency-Key (the API's and the console's creating requests) --------------------

# How an entry point answers a creating request with the instance it made (stored for its key).
Render = Callable[[AsyncConn, InstanceResult], Awaitable[idempotency.StoredResponse]]


async def once(
    pool: AsyncConnectionPool[AsyncConn],
    org_id: uuid.UUID,
    keyed: idempotency.Keyed,
    use_case: Callable[[AsyncConn], Awaitable[InstanceResult]],
    render: Render,
) -> idempotency.Answer:
    """A creating use case (`create`, `retry`) once per Idempotency-Key, answered by `render`: the
    same key and request again answers what the first one answered."""

    async def run(conn: AsyncConn) -> idempotency.StoredResponse:
        return await render(conn, await use_case(conn))

    return await idempotency.once_per_key(pool, org_id, keyed, run)


# ---- the pages an organisation reads --------------------------------------------------------------


@dataclass(frozen=True)
class ListInstances:
    """Which of an organisation's instances a page lists (archived ones only when asked for)."""

    org_id: uuid.UUID
    state: str | None = None
    name: str | None = None
    archived: bool = False
    live: bool = False


async def list_page(
    conn: AsyncConn, asked: ListInstances, *, limit: int, cursor: str | None
) -> tuple[Sequence[Instance], str | None]:
    """A page of an organisation's instances, oldest first, and the cursor of the next page."""
    after_created, after_id = cursors.after_created(cursor) or (None, None)
    rows = await (
        await conn.execute(
            sql.LIST_ORG_INSTANCES,
            {
                "org": asked.org_id,
                "state": asked.state,
                "name": asked.name,
                "archived": asked.archived,
                "live": asked.live,
                "after_created": after_created,
                "after_id": after_id,
                "limit": limit + 1,
            },
        )
    ).fetchall()
    found = [Instance.from_row(row) for row in rows]
    return cursors.page_of(found, limit, lambda last: cursors.created_cursor(last.created_at, last.id))


async def last_event(conn: AsyncConn, org_id: uuid.UUID, instance_id: uuid.UUID) -> DictRow | None:
    """The newest audit event of an organisation's instance (a deleted one's says what its deletion
    kept: `detail.backup`), None if it has none of that id."""
    cursor = await conn.execute(sql.ORG_INSTANCE_LAST_EVENT, {"id": instance_id, "org": org_id})
    return await cursor.fetchone()


async def events_page(
    conn: AsyncConn, org_id: uuid.UUID, instance_id: uuid.UUID, *, limit: int, cursor: str | None
) -> tuple[Sequence[DictRow], str | None]:
    """A page of an organisation's instance's audit log, oldest first (NotFound if it has none of
    that id), and the cursor of the next page."""
    after = cursors.after_id(cursor)
    await load(conn, org_id, instance_id)
    rows = await (
        await conn.execute(
            sql.ORG_INSTANCE_EVENTS, {"id": instance_id, "org": org_id, "after": after, "limit": limit + 1}
        )
    ).fetchall()
    return cursors.page_of(rows, limit, cursors.id_cursor)
