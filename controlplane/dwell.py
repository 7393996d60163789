"""Dwell-time statistics: how long instances or jobs stay in each state, from their event logs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from controlplane import lifecycle, sql
from controlplane.db import AsyncConn

# Each event opens a stay in its to_state; the entity's next event (by id) closes it. A stay not
# yet closed is measured up to now(). Terminal states are never left, so they are not stays.
_DWELL = """
WITH stays AS (
    SELECT e.to_state AS state, e.at AS entered_at,
           lead(e.at) OVER (PARTITION BY e.{fk} ORDER BY e.id) AS left_at
    FROM {events_table} e
), measured AS (
    SELECT state, left_at IS NULL AS open,
           extract(epoch FROM COALESCE(left_at, now()) - entered_at)::float8 AS seconds
    FROM stays
    WHERE state = ANY(%(states)s::text[])
      AND (%(since)s::timestamptz IS NULL OR COALESCE(left_at, now()) >= %(since)s::timestamptz)
)
SELECT state,
       count(*) AS count,
       count(*) FILTER (WHERE open) AS current,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY seconds) AS p50_s,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY seconds) AS p95_s,
       max(seconds) AS max_s
FROM measured
GROUP BY state
"""


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


def dwell_query(entity: str) -> str:
    spec = sql.ENTITY_TABLES[lifecycle.lifecycle(entity).entity]
    return _DWELL.format(fk=spec.fk, events_table=spec.events_table)


async def dwell_stats(conn: AsyncConn, entity: str, *, since: datetime | None = None) -> list[DwellStat]:
    """Per non-terminal state of `entity` ('instance' or 'job'): count, p50, p95, max seconds.

    `since` keeps only the stays that were still going on at or after that time. States with no
    stay are left out; the order is the lifecycle's.
    """
    table = lifecycle.lifecycle(entity)
    states = list(table.live_states())
    cursor = await conn.execute(dwell_query(entity), {"states": states, "since": since})
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
