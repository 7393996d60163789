"""instances.heal_failures, instances.heal_given_up_at

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

A degraded instance whose heal jobs keep being abandoned is healed again after a growing pause
(the reconciler's heal backoff) instead of at every pass: how many heals in a row were given up,
and when the last one was. Both are reset when the instance is ready again.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column(
        "instances", sa.Column("heal_failures", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    op.add_column("instances", sa.Column("heal_given_up_at", sa.TIMESTAMP(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("instances", "heal_given_up_at")
    op.drop_column("instances", "heal_failures")
