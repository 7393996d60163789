"""Leader election by a PostgreSQL session advisory lock held on a dedicated connection."""

from __future__ import annotations

import contextlib
import logging

import psycopg

from controlplane import db, sql

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
