"""stripe_events.status

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

The subscription status each Stripe event carried: an event for a customer no organisation is
linked to yet is applied when an organisation is created for that customer (the newest one).
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("stripe_events", sa.Column("status", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("stripe_events", "status")
