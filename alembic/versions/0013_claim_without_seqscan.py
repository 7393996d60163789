"""the claim and start reads no table of jobs whole

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01

`cp_claim_and_start` also runs with `enable_seqscan = off` (`sql.CLAIM_AND_START_CONFIG`). Its
plans are cached per session, made when `jobs` looks small: the start then joined the rows the
claim had locked with a sequential scan of `jobs` (a hash join on id and ctid), and the final read
filtered a sequential scan by ctid, instead of a TID or primary-key lookup of each row. Each call
read the whole table twice, and grew slower as the table grew between two ANALYZEs.
"""

from __future__ import annotations

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None

SIGNATURE = (
    "cp_claim_and_start(p_kinds text[], p_limit integer, p_worker text,"
    " p_from_priority integer, p_from_fresh boolean, p_from_run_at timestamptz)"
)


def upgrade() -> None:
    op.execute(f"ALTER FUNCTION {SIGNATURE} SET enable_seqscan = off")


def downgrade() -> None:
    op.execute(f"ALTER FUNCTION {SIGNATURE} RESET enable_seqscan")
