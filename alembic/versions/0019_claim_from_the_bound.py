"""the claim and start returns where the worker's next claim may start

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-03

`cp_claim_and_start` first reads the database's bound (`controlplane.db.sql.LOOK_FROM`: the start
of the oldest transaction of this database that has written, or now), before its claim's snapshot,
and returns it with each job as `look_from`. No job that claim could not see sorts before the
bound, but for the moment between an insert's clock and its xid: the worker's next claim starts
just before the older of the bound and the fresh jobs it claimed, instead of a fixed second before
the jobs. Under a pinned xmin horizon, a claim from a second before re-read the dead index entries
of every job claimed in that second. The body is `controlplane.db.sql.CLAIM_AND_START_BODY` at
this revision; the planner settings are those 0012 and 0013 set.
"""

from __future__ import annotations

import runpy
from pathlib import Path

from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | None = None
depends_on: str | None = None

SIGNATURE = (
    "cp_claim_and_start(p_kinds text[], p_limit integer, p_worker text,"
    " p_from_priority integer, p_from_fresh boolean, p_from_run_at timestamptz)"
)
CONFIG = " SET enable_sort = off SET jit = off SET enable_seqscan = off"

# The body of revision 0012, with the bound read first and returned with each job.
_BODY_0012: str = runpy.run_path(str(Path(__file__).with_name("0012_claim_by_ctid.py")))["BODY"]
_CHANGES = (
    ("DECLARE\n", "DECLARE\n    v_look_from timestamptz;\n"),
    (
        "BEGIN\n",
        "BEGIN\nSELECT least(now(), min(xact_start)) INTO v_look_from FROM pg_stat_activity"
        " WHERE backend_xid IS NOT NULL AND datname = current_database();\n",
    ),
    ("SELECT q.queued_s, j FROM", "SELECT q.queued_s, j, v_look_from FROM"),
)


def _body() -> str:
    body = _BODY_0012
    for old, new in _CHANGES:
        assert body.count(old) == 1, old
        body = body.replace(old, new)
    return body


def _create(body: str, returns: str) -> None:
    # The returned row changes, which CREATE OR REPLACE cannot do: dropped and made again.
    op.execute("DROP FUNCTION cp_claim_and_start(text[], integer, text, integer, boolean, timestamptz)")
    op.execute(
        f"CREATE FUNCTION {SIGNATURE} RETURNS TABLE ({returns}) LANGUAGE plpgsql{CONFIG} AS $fn${body}$fn$"
    )


def upgrade() -> None:
    _create(_body(), "queued_s float8, job jobs, look_from timestamptz")


def downgrade() -> None:
    # The body of revision 0012, with the settings of 0012 and 0013.
    _create(_BODY_0012, "queued_s float8, job jobs")
