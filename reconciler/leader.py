"""Leader election by a PostgreSQL session advisory lock held on a dedicated connection."""

from __future__ import annotations

import contextlib
import logging

import psycopg

from controlplane.db import connection as db
from controlplane.db import sql

log = logging.getLogger(__name__)

# One lock key for the whole cluster of reconcilers (an arbitrary constant: "cprecon" in hex-ish).
RECONCILER_LOCK_KEY = 0x63707265636F6E


class LeaderElection:
    """Holds the lock while its connection lives; a dead connection means leadership is lost."""

    def __init__(self, url: str, key: int = RECONCILER_LOCK_KEY) -> None:
        self.url = url
        self.key = key
        self._conn: db.AsyncConn | None = None
        self._standing_by = False

    @property
    def is_leader(self) -> bool:
        return self._conn is not None and not self._conn.closed

    async def ensure(self) -> bool:
        """Check we still lead (the connection answers), else try to take the lock. Never blocks.

        A leader whose connection broke stands down for this round and contends again only at
        its next call: a standby, which tries once per interval, gets the lock first, instead of
        the replica whose session was just cut (by a network fault or an operator) taking it back
        at once.
        """
        if self._conn is not None:
            try:
                await self._conn.execute(sql.PING)
                return True
            except psycopg.Error:
                log.warning("reconciler lost its leader connection; standing down")
                await self._drop()
                return False
        try:
            conn = await db.connect(self.url)
        except psycopg.OperationalError as exc:
            log.warning("reconciler cannot reach the database: %s", exc)
            return False
        try:
            cursor = await conn.execute(sql.TRY_LEADER_LOCK, {"key": self.key})
            row = await cursor.fetchone()
        except psycopg.Error as exc:  # the server went away between the connect and the try
            log.warning("reconciler cannot reach the database: %s", exc)
            with contextlib.suppress(psycopg.Error):
                await conn.close()
            return False
        if row is not None and row["locked"]:
            self._conn = conn
            self._standing_by = False
            log.info("reconciler became leader")
            return True
        await conn.close()
        if not self._standing_by:
            self._standing_by = True
            log.info("reconciler standing by: another replica holds the leader lock")
        return False

    async def _drop(self) -> None:
        if self._conn is not None:
            try:
                await self._conn.close()
            except psycopg.Error:
                log.debug("closing a broken leader connection failed", exc_info=True)
            self._conn = None

    async def release(self) -> None:
        if self._conn is not None and not self._conn.closed:
            try:
                await self._conn.execute(sql.RELEASE_LEADER_LOCK, {"key": self.key})
            except psycopg.Error:
                log.debug("advisory unlock failed; closing the connection releases it", exc_info=True)
        await self._drop()


# The advisory lock classes (first keys) of the shard locks and the membership locks.
SHARD_LOCK_CLASS = 0x63707273
MEMBER_LOCK_CLASS = 0x6370726D


class ShardLeases:
    """The shards of the instances this process reconciles, held as session advisory locks.

    Every reconciler process holds a membership lock, so each can count the processes and aim at
    its fair share (shards / processes, rounded up): at each call it gives back shards beyond its
    share (another process takes them at its next call) and tries free ones up to it. A process
    that dies (or whose connection breaks) loses its locks with its session: the others take its
    shards over at their next calls. An instance is acted on only by the holder of its shard,
    checked again in the transaction that acts (`holds_shard_of`).
    """

    def __init__(self, url: str, count: int) -> None:
        self.url = url
        self.count = count
        self._conn: db.AsyncConn | None = None
        self.pid: int | None = None
        self.held: set[int] = set()

    def params(self) -> dict[str, int]:
        return {"shards": SHARD_LOCK_CLASS, "members": MEMBER_LOCK_CLASS, "shard_count": self.count}

    async def ensure(self) -> frozenset[int]:
        """The shards held now, after rebalancing towards this process's share. Never blocks."""
        try:
            if self._conn is None:
                conn = await db.connect(self.url)
                cursor = await conn.execute(sql.JOIN_SHARDS, self.params())
                row = await cursor.fetchone()
                assert row is not None
                self._conn, self.pid, self.held = conn, int(row["pid"]), set()
            conn = self._conn
            cursor = await conn.execute(sql.SHARD_MEMBERS, self.params())
            row = await cursor.fetchone()
            members = max(1, int(row["members"]) if row else 1)
            share = -(-self.count // members)
            for shard in sorted(self.held, reverse=True)[: max(0, len(self.held) - share)]:
                await conn.execute(sql.RELEASE_SHARD, {**self.params(), "shard": shard})
                self.held.discard(shard)
            if len(self.held) < share:
                # Start at a place of this process's own, so that joining processes do not all
                # try the same shards first.
                start = (self.pid or 0) % self.count
                for step in range(self.count):
                    shard = (start + step) % self.count
                    if shard in self.held:
                        continue
                    cursor = await conn.execute(sql.TRY_SHARD, {**self.params(), "shard": shard})
                    got = await cursor.fetchone()
                    if got is not None and got["locked"]:
                        self.held.add(shard)
                        if len(self.held) >= share:
                            break
        except psycopg.Error as exc:
            log.warning("reconciler lost its shard connection (%s); holding no shards", exc)
            await self.release()
        return frozenset(self.held)

    async def holds_shard_of(self, conn: db.AsyncConn, instance_id: object) -> bool:
        """Whether this process still holds the shard of `instance_id` (asked on `conn`)."""
        if self.pid is None:
            return False
        cursor = await conn.execute(
            sql.HOLDS_SHARD_OF, {**self.params(), "pid": self.pid, "id": instance_id}, prepare=True
        )
        row = await cursor.fetchone()
        return bool(row and row["held"])

    async def release(self) -> None:
        conn, self._conn = self._conn, None
        self.held, self.pid = set(), None
        if conn is not None:
            try:
                await conn.close()  # the session's end releases every lock it held
            except psycopg.Error:
                log.debug("closing the shard connection failed", exc_info=True)
