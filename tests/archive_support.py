"""Helpers of the archive and restore tests: the server's clock, and a recorded window reaching a moment."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import psycopg

from controlplane.db.connection import AsyncConn
from controlplane.services import backups
from provisioners.base import ConnectionInfo
from tests.operations_support import Condition
from tests.provisioning_support import connect


def clock(customer: psycopg.Connection[Any]) -> datetime:
    """The server's time now, on an open session (after what it committed)."""
    row = customer.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    moment: datetime = row[0]
    return moment


def server_clock(info: ConnectionInfo) -> datetime:
    """The instance server's time now, on a session of its own."""
    with connect(info) as customer:
        return clock(customer)


def window_covers(instance_id: uuid.UUID, moment: datetime) -> Condition:
    """The instance's recorded recoverable window reaches `moment`: every write before it is archived."""

    async def check(conn: AsyncConn) -> bool:
        window = await backups.window(conn, instance_id)
        return window is not None and window.covers(moment)

    return check


async def has_backup(conn: AsyncConn, instance_id: uuid.UUID) -> bool:
    """The instance's window has opened: a backup of it is held."""
    window = await backups.window(conn, instance_id)
    return window is not None and window.earliest_at is not None


def archived_through(instance_id: uuid.UUID, moment: datetime) -> Condition:
    """A backup of the instance is held and every write before `moment` is in it or archived since
    (`moment` may precede the backup: what a restore to the end of the archive brings back)."""

    async def check(conn: AsyncConn) -> bool:
        window = await backups.window(conn, instance_id)
        return (
            window is not None
            and window.earliest_at is not None
            and window.latest_at is not None
            and window.latest_at >= moment
        )

    return check
