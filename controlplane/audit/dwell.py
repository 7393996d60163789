"""Dwell-time statistics: how long instances or jobs stay in each state, from their event logs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from controlplane.core import lifecycle
from controlplane.db import sql
from controlplane.db.connection import AsyncConn


@dataclass(frozen=True)
class DwellStat:
    """Time spent in one state: stays counted (of which `current` are still going on), in seconds."""

    state: str
    count: int
    current: int
    p50_s: float
    p95_s: float
    max_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def dwell_stats(conn: AsyncConn, entity: str, *, since: datetime | None = None) -> list[DwellStat]:
    """Per non-terminal state of `entity` ('instance' or 'job'): count, p50, p95, max seconds.

    `since` keeps only the stays that were still going on at or after that time. States with no
    stay are left out; the order is the lifecycle's.
    """
    table = lifecycle.lifecycle(entity)
    states = list(table.live_states())
    cursor = await conn.execute(sql.DWELL_STATS[table.entity], {"states": states, "since": since})
    rows = {row["state"]: row for row in await cursor.fetchall()}
    return [
        DwellStat(
            state=state,
            count=int(rows[state]["count"]),
            current=int(rows[state]["current"]),
            p50_s=float(rows[state]["p50_s"]),
            p95_s=float(rows[state]["p95_s"]),
            max_s=float(rows[state]["max_s"]),
        )
        for state in states
        if state in rows
    ]
