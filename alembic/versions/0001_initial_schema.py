"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30

The tables, the lifecycle tables mirrored as data, and the triggers by which the
database defends the lifecycles and the append-only audit logs.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

lifecycle_table = sa.table(
    "lifecycle_transitions",
    sa.column("entity", sa.Text),
    sa.column("from_state", sa.Text),
    sa.column("event", sa.Text),
    sa.column("to_state", sa.Text),
)

# A frozen copy of the lifecycle tables as they were at this revision; a test checks it
# against controlplane.core.lifecycle, and a later change of the tables needs a new migration.
_INSTANCE_EDGES = """
pending start_provisioning provisioning
pending fail failed
provisioning provisioned ready
provisioning fail failed
ready update updating
ready degrade degraded
ready suspend suspended
ready deprovision deprovisioning
updating updated ready
updating degrade degraded
updating fail failed
degraded recover ready
degraded deprovision deprovisioning
degraded fail failed
suspended resume ready
suspended deprovision deprovisioning
deprovisioning deprovisioned deleted
deprovisioning fail failed
"""
_JOB_EDGES = """
queued claim claimed
claimed start running
claimed reclaim queued
running finish completed
running error failed
running pause paused
running reclaim queued
paused resume running
paused abandon abandoned
failed retry queued
failed abandon abandoned
"""
LIFECYCLE_ROWS = [
    dict(zip(("entity", "from_state", "event", "to_state"), (entity, *line.split()), strict=True))
    for entity, edges in (("instance", _INSTANCE_EDGES), ("job", _JOB_EDGES))
    for line in edges.strip().splitlines()
]

GUARDS = [
    """
    CREATE FUNCTION cp_guard_state() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' THEN
            IF NEW.state IS DISTINCT FROM TG_ARGV[1] OR NEW.state_version <> 0 THEN
                RAISE EXCEPTION '% % must be created in state % at state_version 0, not % at %',
                    TG_ARGV[0], NEW.id, TG_ARGV[1], NEW.state, NEW.state_version
                    USING ERRCODE = 'check_violation';
            END IF;
            RETURN NEW;
        END IF;
        IF NEW.state IS DISTINCT FROM OLD.state THEN
            IF NOT EXISTS (
                SELECT 1 FROM lifecycle_transitions t
                WHERE t.entity = TG_ARGV[0] AND t.from_state = OLD.state AND t.to_state = NEW.state
            ) THEN
                RAISE EXCEPTION 'illegal transition: % % from % to % is not an edge of the % lifecycle',
                    TG_ARGV[0], OLD.id, OLD.state, NEW.state, TG_ARGV[0]
                    USING ERRCODE = 'check_violation';
            END IF;
            IF NEW.state_version IS DISTINCT FROM OLD.state_version + 1 THEN
                RAISE EXCEPTION 'illegal transition: % % from % to % must bump state_version to %, not %',
                    TG_ARGV[0], OLD.id, OLD.state, NEW.state, OLD.state_version + 1, NEW.state_version
                    USING ERRCODE = 'check_violation';
            END IF;
        ELSIF NEW.state_version IS DISTINCT FROM OLD.state_version THEN
            RAISE EXCEPTION '% %: state_version may change only with the state', TG_ARGV[0], OLD.id
                USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END $$
    """,
    """
    CREATE FUNCTION cp_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION '% is append-only: % is not allowed', TG_TABLE_NAME, TG_OP
            USING ERRCODE = 'insufficient_privilege';
    END $$
    """,
    "CREATE TRIGGER instances_guard_state BEFORE INSERT OR UPDATE ON instances"
    " FOR EACH ROW EXECUTE FUNCTION cp_guard_state('instance', 'pending')",
    "CREATE TRIGGER jobs_guard_state BEFORE INSERT OR UPDATE ON jobs"
    " FOR EACH ROW EXECUTE FUNCTION cp_guard_state('job', 'queued')",
    "CREATE TRIGGER instance_events_append_only BEFORE UPDATE OR DELETE ON instance_events"
    " FOR EACH ROW EXECUTE FUNCTION cp_append_only()",
    "CREATE TRIGGER instance_events_no_truncate BEFORE TRUNCATE ON instance_events"
    " FOR EACH STATEMENT EXECUTE FUNCTION cp_append_only()",
    "CREATE TRIGGER job_events_append_only BEFORE UPDATE OR DELETE ON job_events"
    " FOR EACH ROW EXECUTE FUNCTION cp_append_only()",
    "CREATE TRIGGER job_events_no_truncate BEFORE TRUNCATE ON job_events"
    " FOR EACH STATEMENT EXECUTE FUNCTION cp_append_only()",
]

