"""Backups and restores of instances: the use cases the API (customers' and SREs') and the jobs call.

The control plane holds a record of every backup its provisioner reports (`backups` table,
kept current after each backup job); a restore starts only from one of those. A restore of an
instance whose data is lost is a decision: from the newest backup (what the reconciler asks for
by itself), from a backup someone chose, or empty, accepted explicitly; each is a `restore` job
whose enqueue event names who decided, and whose `recover` transition says what was restored.

A request names an organisation (a customer's: the instance must be one of its own, checked in
SQL) or none (an SRE's: any instance).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from controlplane.core import actions, kinds
from controlplane.core.records import Backup, Instance, RecoveryWindow
from controlplane.core.refusals import Conflict, InvalidRequest, InvalidState, NotFound
from controlplane.db import connection as db
from controlplane.db import job_rows as jobs
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor
from controlplane.services import instances
from controlplane.services.policy import Policy
from provisioners.base import BackupInfo
from provisioners.base import RecoveryWindow as Reported


@dataclass(frozen=True)
class ListBackups:
    instance_id: uuid.UUID
    # The caller's organisation; None: an SRE's look-up (any instance).
    org_id: uuid.UUID | None
    limit: int
    # Where the page starts: after this (taken_at, backup_id), newest first.
    before: tuple[datetime, str] | None = None


@dataclass(frozen=True)
class ShowRecovery:
    """An instance's recoverable window and its newest backups (a deleted one's too, while kept)."""

    instance_id: uuid.UUID
    # The caller's organisation; None: an SRE's look-up (any instance).
    org_id: uuid.UUID | None
    limit: int = 100


@dataclass(frozen=True)
class Recovery:
    """What a restore of an instance can reach: its window (None: never reported) and backups."""

    instance: Instance
    window: RecoveryWindow | None
    backups: list[Backup]


@dataclass(frozen=True)
class RequestBackup:
    instance_id: uuid.UUID
    org_id: uuid.UUID | None


@dataclass(frozen=True)
class RequestRestore:
    """What to restore a lost instance from: a held backup, the newest one, or nothing (empty)."""

    instance_id: uuid.UUID
    org_id: uuid.UUID | None
    backup_id: str | None = None
    empty: bool = False
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.empty and self.backup_id is not None:
            raise InvalidRequest("backup_id", "choose a backup or an empty re-initialisation, not both")


@dataclass(frozen=True)
class BackupRequested:
    """The backup job of the request: a new one, or the one already under way (`created` False)."""

    instance_id: uuid.UUID
    job_id: uuid.UUID
    created: bool


async def list_backups(conn: AsyncConn, request: ListBackups) -> list[Backup]:
    """A page of the backups held of the instance (NotFound if it is not the caller's to see)."""
    await instances.load(conn, request.org_id, request.instance_id)
    return await held(conn, request.instance_id, limit=request.limit, before=request.before)


async def recovery(conn: AsyncConn, request: ShowRecovery) -> Recovery:
    """The instance's recoverable window and newest backups (NotFound if it is not the caller's)."""
    inst = await instances.load(conn, request.org_id, request.instance_id)
    return Recovery(inst, await window(conn, inst.id), await held(conn, inst.id, limit=request.limit))


async def request_backup(
    conn: AsyncConn, actor: Actor, request_id: str | None, request: RequestBackup, policy: Policy
) -> BackupRequested:
    """An on-demand backup of a running instance (ready or suspended), beside the plan's schedule;
    asking while one is under way gives that one."""
    if not policy.supports_backups:
        raise Conflict(f"the {policy.provisioner} provisioner takes no backups")
    async with db.transaction(conn):
        inst = await instances.load(conn, request.org_id, request.instance_id, lock=True)
        if not actions.can_back_up(inst.state):
            raise InvalidState(
                f"instance {inst.id} cannot be backed up while {inst.state}",
                current_state=inst.state,
                allowed_actions=actions.of(inst),
            )
        payload = kinds.BackupPayload(backup_kind="on_demand")
        enqueued = await _enqueue_once(conn, actor, request_id, policy, inst, payload)
    return BackupRequested(inst.id, enqueued.job["id"], enqueued.created)


async def request_restore(
    conn: AsyncConn, actor: Actor, request_id: str | None, request: RequestRestore, policy: Policy
) -> Instance:
    """The decision for an instance whose data is lost: a restore job as `request` says, decided
    by `actor` (named in the job's enqueue event and in the `recover` that ends it)."""
    async with db.transaction(conn):
        inst = await instances.load(conn, request.org_id, request.instance_id, lock=True)
        if not actions.can_restore(inst.state, inst.failure_code, deletion_requested=inst.deletion_requested):
            why = (
                "its deletion has been requested"
                if inst.deletion_requested
                else f"it is {inst.state} and its data is not lost"
            )
            raise InvalidState(
                f"instance {inst.id} cannot be restored: {why}. A restore brings back an instance whose "
                "data is lost (to start from a backup otherwise, create a new instance)",
                current_state=inst.state,
                allowed_actions=actions.of(inst),
            )
        if request.backup_id is not None and await find(conn, inst.id, request.backup_id) is None:
            raise InvalidRequest("backup_id", f"instance {inst.id} has no backup {request.backup_id!r}")
        if not request.empty and request.backup_id is None and await newest(conn, inst.id) is None:
            raise InvalidState(
                f"no backup of instance {inst.id} is held; only an empty re-initialisation is possible",
                current_state=inst.state,
                allowed_actions=actions.of(inst),
            )
        payload = kinds.RestorePayload(
            request.reason, backup_id=request.backup_id, empty=request.empty, accepted_by=str(actor)
        )
        enqueued = await _enqueue_once(conn, actor, request_id, policy, inst, payload)
        if not enqueued.created:
            raise InvalidState(
                f"a restore of instance {inst.id} is already under way (job {enqueued.job['id']})",
                current_state=inst.state,
                allowed_actions=actions.of(inst),
            )
    return inst


async def _enqueue_once(
    conn: AsyncConn,
    actor: Actor,
    request_id: str | None,
    policy: Policy,
    inst: Instance,
    payload: kinds.Payload,
) -> jobs.Enqueued:
    """The instance's live job of the payload's kind, else a new one (the instance is locked).

    Looked for first: an insert that meets the index entry of a live job a worker is moving at that
    moment (claim, start, heartbeat) can deadlock with the worker; with the live job seen, there is
    no insert."""
    cursor = await conn.execute(sql.LIVE_JOBS_FOR, {"instance_ids": [inst.id], "kinds": [payload.kind]})
    live = await cursor.fetchone()
    if live is not None:
        return jobs.Enqueued(live, False)
    job = jobs.NewJob(payload.kind, inst.id, payload=payload, max_attempts=policy.job_max_attempts)
    return await jobs.enqueue(conn, job, actor, request_id=request_id)


# ---- the record of held backups (the backup and restore jobs read and write it) ---------------------


async def held(
    conn: AsyncConn, instance_id: uuid.UUID, *, limit: int, before: tuple[datetime, str] | None = None
) -> list[Backup]:
    """Backups held of the instance, newest first, starting after `before` (taken_at, backup_id)."""
    cursor = await conn.execute(
        sql.HELD_BACKUPS,
        {
            "instance_id": instance_id,
            "before_taken": before[0] if before else None,
            "before_id": before[1] if before else None,
            "limit": limit,
        },
    )
    return [Backup.from_row(row) for row in await cursor.fetchall()]


async def find(conn: AsyncConn, instance_id: uuid.UUID, backup_id: str) -> Backup | None:
    cursor = await conn.execute(sql.HELD_BACKUP, {"instance_id": instance_id, "backup_id": backup_id})
    row = await cursor.fetchone()
    return None if row is None else Backup.from_row(row)


async def newest(conn: AsyncConn, instance_id: uuid.UUID) -> Backup | None:
    rows = await held(conn, instance_id, limit=1)
    return rows[0] if rows else None


async def record(conn: AsyncConn, instance_id: uuid.UUID, listing: Sequence[BackupInfo]) -> None:
    """Make the record what the provisioner holds now: new backups added, removed ones marked."""
    async with db.transaction(conn):
        await conn.execute(
            sql.RECORD_BACKUPS,
            {
                "instance_id": instance_id,
                "ids": [b.name for b in listing],
                "kinds": [b.kind for b in listing],
                "taken": [b.taken_at or datetime.now(UTC) for b in listing],
                "sizes": [b.size_bytes for b in listing],
                "locations": [b.location for b in listing],
                "types": [b.type for b in listing],
            },
        )
        await conn.execute(sql.FORGET_BACKUPS, {"instance_id": instance_id, "ids": [b.name for b in listing]})


async def window(conn: AsyncConn, instance_id: uuid.UUID) -> RecoveryWindow | None:
    cursor = await conn.execute(sql.RECOVERY_WINDOW, {"instance_id": instance_id})
    row = await cursor.fetchone()
    return None if row is None else RecoveryWindow.from_row(row)


async def record_windows(conn: AsyncConn, windows: Mapping[uuid.UUID, Reported]) -> None:
    """Record the windows the provisioner reported (observations, backup and deletion jobs)."""
    if not windows:
        return
    reported = list(windows.values())
    await conn.execute(
        sql.RECORD_RECOVERY_WINDOWS,
        {
            "ids": list(windows),
            "earliest": [_moment(w.earliest) for w in reported],
            "latest": [_moment(w.latest) for w in reported],
            "healthy": [w.archive_healthy for w in reported],
            "details": [w.archive_detail for w in reported],
            "lag_s": [w.lag_s for w in reported],
            "lag_bytes": [w.lag_bytes for w in reported],
            "archived": [_moment(w.last_archived_at) for w in reported],
            "observed": [_moment(w.observed_at) for w in reported],
            "retained": [_moment(w.retained_until) for w in reported],
        },
    )


def _moment(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value)


async def backup_to_restore(
    conn: AsyncConn, instance_id: uuid.UUID, payload: kinds.RestorePayload
) -> Backup | None:
    """The held backup a restore job's payload names (its `backup_id`, else the newest); None for
    an empty re-initialisation. NotFound when the one named (or any) is not held."""
    if payload.empty:
        return None
    backup_id = payload.backup_id
    found = await find(conn, instance_id, backup_id) if backup_id else await newest(conn, instance_id)
    if found is None:
        raise NotFound(
            f"instance {instance_id} has no backup {backup_id!r}"
            if backup_id
            else f"no backup of instance {instance_id} is held"
        )
    return found
