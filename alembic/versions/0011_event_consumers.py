"""event consumers, notifications, metering reports, billing grace

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01

Consumers of the instance event log read it by the writing transaction's id (`xid`, below the
oldest transaction still running) so that an event that commits late is never skipped; their
positions are stored by name. Customers' notification targets (webhook endpoints, email
addresses) and the deliveries to them; the usage periods reported to Stripe; the organisation's
past-due time and billing notices (the grace period before suspension).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op
from controlplane.db.schema import XID8

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None

UUID = postgresql.UUID(as_uuid=True)
TZ = sa.TIMESTAMP(timezone=True)


def upgrade() -> None:
    # Rows already written are older than every transaction to come: xid 0. New rows: their own.
    op.add_column(
        "instance_events", sa.Column("xid", XID8(), server_default=sa.text("'0'::xid8"), nullable=False)
    )
    op.alter_column("instance_events", "xid", server_default=sa.text("pg_current_xact_id()"))
    op.create_index("ix_instance_events_xid_id", "instance_events", ["xid", "id"])
    op.create_table(
        "event_consumers",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("last_xid", XID8(), server_default=sa.text("'0'::xid8"), nullable=False),
        sa.Column("last_id", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("processed", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_event_at", TZ, nullable=True),
        sa.Column("updated_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_event_consumers")),
    )
    op.create_table(
        "notification_targets",
        sa.Column("id", UUID, server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("org_id", UUID, nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("address", sa.Text(), nullable=False),
        sa.Column("event_types", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("description", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column("secret", sa.LargeBinary(), nullable=True),
        sa.Column("created_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.Column("disabled_at", TZ, nullable=True),
        sa.Column("disabled_reason", sa.Text(), nullable=True),
        sa.Column("deleted_at", TZ, nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id"], ["organisations.id"], name=op.f("fk_notification_targets_org_id_organisations")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notification_targets")),
    )
    op.create_index(
        "ix_notification_targets_live",
        "notification_targets",
        ["org_id", "created_at", "id"],
        postgresql_where=sa.text("deleted_at IS NULL"),
    )
    op.create_table(
        "notification_deliveries",
        sa.Column("id", UUID, server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("target_id", UUID, nullable=False),
        sa.Column("org_id", UUID, nullable=False),
        sa.Column("instance_id", UUID, nullable=True),
        sa.Column("event_id", sa.Text(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("body", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("state", sa.Text(), server_default=sa.text("'pending'"), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.Column("last_attempt_at", TZ, nullable=True),
        sa.Column("delivered_at", TZ, nullable=True),
        sa.ForeignKeyConstraint(
            ["target_id"],
            ["notification_targets.id"],
            name=op.f("fk_notification_deliveries_target_id_notification_targets"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notification_deliveries")),
        sa.UniqueConstraint(
            "target_id", "event_id", name=op.f("uq_notification_deliveries_target_id_event_id")
        ),
    )
    op.create_index(
        "ix_notification_deliveries_target_created",
        "notification_deliveries",
        ["target_id", "created_at", "id"],
    )
    op.create_table(
        "usage_reports",
        sa.Column("period_start", TZ, nullable=False),
        sa.Column("period_end", TZ, nullable=False),
        sa.Column("job_id", UUID, nullable=True),
        sa.Column("meter_events", sa.Integer(), nullable=True),
        sa.Column("created_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.Column("reported_at", TZ, nullable=True),
        sa.PrimaryKeyConstraint("period_start", name=op.f("pk_usage_reports")),
    )
    op.create_table(
        "meter_events_sent",
        sa.Column("identifier", sa.Text(), nullable=False),
        sa.Column("period_start", TZ, nullable=False),
        sa.Column("org_id", UUID, nullable=False),
        sa.Column("instance_id", UUID, nullable=False),
        sa.Column("plan", sa.Text(), nullable=False),
        sa.Column("billing", sa.Text(), nullable=False),
        sa.Column("event_name", sa.Text(), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.Column("sent_at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("identifier", name=op.f("pk_meter_events_sent")),
    )
    op.add_column("organisations", sa.Column("past_due_since", TZ, nullable=True))


def downgrade() -> None:
    op.drop_column("organisations", "past_due_since")
    op.drop_table("meter_events_sent")
    op.drop_table("usage_reports")
    op.drop_index("ix_notification_deliveries_target_created", table_name="notification_deliveries")
    op.drop_table("notification_deliveries")
    op.drop_index("ix_notification_targets_live", table_name="notification_targets")
    op.drop_table("notification_targets")
    op.drop_table("event_consumers")
    op.drop_index("ix_instance_events_xid_id", table_name="instance_events")
    op.drop_column("instance_events", "xid")
