"""instances.primary_seen

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-02

Where the infrastructure fails over by itself (CloudNativePG): the server the reconciler last saw as
an instance's primary since its last state change (every transition clears it). A different primary
seen with no state change between is a failover no observation caught under way: recorded as one.
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("instances", sa.Column("primary_seen", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("instances", "primary_seen")
