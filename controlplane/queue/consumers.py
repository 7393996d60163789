"""Durable named consumers of the instance event log: stored positions, passes, wake-ups and lag.

A consumer reads the instance events after its stored position, in (writing transaction, id)
order and only below the oldest transaction still running (`pg_snapshot_xmin`): an event whose
transaction took its id early and commits late is read when it commits, never skipped. Each
batch's effects commit in one transaction and the position in the next, so a crash between the
two replays the batch: delivery is at least once, and every effect is idempotent per event (its
rows are keyed by the event id). One runner at a time per consumer, across replicas (an advisory
lock held for the pass). Runners wake on the transitions' notifications and poll as a fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from controlplane.db import connection as db
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.runtime import metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogEvent:
    """One instance event as consumers see it (with the instance's organisation)."""

    id: int
    xid: int
    instance_id: uuid.UUID
    org_id: uuid.UUID
    from_state: str | None
    to_state: str
    event: str
    actor_kind: str
    actor_id: str
    reason: str | None
    detail: Mapping[str, Any]
    at: datetime
    seq: int
    state_version: int

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> LogEvent:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})


# An effect of one event, run inside the batch's transaction on `conn`; it must be idempotent
# per event (a batch is replayed after a crash before its position was stored).
Effect = Callable[[AsyncConn, LogEvent], Awaitable[None]]
# Called after a batch's effects committed and before its position is stored (tests stop there).
AfterEffects = Callable[[str, Sequence[LogEvent]], Awaitable[None]]


@dataclass(frozen=True)
class Consumer:
    name: str
    effect: Effect


@dataclass(frozen=True)
class Lag:
    events: int
    seconds: float


class ConsumerRunner:
    """Runs passes of the consumers: `run_once()` applies what is ready; `run()` loops on wake-ups."""

    def __init__(
        self,
        pool: AsyncConnectionPool[AsyncConn],
        consumers: Sequence[Consumer],
        *,
        batch_size: int = 200,
        max_batches: int = 20,
        after_effects: AfterEffects | None = None,
    ) -> None:
        self.pool = pool
        self.consumers = list(consumers)
        self.batch_size = batch_size
        self.max_batches = max_batches
        self.after_effects = after_effects
        self._wake = asyncio.Event()

    async def run_once(self) -> dict[str, int]:
        """One pass of each consumer this runner can lock: the events applied, by consumer."""
        return {consumer.name: await self._pass(consumer) for consumer in self.consumers}

    async def _pass(self, consumer: Consumer) -> int:
        async with self.pool.connection() as conn:
            cursor = await conn.execute(sql.TRY_CONSUMER_LOCK, {"name": consumer.name})
            row = await cursor.fetchone()
            if row is None or not row["locked"]:
                # Another replica runs this consumer now: it alone exports the consumer's lag.
                for gauge in (metrics.CONSUMER_LAG_EVENTS, metrics.CONSUMER_LAG_SECONDS):
                    with contextlib.suppress(KeyError):
                        gauge.remove(consumer.name)
                return 0
            try:
                await conn.execute(sql.ENSURE_CONSUMER, {"name": consumer.name})
                applied = 0
                for _ in range(self.max_batches):
                    batch = await self._batch(conn, consumer)
                    applied += len(batch)
                    if len(batch) < self.batch_size:
                        break
                await self._record_lag(conn, consumer.name)
                return applied
            finally:
                with contextlib.suppress(psycopg.Error):
                    await conn.execute(sql.RELEASE_CONSUMER_LOCK, {"name": consumer.name})

    async def _batch(self, conn: AsyncConn, consumer: Consumer) -> list[LogEvent]:
        cursor = await conn.execute(sql.CONSUMER_POSITION, {"name": consumer.name})
        position = await cursor.fetchone()
        assert position is not None
        cursor = await conn.execute(
            sql.CONSUMER_EVENTS,
            {"last_xid": position["last_xid"], "last_id": position["last_id"], "limit": self.batch_size},
        )
        events = [LogEvent.from_row(row) for row in await cursor.fetchall()]
        if not events:
            return events
        async with conn.transaction():
            for event in events:
                await consumer.effect(conn, event)
        if self.after_effects is not None:
            await self.after_effects(consumer.name, events)
        last = events[-1]
        await conn.execute(
            sql.ADVANCE_CONSUMER,
            {
                "name": consumer.name,
                "last_xid": last.xid,
                "last_id": last.id,
                "count": len(events),
                "last_event_at": last.at,
            },
        )
        metrics.CONSUMER_EVENTS.labels(consumer.name).inc(len(events))
        return events

    async def _record_lag(self, conn: AsyncConn, name: str) -> Lag:
        lag = await lag_of(conn, name)
        metrics.CONSUMER_LAG_EVENTS.labels(name).set(lag.events)
        metrics.CONSUMER_LAG_SECONDS.labels(name).set(lag.seconds)
        return lag

    def wake(self) -> None:
        self._wake.set()

    async def run(self, stop: asyncio.Event, poll_interval_s: float) -> None:
        """Pass after pass: at once when a transition notifies, else every `poll_interval_s`."""
        listener = asyncio.create_task(self._listen(stop), name="consumers-listen")
        try:
            while not stop.is_set():
                self._wake.clear()
                try:
                    await self.run_once()
                except (psycopg.OperationalError, OSError) as exc:
                    log.warning("consumer pass failed: %s", exc)
                except Exception:  # one broken pass must not stop the consumers; the next retries
                    log.exception("consumer pass failed")
                waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(stop.wait())]
                await asyncio.wait(waits, timeout=poll_interval_s, return_when=asyncio.FIRST_COMPLETED)
                for waiter in waits:
                    waiter.cancel()
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)

    async def _listen(self, stop: asyncio.Event) -> None:
        """LISTEN to the instance channels on a dedicated connection (reconnecting): a hint only."""
        info = str(self.pool.conninfo)
        delay = 0.1
        while not stop.is_set():
            try:
                conn = await db.connect(info)
                async with conn:
                    await conn.execute(sql.LISTEN_INSTANCE_CHANNELS)
                    delay = 0.1
                    self.wake()
                    async for _ in conn.notifies():
                        self.wake()
            except Exception as exc:  # polling covers the gap
                log.warning("consumer listener lost (%s); reconnecting", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)


async def lag_of(conn: AsyncConn, name: str) -> Lag:
    cursor = await conn.execute(sql.CONSUMER_LAG, {"name": name})
    row = await cursor.fetchone()
    if row is None:
        return Lag(0, 0.0)
    return Lag(int(row["events"]), max(0.0, float(row["seconds"] or 0.0)))
