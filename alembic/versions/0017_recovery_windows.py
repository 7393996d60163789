"""recovery_windows, backups.type

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02

Continuous archiving: each instance's recoverable window (the earliest and latest moment a restore
can reach), the health and lag of its archive and the last check of its backups, as its provisioner
last reported them (the reconciler's observations, the backup and deletion jobs); a deleted
instance's stays until its retention runs out. Backups say their type (full, diff, incr).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("backups", sa.Column("type", sa.Text(), nullable=True))
    op.create_table(
        "recovery_windows",
        sa.Column("instance_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("earliest_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("latest_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("archive_healthy", sa.Boolean(), nullable=True),
        sa.Column("archive_detail", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("archive_failing_since", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("lag_s", sa.Float(), nullable=True),
        sa.Column("lag_bytes", sa.BigInteger(), nullable=True),
        sa.Column("last_archived_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("observed_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("retained_until", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("verified_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("verify_problem", sa.Text(), nullable=True),
        sa.Column("expired_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column(
            "recorded_at", sa.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["instance_id"], ["instances.id"], name=op.f("fk_recovery_windows_instance_id_instances")
        ),
        sa.PrimaryKeyConstraint("instance_id", name=op.f("pk_recovery_windows")),
    )
    op.create_index(
        "ix_recovery_windows_retained",
        "recovery_windows",
        ["retained_until"],
        unique=False,
        postgresql_where=sa.text("retained_until IS NOT NULL AND expired_at IS NULL"),
    )
    op.create_index(
        "ix_recovery_windows_verify",
        "recovery_windows",
        ["verified_at"],
        unique=False,
        postgresql_where=sa.text("expired_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_recovery_windows_verify",
        table_name="recovery_windows",
        postgresql_where=sa.text("expired_at IS NULL"),
    )
    op.drop_index(
        "ix_recovery_windows_retained",
        table_name="recovery_windows",
        postgresql_where=sa.text("retained_until IS NOT NULL AND expired_at IS NULL"),
    )
    op.drop_table("recovery_windows")
    op.drop_column("backups", "type")
