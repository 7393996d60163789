"""the claim's ranges before its point end where its index scan stops

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-03

`cp_claim_and_start` read what sorts before the worker's point as one range of
`ix_jobs_queued_order` bounded by a row comparison, `(priority, attempt = 0, run_at) <
(p_from_priority, true, '-infinity')`. PostgreSQL's btree stops a scan at such a bound only when
its first column decides it, so the scan read every entry of the point's priority: the backlog
behind the point and, under a pinned xmin horizon, the dead entry of every job claimed since. The
range is now two, bounded by plain comparisons of the index's columns: a more urgent priority, and
begun work (attempt > 0) of the point's priority, which ends at its first fresh entry (or at the
point's run_at, for a point in begun work). The body is
`controlplane.db.sql.CLAIM_AND_START_BODY` at this revision; the planner settings are those 0012
and 0013 set.
"""

from __future__ import annotations

import runpy
from pathlib import Path

from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | None = None
depends_on: str | None = None

_0019 = runpy.run_path(str(Path(__file__).with_name("0019_claim_from_the_bound.py")))
SIGNATURE: str = _0019["SIGNATURE"]
CONFIG: str = _0019["CONFIG"]
_BODY_0019: str = _0019["_body"]()

_KEY = "(priority, attempt = 0, run_at)"
_POINT = "(p_from_priority::int, p_from_fresh::boolean, p_from_run_at::timestamptz)"
_BEFORE_0019 = f"{_KEY} < (p_from_priority::int, true, '-infinity'::timestamptz) AND {_KEY} < {_POINT}"
_URGENT = "priority < p_from_priority::int"
_BEGUN = (
    "priority = p_from_priority::int AND (attempt = 0) < true AND run_at < CASE"
    " WHEN p_from_fresh::boolean THEN 'infinity'::timestamptz ELSE p_from_run_at::timestamptz END"
)
_RANGE_START, _RANGE_END = "SELECT * FROM (", ") AS in_range"


def _body() -> str:
    """0019's body with its range before the point made two: the more urgent, then the begun."""
    start = _BODY_0019.index(_RANGE_START)
    end = _BODY_0019.index(_RANGE_END, start) + len(_RANGE_END)
    before = _BODY_0019[start:end]
    assert before.count(_BEFORE_0019) == 1, before
    urgent, begun = before.replace(_BEFORE_0019, _URGENT), before.replace(_BEFORE_0019, _BEGUN)
    return _BODY_0019[:start] + urgent + "\n    UNION ALL\n    " + begun + _BODY_0019[end:]


def _replace(body: str) -> None:
    op.execute(
        f"CREATE OR REPLACE FUNCTION {SIGNATURE}"
        " RETURNS TABLE (queued_s float8, job jobs, look_from timestamptz)"
        f" LANGUAGE plpgsql{CONFIG} AS $fn${body}$fn$"
    )


def upgrade() -> None:
    _replace(_body())


def downgrade() -> None:
    _replace(_BODY_0019)
