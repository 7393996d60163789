"""a customer database's metrics, and storage autoscaling's bookkeeping

Revision ID: 0016
Revises: 0014
Create Date: 2026-12-03

`instance_metrics`: samples of each customer database's own metrics (connections, transactions,
rows, cache blocks, size against the allocation; replication and archive lag empty until the
servers report them), taken by the reconciler's observation every 10 seconds and rolled up into
5-minute rows by the leader's maintenance, each resolution pruned after its retention. On
`instances`, when storage autoscaling last grew the allocation (its cooldown) and when the customer
was last warned that the database is nearly full at its plan's maximum.

(Numbered 0016 beside a 0015 developed in parallel; whichever merges second rebases its
down_revision.)
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0016"
down_revision: str | None = "0014"
branch_labels: str | None = None
depends_on: str | None = None

TZ = sa.TIMESTAMP(timezone=True)


def upgrade() -> None:
    op.create_table(
        "instance_metrics",
        sa.Column("instance_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("resolution_s", sa.Integer(), nullable=False),
        sa.Column("at", TZ, nullable=False),
        sa.Column("connections", sa.Integer(), nullable=False),
        sa.Column("max_connections", sa.Integer(), nullable=False),
        sa.Column("transactions", sa.BigInteger(), nullable=False),
        sa.Column("rows_read", sa.BigInteger(), nullable=False),
        sa.Column("rows_written", sa.BigInteger(), nullable=False),
        sa.Column("blocks_hit", sa.BigInteger(), nullable=False),
        sa.Column("blocks_read", sa.BigInteger(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("allocated_bytes", sa.BigInteger(), nullable=False),
        sa.Column("replication_lag_s", sa.Double(), nullable=True),
        sa.Column("archive_lag_s", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("instance_id", "resolution_s", "at", name=op.f("pk_instance_metrics")),
    )
    op.create_index("ix_instance_metrics_age", "instance_metrics", ["resolution_s", "at"])
    op.add_column("instances", sa.Column("storage_grown_at", TZ, nullable=True))
    op.add_column("instances", sa.Column("storage_full_warned_at", TZ, nullable=True))


def downgrade() -> None:
    op.drop_column("instances", "storage_full_warned_at")
    op.drop_column("instances", "storage_grown_at")
    op.drop_index("ix_instance_metrics_age", table_name="instance_metrics")
    op.drop_table("instance_metrics")