DROP_GUARDS = [
    "DROP TRIGGER job_events_no_truncate ON job_events",
    "DROP TRIGGER job_events_append_only ON job_events",
    "DROP TRIGGER instance_events_no_truncate ON instance_events",
    "DROP TRIGGER instance_events_append_only ON instance_events",
    "DROP TRIGGER jobs_guard_state ON jobs",
    "DROP TRIGGER instances_guard_state ON instances",
    "DROP FUNCTION cp_append_only()",
    "DROP FUNCTION cp_guard_state()",
]


def upgrade() -> None:
    op.execute("CREATE SEQUENCE job_fence_seq")
    op.create_table(
        "lifecycle_transitions",
        sa.Column("entity", sa.Text(), nullable=False),
        sa.Column("from_state", sa.Text(), nullable=False),
        sa.Column("event", sa.Text(), nullable=False),
        sa.Column("to_state", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("entity", "from_state", "event", name=op.f("pk_lifecycle_transitions")),
    )
    op.create_table(
        "organisations",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("stripe_customer_id", sa.Text(), nullable=True),
        sa.Column("billing_hold", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("billing_status", sa.Text(), nullable=True),
        sa.Column("billing_event_created", sa.BigInteger(), nullable=True),
        sa.Column(
            "created_at", postgresql.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_organisations")),
        sa.UniqueConstraint("name", name=op.f("uq_organisations_name")),
        sa.UniqueConstraint("stripe_customer_id", name=op.f("uq_organisations_stripe_customer_id")),
    )
    op.create_table(
        "stripe_events",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("customer_id", sa.Text(), nullable=True),
        sa.Column("created", sa.BigInteger(), nullable=False),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column(
            "received_at",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stripe_events")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("org_id", sa.UUID(), nullable=True),
        sa.Column("is_admin", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("prefix", sa.Text(), nullable=False),
        sa.Column("key_hash", sa.LargeBinary(), nullable=False),
        sa.Column("name", sa.Text(), server_default=sa.text("''"), nullable=False),
        sa.Column(
            "created_at", postgresql.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("revoked_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id"], ["organisations.id"], name=op.f("fk_api_keys_org_id_organisations")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("prefix", name=op.f("uq_api_keys_prefix")),
    )
    op.create_table(
        "idempotency_keys",
        sa.Column("org_id", sa.UUID(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("request_hash", sa.Text(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("response", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "headers",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "created_at", postgresql.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["org_id"], ["organisations.id"], name=op.f("fk_idempotency_keys_org_id_organisations")
        ),
        sa.PrimaryKeyConstraint("org_id", "key", name=op.f("pk_idempotency_keys")),
    )
    op.create_index("ix_idempotency_keys_created_at", "idempotency_keys", ["created_at"], unique=False)
    op.create_table(
        "instances",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("org_id", sa.UUID(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("spec", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("spec_generation", sa.BigInteger(), server_default=sa.text("1"), nullable=False),
        sa.Column("observed_generation", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("state_version", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "state_entered_at",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("deadline_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("failure_reason", sa.Text(), nullable=True),
        sa.Column("progress", sa.Text(), nullable=True),
        sa.Column("deletion_protection", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("deletion_requested_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("skip_final_backup", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("suspended_by_billing", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("connection", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("secret", sa.LargeBinary(), nullable=True),
        sa.Column("deadline_retries", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_reconciled_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column(
            "created_at", postgresql.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column(
            "updated_at", postgresql.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["org_id"], ["organisations.id"], name=op.f("fk_instances_org_id_organisations")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_instances")),
    )
    op.create_index(
        "ix_instances_live_state",
        "instances",
        ["state"],
        unique=False,
        postgresql_where=sa.text("state NOT IN ('deleted', 'failed')"),
    )
    op.create_index("ix_instances_org_created", "instances", ["org_id", "created_at", "id"], unique=False)
    op.create_index(
        "ux_instances_live_name",
        "instances",
        ["org_id", "name"],
        unique=True,
        postgresql_where=sa.text("state NOT IN ('deleted', 'failed')"),
    )
    op.create_table(
        "instance_events",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("instance_id", sa.UUID(), nullable=False),
        sa.Column("from_state", sa.Text(), nullable=True),
        sa.Column("to_state", sa.Text(), nullable=False),
        sa.Column("event", sa.Text(), nullable=False),
        sa.Column("actor_kind", sa.Text(), nullable=False),
        sa.Column("actor_id", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column(
            "detail",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.Column("at", postgresql.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(
            ["instance_id"], ["instances.id"], name=op.f("fk_instance_events_instance_id_instances")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_instance_events")),
    )
    op.create_index("ix_instance_events_at", "instance_events", ["at"], unique=False)
    op.create_index(
        "ix_instance_events_instance_id_id", "instance_events", ["instance_id", "id"], unique=False
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("instance_id", sa.UUID(), nullable=True),
        sa.Column(
            "payload",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("state_version", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "state_entered_at",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("attempt", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default=sa.text("5"), nullable=False),
        sa.Column(
            "run_at", postgresql.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("priority", sa.Integer(), server_default=sa.text("100"), nullable=False),
        sa.Column("claimed_by", sa.Text(), nullable=True),
        sa.Column("claimed_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("heartbeat_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("fence", sa.BigInteger(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("error_kind", sa.Text(), nullable=True),
        sa.Column("verdict", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column(
            "created_at", postgresql.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column(
            "updated_at", postgresql.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["instance_id"], ["instances.id"], name=op.f("fk_jobs_instance_id_instances")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_index(
        "ix_jobs_failed_run_at",
        "jobs",
        ["run_at"],
        unique=False,
        postgresql_where=sa.text("state = 'failed'"),
    )
    op.create_index(
        "ix_jobs_live_heartbeat",
        "jobs",
        ["heartbeat_at"],
        unique=False,
        postgresql_where=sa.text("state IN ('claimed', 'running')"),
    )
    op.create_index(
        "ix_jobs_live_state",
        "jobs",
        ["state", "kind"],
        unique=False,
        postgresql_where=sa.text("state NOT IN ('completed', 'abandoned')"),
    )
    op.create_index(
        "ix_jobs_queued_order",
        "jobs",
        ["priority", "run_at"],
        unique=False,
        postgresql_where=sa.text("state = 'queued'"),
    )
    op.create_index(
        "ux_jobs_live_instance_kind",
        "jobs",
        ["instance_id", "kind"],
        unique=True,
        postgresql_where=sa.text("state NOT IN ('completed', 'abandoned')"),
    )
    op.create_table(
        "job_events",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.UUID(), nullable=False),
        sa.Column("from_state", sa.Text(), nullable=True),
        sa.Column("to_state", sa.Text(), nullable=False),
        sa.Column("event", sa.Text(), nullable=False),
        sa.Column("actor_kind", sa.Text(), nullable=False),
        sa.Column("actor_id", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column(
            "detail",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.Column("state_version", sa.BigInteger(), nullable=False),
        sa.Column("at", postgresql.TIMESTAMP(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_events_job_id_jobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_events")),
    )
    op.create_index("ix_job_events_job_id_id", "job_events", ["job_id", "id"], unique=False)

    op.bulk_insert(lifecycle_table, LIFECYCLE_ROWS)
    for statement in GUARDS:
        op.execute(statement)


def downgrade() -> None:
    for statement in DROP_GUARDS:
        op.execute(statement)
    op.drop_index("ix_job_events_job_id_id", table_name="job_events")
    op.drop_table("job_events")
    op.drop_index(
        "ux_jobs_live_instance_kind",
        table_name="jobs",
        postgresql_where=sa.text("state NOT IN ('completed', 'abandoned')"),
    )
    op.drop_index("ix_jobs_queued_order", table_name="jobs", postgresql_where=sa.text("state = 'queued'"))
    op.drop_index(
        "ix_jobs_live_state",
        table_name="jobs",
        postgresql_where=sa.text("state NOT IN ('completed', 'abandoned')"),
    )
    op.drop_index(
        "ix_jobs_live_heartbeat",
        table_name="jobs",
        postgresql_where=sa.text("state IN ('claimed', 'running')"),
    )
    op.drop_index("ix_jobs_failed_run_at", table_name="jobs", postgresql_where=sa.text("state = 'failed'"))
    op.drop_table("jobs")
    op.drop_index("ix_instance_events_instance_id_id", table_name="instance_events")
    op.drop_index("ix_instance_events_at", table_name="instance_events")
    op.drop_table("instance_events")
    op.drop_index(
        "ux_instances_live_name",
        table_name="instances",
        postgresql_where=sa.text("state NOT IN ('deleted', 'failed')"),
    )
    op.drop_index("ix_instances_org_created", table_name="instances")
    op.drop_index(
        "ix_instances_live_state",
        table_name="instances",
        postgresql_where=sa.text("state NOT IN ('deleted', 'failed')"),
    )
    op.drop_table("instances")
    op.drop_index("ix_idempotency_keys_created_at", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
    op.drop_table("api_keys")
    op.drop_table("stripe_events")
    op.drop_table("organisations")
    op.drop_table("lifecycle_transitions")
    op.execute("DROP SEQUENCE job_fence_seq")
