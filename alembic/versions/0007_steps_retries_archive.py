"""job_steps, instances.replaces, instances.archived_at

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02

The named steps of each instance job as they start, finish or fail (append-only, with the
attempt and fence of the run): what an instance's progress shows and what the step history's
durations are measured from. The instance a retry was created from (`replaces`; at most one
retry per failed instance), and when a failed instance was deleted by its customer (archived:
out of the default lists, its leftovers removed).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None

TZ = sa.TIMESTAMP(timezone=True)


def upgrade() -> None:
    op.create_table(
        "job_steps",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("job_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("instance_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("step", sa.Text(), nullable=False),
        sa.Column("event", sa.Text(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("fence", sa.BigInteger(), nullable=False),
        sa.Column("worker", sa.Text(), nullable=False),
        sa.Column("started_at", TZ, nullable=True),
        sa.Column("code", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("at", TZ, server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_steps_job_id_jobs")),
        sa.ForeignKeyConstraint(
            ["instance_id"], ["instances.id"], name=op.f("fk_job_steps_instance_id_instances")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_steps")),
    )
    op.create_index("ix_job_steps_instance_id_id", "job_steps", ["instance_id", "id"], unique=False)
    op.create_index("ix_job_steps_job_id_id", "job_steps", ["job_id", "id"], unique=False)
    op.create_index(
        "ix_job_steps_finished",
        "job_steps",
        ["kind", "step", "id"],
        unique=False,
        postgresql_where=sa.text("event = 'finished'"),
    )
    op.execute(
        "CREATE TRIGGER job_steps_append_only BEFORE UPDATE OR DELETE ON job_steps"
        " FOR EACH ROW EXECUTE FUNCTION cp_append_only()"
    )
    op.execute(
        "CREATE TRIGGER job_steps_no_truncate BEFORE TRUNCATE ON job_steps"
        " FOR EACH STATEMENT EXECUTE FUNCTION cp_append_only()"
    )
    op.add_column("instances", sa.Column("replaces", postgresql.UUID(as_uuid=True), nullable=True))
    op.add_column("instances", sa.Column("archived_at", TZ, nullable=True))
    op.create_foreign_key(
        op.f("fk_instances_replaces_instances"), "instances", "instances", ["replaces"], ["id"]
    )
    op.create_index(
        "ux_instances_replaces",
        "instances",
        ["replaces"],
        unique=True,
        postgresql_where=sa.text("replaces IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ux_instances_replaces", table_name="instances")
    op.drop_constraint(op.f("fk_instances_replaces_instances"), "instances", type_="foreignkey")
    op.drop_column("instances", "archived_at")
    op.drop_column("instances", "replaces")
    op.execute("DROP TRIGGER job_steps_no_truncate ON job_steps")
    op.execute("DROP TRIGGER job_steps_append_only ON job_steps")
    op.drop_table("job_steps")
