"""backups, instances.failure_code

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

The backups the control plane holds of each instance (what a restore after a data loss, or a
customer's chosen restore point, starts from), and a stable code for what is wrong with an
instance beside its failure reason (`data_lost` first).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("instances", sa.Column("failure_code", sa.Text(), nullable=True))
    op.create_table(
        "backups",
        sa.Column("instance_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("backup_id", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("taken_at", sa.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("location", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column(
            "recorded_at", sa.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("removed_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["instance_id"], ["instances.id"], name=op.f("fk_backups_instance_id_instances")
        ),
        sa.PrimaryKeyConstraint("instance_id", "backup_id", name=op.f("pk_backups")),
    )
    op.create_index(
        "ix_backups_held",
        "backups",
        ["instance_id", "taken_at"],
        unique=False,
        postgresql_where=sa.text("removed_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_backups_held", table_name="backups", postgresql_where=sa.text("removed_at IS NULL"))
    op.drop_table("backups")
    op.drop_column("instances", "failure_code")
