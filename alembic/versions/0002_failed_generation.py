"""instances.failed_generation

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

The spec generation whose update was given up (its job abandoned, or `updating` past its
deadline): the reconciler does not apply that generation again by itself, so that a plan change
that keeps failing does not cycle through degraded, heal and update forever. A new plan change
from the customer (or the same plan asked for again) makes a new generation, which is tried.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("instances", sa.Column("failed_generation", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("instances", "failed_generation")
