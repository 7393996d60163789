"""instances.observed_spec

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30

The spec the provisioner last applied (with `observed_generation`). A heal of an instance whose
latest plan change was given up applies this one: it rolls the instance back to the plan it last
ran well instead of re-applying the plan that broke it. Instances that run their declared spec
get it filled in.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column("instances", sa.Column("observed_spec", postgresql.JSONB(), nullable=True))
    op.execute(
        "UPDATE instances SET observed_spec = spec"
        " WHERE observed_generation = spec_generation AND state NOT IN ('deleted', 'failed')"
    )


def downgrade() -> None:
    op.drop_column("instances", "observed_spec")
