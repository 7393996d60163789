"""Backups and restores of instances: the use cases the API, the CLI and the jobs call.

The control plane holds a record of every backup its provisioner reports (`backups` table,
kept current after each backup job); a restore starts only from one of those. A restore of an
instance whose data is lost is a decision: from the newest backup (what the reconciler asks for
by itself), from a backup someone chose, or empty, accepted explicitly; each is a `restore` job
whose enqueue event names who decided, and whose `recover` transition says what was restored.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from psycopg.rows import DictRow

from controlplane import jobs, sql
from controlplane.db import AsyncConn
from controlplane.failures import DATA_LOST
from controlplane.handlers import BACKUP, RESTORE
from controlplane.transitions import Actor
from provisioners.base import BackupInfo

# States an instance can be backed up in: its server runs (read-only while suspended).
BACKUP_STATES = ("ready", "suspended")


class Refused(Exception):
    """The instance is not in a state that allows the request; `state` is where it is."""

    def __init__(self, detail: str, state: str) -> None:
        super().__init__(detail)
        self.state = state


class UnknownBackup(LookupError):
    """No backup of that id is held for the instance."""


@dataclass(frozen=True)
class RestoreChoice:
    """What to restore a lost instance from: a held backup, the newest one, or nothing (empty)."""

    backup_id: str | None = None
    empty: bool = False
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.empty and self.backup_id is not None:
            raise ValueError("choose a backup or an empty re-initialisation, not both")

    def payload(self, actor: Actor) -> dict[str, Any]:
        return {
            "backup_id": self.backup_id,
            "empty": self.empty,
            "accepted_by": str(actor),
            "reason": self.reason,
        }


def can_back_up(state: str) -> bool:
    return state in BACKUP_STATES


def can_restore(row: Mapping[str, Any]) -> bool:
    """A restore is for an instance whose data is lost (and that is waiting for it)."""
    return bool(row["state"] == "degraded" and row["failure_code"] == DATA_LOST)


async def held(
    conn: AsyncConn, instance_id: uuid.UUID, *, limit: int, before: tuple[datetime, str] | None = None
) -> list[DictRow]:
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
    return await cursor.fetchall()


async def find(conn: AsyncConn, instance_id: uuid.UUID, backup_id: str) -> DictRow | None:
    cursor = await conn.execute(sql.HELD_BACKUP, {"instance_id": instance_id, "backup_id": backup_id})
    return await cursor.fetchone()


async def newest(conn: AsyncConn, instance_id: uuid.UUID) -> DictRow | None:
    rows = await held(conn, instance_id, limit=1)
    return rows[0] if rows else None


async def record(conn: AsyncConn, instance_id: uuid.UUID, listing: Sequence[BackupInfo]) -> None:
    """Make the record what the provisioner holds now: new backups added, removed ones marked."""
    async with conn.transaction():
        await conn.execute(
            sql.RECORD_BACKUPS,
            {
                "instance_id": instance_id,
                "ids": [b.name for b in listing],
                "kinds": [b.kind for b in listing],
                "taken": [b.taken_at or datetime.now(UTC) for b in listing],
                "sizes": [b.size_bytes for b in listing],
                "locations": [b.location for b in listing],
            },
        )
        await conn.execute(sql.FORGET_BACKUPS, {"instance_id": instance_id, "ids": [b.name for b in listing]})


async def request_backup(
    conn: AsyncConn,
    row: Mapping[str, Any],
    actor: Actor,
    *,
    max_attempts: int = 5,
    request_id: str | None = None,
) -> jobs.Enqueued:
    """An on-demand backup of the instance (`row`, read in the caller's transaction)."""
    if not can_back_up(row["state"]):
        raise Refused(f"instance {row['id']} cannot be backed up while {row['state']}", row["state"])
    return await jobs.enqueue(
        conn,
        jobs.NewJob(BACKUP, row["id"], payload={"kind": "on_demand"}, max_attempts=max_attempts),
        actor,
        request_id=request_id,
    )


async def request_restore(
    conn: AsyncConn,
    row: Mapping[str, Any],
    choice: RestoreChoice,
    actor: Actor,
    *,
    max_attempts: int = 5,
    request_id: str | None = None,
) -> jobs.Enqueued:
    """A restore of the instance (`row`, locked by the caller) as `choice` says, decided by `actor`."""
    if not can_restore(row):
        raise Refused(
            f"instance {row['id']} is {row['state']} and its data is not lost: a restore brings back an "
            "instance whose data is lost (to start from a backup otherwise, create a new instance)",
            row["state"],
        )
    if choice.backup_id is not None and await find(conn, row["id"], choice.backup_id) is None:
        raise UnknownBackup(f"instance {row['id']} has no backup {choice.backup_id!r}")
    if not choice.empty and choice.backup_id is None and await newest(conn, row["id"]) is None:
        raise UnknownBackup(
            f"no backup of instance {row['id']} is held; only an empty re-initialisation is possible"
        )
    enqueued = await jobs.enqueue(
        conn,
        jobs.NewJob(RESTORE, row["id"], payload=choice.payload(actor), max_attempts=max_attempts),
        actor,
        request_id=request_id,
    )
    if not enqueued.created:
        raise Refused(
            f"a restore of instance {row['id']} is already under way (job {enqueued.job['id']})", row["state"]
        )
    return enqueued


async def backup_to_restore(
    conn: AsyncConn, instance_id: uuid.UUID, payload: Mapping[str, Any]
) -> DictRow | None:
    """The held backup a restore job's payload names (its `backup_id`, else the newest); None for
    an empty re-initialisation. UnknownBackup when the one named (or any) is not held."""
    if payload.get("empty"):
        return None
    backup_id = payload.get("backup_id")
    found = await find(conn, instance_id, str(backup_id)) if backup_id else await newest(conn, instance_id)
    if found is None:
        raise UnknownBackup(
            f"instance {instance_id} has no backup {backup_id!r}"
            if backup_id
            else f"no backup of instance {instance_id} is held"
        )
    return found
