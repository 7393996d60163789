"""Signed checkpoints of the audit log, and the reconciler's audit step (partitions ahead, checkpoints).

A checkpoint records, signed, the number of events in the log and the head (seq, hash, time) of
every chain that moved since the previous checkpoint, and links to that checkpoint's hash. A
rewrite of any event at or before a recorded head changes that head's hash, which the signature
pins: only events newer than the last checkpoint can be rewritten unseen, and only until the next.

Which events a checkpoint saw is its snapshot's business, not their ids' (an id is taken before its
transaction commits). The cut is a time at or before the start of every transaction still running
when the snapshot was taken: an event the checkpoint did not see has `at` at or after the cut, and
each entity's events are in time order, so the events after a checkpoint are a suffix of each
chain found by time (partition pruning, the `at` indexes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from psycopg.rows import DictRow
from psycopg_pool import AsyncConnectionPool

from controlplane.audit import chain, signing_key
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.runtime import metrics
from controlplane.runtime.secretbox import SecretBox
from controlplane.runtime.settings import Settings

log = logging.getLogger(__name__)

# Held while a checkpoint is made, so two makers (the reconciler, an export) take turns.
CHECKPOINT_LOCK = 0x637063686B7074
# How often the reconciler makes sure the partitions ahead exist.
PARTITION_CHECK_EVERY = timedelta(hours=1)


def as_checkpoint(row: DictRow) -> chain.Checkpoint:
    return chain.Checkpoint(
        number=row["number"],
        at=row["at"],
        cut=row["cut"],
        prev_hash=None if row["prev_hash"] is None else bytes(row["prev_hash"]),
        events=row["events"],
        heads=row["heads"],
        heads_digest=bytes(row["heads_digest"]),
    )


async def latest(conn: AsyncConn) -> DictRow | None:
    cursor = await conn.execute(sql.LATEST_CHECKPOINT)
    return await cursor.fetchone()


async def by_number(conn: AsyncConn, number: int) -> DictRow | None:
    cursor = await conn.execute(sql.CHECKPOINT_BY_NUMBER, {"number": number})
    return await cursor.fetchone()


async def _scalar(conn: AsyncConn, query: str, params: dict[str, Any] | None = None) -> Any:
    cursor = await conn.execute(query, params)
    row = await cursor.fetchone()
    assert row is not None
    return next(iter(row.values()))


async def _heads(conn: AsyncConn, since: datetime | None) -> list[chain.Head]:
    heads: list[chain.Head] = []
    for entity in sql.ENTITY_TABLES:
        query = sql.CHAIN_HEADS[entity] if since is None else sql.CHAIN_HEADS_SINCE[entity]
        cursor = await conn.execute(query, {"since": since})
        heads += [
            chain.Head(entity, str(row["entity_id"]), row["seq"], bytes(row["hash"]), row["at"])
            for row in await cursor.fetchall()
        ]
    return sorted(heads, key=chain.head_order)


async def record(conn: AsyncConn, box: SecretBox) -> DictRow | None:
    """Make, sign and store a checkpoint of what is committed now; None when nothing was added
    since the last one. `conn` must be in autocommit mode (the cut is read before the snapshot)."""
    key = await signing_key.ensure_key(conn, box)
    await conn.execute(sql.LOCK_CHECKPOINTS, {"key": CHECKPOINT_LOCK})
    try:
        cut = await _scalar(conn, sql.CHECKPOINT_CUT)
        async with conn.transaction():
            await conn.execute(sql.SNAPSHOT)
            prev = await latest(conn)
            since = None if prev is None else prev["cut"]
            heads = await _heads(conn, since)
            counted = sql.COUNT_EVENTS if since is None else sql.COUNT_EVENTS_SINCE
            seen = int(await _scalar(conn, counted, {"since": since}))
            events = seen if prev is None else prev["events"] - prev["tail"] + seen
            if prev is not None and events == prev["events"]:
                return None
            tail = int(await _scalar(conn, sql.COUNT_EVENTS_SINCE, {"since": cut}))
            at = await _scalar(conn, sql.DATABASE_NOW)
            checkpoint = chain.Checkpoint(
                number=1 if prev is None else prev["number"] + 1,
                at=at,
                cut=cut,
                prev_hash=None if prev is None else bytes(prev["hash"]),
                events=events,
                heads=len(heads),
                heads_digest=chain.heads_digest(heads),
            )
            cursor = await conn.execute(
                sql.RECORD_CHECKPOINT,
                {
                    "number": checkpoint.number,
                    "at": checkpoint.at,
                    "cut": checkpoint.cut,
                    "prev_hash": checkpoint.prev_hash,
                    "events": checkpoint.events,
                    "tail": tail,
                    "heads": checkpoint.heads,
                    "heads_digest": checkpoint.heads_digest,
                    "hash": checkpoint.hash(),
                    "key": key.fingerprint,
                    "signature": key.sign(checkpoint.body()),
                },
            )
            row = await cursor.fetchone()
            async with conn.cursor().copy(sql.COPY_CHECKPOINT_HEADS) as copy:
                for head in heads:
                    await copy.write_row(
                        (checkpoint.number, head.entity, head.entity_id, head.seq, head.hash, head.at)
                    )
    finally:
        await conn.execute(sql.UNLOCK_CHECKPOINTS, {"key": CHECKPOINT_LOCK})
    assert row is not None
    metrics.AUDIT_CHECKPOINT_AT.set(row["at"].timestamp())
    log.info(
        "audit checkpoint recorded",
        extra={"checkpoint": row["number"], "events": row["events"], "heads": row["heads"]},
    )
    return row


async def ensure_partitions(conn: AsyncConn, now: datetime, months_ahead: int) -> list[str]:
    """Make the event tables' monthly partitions through `months_ahead` months after `now`'s."""
    through = month_start(now, months_ahead)
    cursor = await conn.execute(sql.ENSURE_PARTITIONS, {"through": through})
    made = [row["name"] for row in await cursor.fetchall()]
    metrics.AUDIT_PARTITIONS_UNTIL.set(month_start(now, months_ahead + 1).timestamp())
    for name in made:
        log.info("event partition made", extra={"partition": name})
    return made


def month_start(at: datetime, months: int = 0) -> datetime:
    """The first instant (UTC) of the month `months` after `at`'s."""
    at = at.astimezone(UTC)
    month = at.month - 1 + months
    return datetime(at.year + month // 12, month % 12 + 1, 1, tzinfo=UTC)


@dataclass
class MaintenanceResult:
    partitions: list[str] = field(default_factory=list)
    checkpoint: int | None = None


class AuditMaintenance:
    """The reconciler's audit step: partitions made ahead, a signed checkpoint every interval."""

    def __init__(self, settings: Settings, pool: AsyncConnectionPool[AsyncConn], box: SecretBox) -> None:
        self.settings = settings
        self.pool = pool
        self.box = box
        self._partitions_checked: datetime | None = None

    async def run_once(self, now: datetime | None = None) -> MaintenanceResult:
        """`now` replaces the database clock in the decisions (tests)."""
        result = MaintenanceResult()
        async with self.pool.connection() as conn:
            clock: datetime = now or await _scalar(conn, sql.DATABASE_NOW)
            checked = self._partitions_checked
            if checked is None or not timedelta(0) <= clock - checked < PARTITION_CHECK_EVERY:
                result.partitions = await ensure_partitions(
                    conn, clock, self.settings.reconciler.audit_partition_months_ahead
                )
                self._partitions_checked = clock
            last = await latest(conn)
            interval = timedelta(seconds=self.settings.reconciler.audit_checkpoint_interval_s)
            if last is None or clock - last["at"] >= interval:
                made = await record(conn, self.box)
                result.checkpoint = None if made is None else made["number"]
            else:
                metrics.AUDIT_CHECKPOINT_AT.set(last["at"].timestamp())
        return result
