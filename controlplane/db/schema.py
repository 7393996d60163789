"""The database schema as SQLAlchemy 2 metadata: the single description Alembic migrations follow."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Double,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TIMESTAMP, UUID
from sqlalchemy.types import UserDefinedType

from controlplane.core.lifecycle import INSTANCE
from controlplane.db.sql import FINISHED, HELD, state_list

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
    }
)

TZ = TIMESTAMP(timezone=True)
NOW = text("now()")
NEW_UUID = text("gen_random_uuid()")

# The predicates of the partial indexes, from the lifecycle tables (as the hot-path SQL states them).
INSTANCE_LIVE = "state NOT IN " + state_list(tuple(s for s in INSTANCE.states if s in INSTANCE.terminal))
JOB_LIVE = f"state NOT IN {FINISHED}"


class XID8(UserDefinedType[int]):
    """PostgreSQL's 64-bit transaction id (`pg_current_xact_id()`): which transaction wrote a row."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "XID8"


job_fence_seq = Sequence("job_fence_seq", metadata=metadata)


def chain_head_columns() -> tuple[Column[Any], ...]:
    """The entity's audit chain head: its last event's sequence number and hash (NULL: no event yet)."""
    return (Column("chain_seq", BigInteger), Column("chain_head", LargeBinary))


def event_columns(fk: str, target: str) -> tuple[Column[Any] | PrimaryKeyConstraint, ...]:
    """An append-only event table's columns, partitioned by month of `at` (the key includes it)."""
    return (
        Column("id", BigInteger, nullable=False, autoincrement=True),
        Column(fk, UUID(as_uuid=True), ForeignKey(target), nullable=False),
        Column("from_state", Text),
        Column("to_state", Text, nullable=False),
        Column("event", Text, nullable=False),
        Column("actor_kind", Text, nullable=False),
        Column("actor_id", Text, nullable=False),
        Column("reason", Text),
        Column("detail", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
        Column("request_id", Text),
        Column("state_version", BigInteger, nullable=False),
        Column("at", TZ, nullable=False, server_default=NOW),
        # The chain: the entity's sequence number (0, 1, ... no gaps), its predecessor's hash, its own.
        Column("seq", BigInteger, nullable=False),
        Column("prev_hash", LargeBinary),
        Column("hash", LargeBinary, nullable=False),
        PrimaryKeyConstraint("id", "at"),
    )


lifecycle_transitions = Table(
    "lifecycle_transitions",
    metadata,
    Column("entity", Text, nullable=False),
    Column("from_state", Text, nullable=False),
    Column("event", Text, nullable=False),
    Column("to_state", Text, nullable=False),
    PrimaryKeyConstraint("entity", "from_state", "event"),
)

organisations = Table(
    "organisations",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=NEW_UUID),
    Column("name", Text, nullable=False, unique=True),
    Column("stripe_customer_id", Text, unique=True),
    Column("billing_hold", Boolean, nullable=False, server_default=text("false")),
    Column("billing_status", Text),
    # Stripe `created` (unix seconds) of the newest event applied: older ones are ignored.
    Column("billing_event_created", BigInteger),
    # Since when the subscription is past due (NULL: it is not): the grace period runs from here.
    Column("past_due_since", TZ),
    Column("created_at", TZ, nullable=False, server_default=NOW),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=NEW_UUID),
    Column("org_id", UUID(as_uuid=True), ForeignKey("organisations.id")),
    Column("is_admin", Boolean, nullable=False, server_default=text("false")),
    Column("prefix", Text, nullable=False, unique=True),
    Column("key_hash", LargeBinary, nullable=False),
    Column("name", Text, nullable=False, server_default=text("''")),
    Column("created_at", TZ, nullable=False, server_default=NOW),
    Column("revoked_at", TZ),
)

instances = Table(
    "instances",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=NEW_UUID),
    Column("org_id", UUID(as_uuid=True), ForeignKey("organisations.id"), nullable=False),
    Column("name", Text, nullable=False),
    Column("spec", JSONB, nullable=False),
    Column("spec_generation", BigInteger, nullable=False, server_default=text("1")),
    Column("observed_generation", BigInteger, nullable=False, server_default=text("0")),
    # The spec generation whose update was given up: not applied again unless asked again.
    Column("failed_generation", BigInteger),
    # The spec last applied (at observed_generation): what a heal rolls back to.
    Column("observed_spec", JSONB),
    Column("state", Text, nullable=False),
    Column("state_version", BigInteger, nullable=False, server_default=text("0")),
    Column("state_entered_at", TZ, nullable=False, server_default=NOW),
    Column("deadline_at", TZ),
    Column("failure_reason", Text),
    # A stable code for what is wrong (e.g. 'data_lost'), beside the reason's words.
    Column("failure_code", Text),
    Column("progress", Text),
    Column("deletion_protection", Boolean, nullable=False, server_default=text("false")),
    Column("deletion_requested_at", TZ),
    Column("skip_final_backup", Boolean, nullable=False, server_default=text("false")),
    Column("suspended_by_billing", Boolean, nullable=False, server_default=text("false")),
    # Host, port, database and user; the password is stored encrypted in `secret`.
    Column("connection", JSONB),
    Column("secret", LargeBinary),
    Column("deadline_retries", Integer, nullable=False, server_default=text("0")),
    # Heals given up in a row (reset when ready again) and when the last was: the heal backoff.
    Column("heal_failures", Integer, nullable=False, server_default=text("0")),
    Column("heal_given_up_at", TZ),
    Column("last_reconciled_at", TZ),
    Column("created_at", TZ, nullable=False, server_default=NOW),
    Column("updated_at", TZ, nullable=False, server_default=NOW),
    # The failed instance this one was created to retry (one retry per failed instance).
    Column("replaces", UUID(as_uuid=True), ForeignKey("instances.id")),
    # When its customer deleted this failed instance: out of the default lists, its leftovers removed.
    Column("archived_at", TZ),
    # When storage autoscaling last grew its allocation (the cooldown runs from here), and when the
    # customer was last told that it is nearly full at the plan's maximum.
    Column("storage_grown_at", TZ),
    Column("storage_full_warned_at", TZ),
    # Where the infrastructure fails over by itself: the primary the reconciler saw since the last
    # state change (each transition clears it); another one seen means an unrecorded failover.
    Column("primary_seen", Text),
    *chain_head_columns(),
    Index("ix_instances_live_state", "state", postgresql_where=text(INSTANCE_LIVE)),
    Index("ux_instances_replaces", "replaces", unique=True, postgresql_where=text("replaces IS NOT NULL")),
    Index(
        "ux_instances_live_name",
        "org_id",
        "name",
        unique=True,
        postgresql_where=text(INSTANCE_LIVE),
    ),
    Index("ix_instances_org_created", "org_id", "created_at", "id"),
)

instance_events = Table(
    "instance_events",
    metadata,
    *event_columns("instance_id", "instances.id"),
    Index("ix_instance_events_instance_id_id", "instance_id", "id"),
    Index("ix_instance_events_at", "at"),
    # The writing transaction: consumers read below the oldest one still running (never skipping
    # an event that commits after one with a higher id). Rows from before it have 0.
    Column("xid", XID8(), nullable=False, server_default=text("pg_current_xact_id()")),
    Index("ix_instance_events_xid_id", "xid", "id"),
    postgresql_partition_by="RANGE (at)",
)

# The consumers of the instance event log and their positions: every event below
# (last_xid, last_id), in (xid, id) order, has been applied.
event_consumers = Table(
    "event_consumers",
    metadata,
    Column("name", Text, primary_key=True),
    Column("last_xid", XID8(), nullable=False, server_default=text("'0'::xid8")),
    Column("last_id", BigInteger, nullable=False, server_default=text("0")),
    Column("processed", BigInteger, nullable=False, server_default=text("0")),
    # The time of the newest event applied (the lag in seconds is measured from it).
    Column("last_event_at", TZ),
    Column("updated_at", TZ, nullable=False, server_default=NOW),
)

# Where an organisation's notifications go: webhook endpoints (kind 'webhook', an https URL and
# a signing secret, encrypted) and email addresses (kind 'email').
notification_targets = Table(
    "notification_targets",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=NEW_UUID),
    Column("org_id", UUID(as_uuid=True), ForeignKey("organisations.id"), nullable=False),
    Column("kind", Text, nullable=False),
    Column("address", Text, nullable=False),
    Column("event_types", ARRAY(Text), nullable=False),
    Column("description", Text, nullable=False, server_default=text("''")),
    Column("secret", LargeBinary),
    Column("created_at", TZ, nullable=False, server_default=NOW),
    # Disabled after its deliveries failed for the whole retry window.
    Column("disabled_at", TZ),
    Column("disabled_reason", Text),
    Column("deleted_at", TZ),
    Index(
        "ix_notification_targets_live",
        "org_id",
        "created_at",
        "id",
        postgresql_where=text("deleted_at IS NULL"),
    ),
)

# One notification to one target (the delivery log): its body carries the event's id, which a
# receiver de-duplicates by.
notification_deliveries = Table(
    "notification_deliveries",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=NEW_UUID),
    Column("target_id", UUID(as_uuid=True), ForeignKey("notification_targets.id"), nullable=False),
    Column("org_id", UUID(as_uuid=True), nullable=False),
    Column("instance_id", UUID(as_uuid=True)),
    Column("event_id", Text, nullable=False),
    Column("event_type", Text, nullable=False),
    Column("body", JSONB, nullable=False),
    # 'pending' (being tried), 'delivered' or 'failed' (given up).
    Column("state", Text, nullable=False, server_default=text("'pending'")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("last_status", Integer),
    Column("last_error", Text),
    Column("created_at", TZ, nullable=False, server_default=NOW),
    Column("last_attempt_at", TZ),
    Column("delivered_at", TZ),
    UniqueConstraint("target_id", "event_id"),
    Index("ix_notification_deliveries_target_created", "target_id", "created_at", "id"),
)

# The usage periods whose report to Stripe was enqueued (one per period), and when it was sent.
usage_reports = Table(
    "usage_reports",
    metadata,
    Column("period_start", TZ, primary_key=True),
    Column("period_end", TZ, nullable=False),
    Column("job_id", UUID(as_uuid=True)),
    Column("meter_events", Integer),
    Column("created_at", TZ, nullable=False, server_default=NOW),
    Column("reported_at", TZ),
)

# Every meter event Stripe acknowledged, by its identifier (the reconciliation compares these
# with the usage recomputed from the log).
meter_events_sent = Table(
    "meter_events_sent",
    metadata,
    Column("identifier", Text, primary_key=True),
    Column("period_start", TZ, nullable=False),
    Column("org_id", UUID(as_uuid=True), nullable=False),
    Column("instance_id", UUID(as_uuid=True), nullable=False),
    Column("plan", Text, nullable=False),
    Column("billing", Text, nullable=False),
    Column("event_name", Text, nullable=False),
    Column("value", BigInteger, nullable=False),
    Column("sent_at", TZ, nullable=False, server_default=NOW),
)

jobs = Table(
    "jobs",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=NEW_UUID),
    Column("kind", Text, nullable=False),
    Column("instance_id", UUID(as_uuid=True), ForeignKey("instances.id")),
    Column("payload", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("state", Text, nullable=False),
    Column("state_version", BigInteger, nullable=False, server_default=text("0")),
    Column("state_entered_at", TZ, nullable=False, server_default=NOW),
    Column("attempt", Integer, nullable=False, server_default=text("0")),
    Column("max_attempts", Integer, nullable=False, server_default=text("5")),
    Column("run_at", TZ, nullable=False, server_default=NOW),
    Column("priority", Integer, nullable=False, server_default=text("100")),
    Column("claimed_by", Text),
    Column("claimed_at", TZ),
    Column("heartbeat_at", TZ),
    Column("fence", BigInteger),
    Column("last_error", Text),
    # 'temporary' or 'permanent': how the last error asked to be treated.
    Column("error_kind", Text),
    Column("verdict", JSONB),
    Column("created_at", TZ, nullable=False, server_default=NOW),
    Column("updated_at", TZ, nullable=False, server_default=NOW),
    *chain_head_columns(),
    Index(
        "ix_jobs_live_heartbeat",
        "heartbeat_at",
        postgresql_where=text(f"state IN {HELD}"),
    ),
    # The claim's order (sql.CLAIM_ORDER): priority, work already begun first, then run_at.
    Index(
        "ix_jobs_queued_order",
        "priority",
        text("(attempt = 0)"),
        "run_at",
        postgresql_where=text("state = 'queued'"),
    ),
    Index("ix_jobs_failed_run_at", "run_at", postgresql_where=text("state = 'failed'")),
    Index(
        "ux_jobs_live_instance_kind",
        "instance_id",
        "kind",
        unique=True,
        postgresql_where=text(JOB_LIVE),
    ),
    Index("ix_jobs_live_state", "state", "kind", postgresql_where=text(JOB_LIVE)),
)

job_events = Table(
    "job_events",
    metadata,
    *event_columns("job_id", "jobs.id"),
    Index("ix_job_events_job_id_id", "job_id", "id"),
    Index("ix_job_events_at", "at", postgresql_using="brin"),
    postgresql_partition_by="RANGE (at)",
)

# The named steps of the instance jobs as they start, finish or fail (append-only): an instance's
# progress, and the durations its expected times are measured from.
job_steps = Table(
    "job_steps",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("job_id", UUID(as_uuid=True), ForeignKey("jobs.id"), nullable=False),
    Column("instance_id", UUID(as_uuid=True), ForeignKey("instances.id"), nullable=False),
    # The job's kind (the operation) and the provisioner step (controlplane.core.kinds.STEP_LABELS).
    Column("kind", Text, nullable=False),
    Column("step", Text, nullable=False),
    # 'started', 'finished' or 'failed'.
    Column("event", Text, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("worker", Text, nullable=False),
    # On a finish or a failure: when that attempt of the step started.
    Column("started_at", TZ),
    # On a failure: the code customers are told (if the error has one) and the raw error (SREs).
    Column("code", Text),
    Column("error", Text),
    Column("at", TZ, nullable=False, server_default=NOW),
    Index("ix_job_steps_instance_id_id", "instance_id", "id"),
    Index("ix_job_steps_job_id_id", "job_id", "id"),
    Index("ix_job_steps_finished", "kind", "step", "id", postgresql_where=text("event = 'finished'")),
)

# The backups the control plane holds of each instance, as the provisioner reported them after
# each backup job; removed_at is set once the provisioner no longer has one (retention).
backups = Table(
    "backups",
    metadata,
    Column("instance_id", UUID(as_uuid=True), ForeignKey("instances.id"), nullable=False),
    # The provisioner's name for the backup, unique per instance.
    Column("backup_id", Text, nullable=False),
    # 'scheduled' (the plan's schedule) or 'on_demand' (asked for by a customer or an SRE).
    Column("kind", Text, nullable=False),
    Column("taken_at", TZ, nullable=False),
    Column("size_bytes", BigInteger),
    # Where the provisioner keeps it: for the SRE view only, never shown to customers.
    Column("location", Text, nullable=False, server_default=text("''")),
    Column("recorded_at", TZ, nullable=False, server_default=NOW),
    Column("removed_at", TZ),
    # full, diff or incr (None: a provisioner that does not say).
    Column("type", Text),
    PrimaryKeyConstraint("instance_id", "backup_id"),
    Index("ix_backups_held", "instance_id", "taken_at", postgresql_where=text("removed_at IS NULL")),
)

# Each instance's recoverable window and the health of its continuous archive, as its provisioner
# last reported them (reconciler observations, backup and deletion jobs, verification); a deleted
# instance's stays until retained_until, when its archive is removed (expired_at).
recovery_windows = Table(
    "recovery_windows",
    metadata,
    Column("instance_id", UUID(as_uuid=True), ForeignKey("instances.id"), primary_key=True),
    Column("earliest_at", TZ),
    Column("latest_at", TZ),
    Column("archive_healthy", Boolean),
    # What fails (SREs' words: it may name paths).
    Column("archive_detail", Text, nullable=False, server_default=text("''")),
    Column("archive_failing_since", TZ),
    Column("lag_s", Float),
    Column("lag_bytes", BigInteger),
    Column("last_archived_at", TZ),
    Column("observed_at", TZ),
    Column("retained_until", TZ),
    Column("verified_at", TZ),
    Column("verify_problem", Text),
    Column("expired_at", TZ),
    Column("recorded_at", TZ, nullable=False, server_default=NOW),
    Index(
        "ix_recovery_windows_retained",
        "retained_until",
        postgresql_where=text("retained_until IS NOT NULL AND expired_at IS NULL"),
    ),
    Index("ix_recovery_windows_verify", "verified_at", postgresql_where=text("expired_at IS NULL")),
)


# Samples of a customer database's own metrics, taken by the reconciler's observation: every
# `resolution_s` seconds (10, kept a day), rolled up into 5-minute rows (kept 30 days). Counters are
# cumulative (rates are differences); the lags are empty until the servers report them.
instance_metrics = Table(
    "instance_metrics",
    metadata,
    Column("instance_id", UUID(as_uuid=True), nullable=False),
    Column("resolution_s", Integer, nullable=False),
    Column("at", TZ, nullable=False),
    Column("connections", Integer, nullable=False),
    Column("max_connections", Integer, nullable=False),
    Column("transactions", BigInteger, nullable=False),
    Column("rows_read", BigInteger, nullable=False),
    Column("rows_written", BigInteger, nullable=False),
    Column("blocks_hit", BigInteger, nullable=False),
    Column("blocks_read", BigInteger, nullable=False),
    Column("size_bytes", BigInteger, nullable=False),
    Column("allocated_bytes", BigInteger, nullable=False),
    Column("replication_lag_s", Double),
    Column("archive_lag_s", Double),
    PrimaryKeyConstraint("instance_id", "resolution_s", "at"),
    Index("ix_instance_metrics_age", "resolution_s", "at"),
)

stripe_events = Table(
    "stripe_events",
    metadata,
    Column("id", Text, primary_key=True),
    Column("type", Text, nullable=False),
    Column("customer_id", Text),
    Column("created", BigInteger, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("received_at", TZ, nullable=False, server_default=NOW),
    Column("status", Text),
)

# Console sign-ins: an organisation's key exchanged for a session (the cookie names its id).
console_sessions = Table(
    "console_sessions",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=NEW_UUID),
    Column("key_id", UUID(as_uuid=True), ForeignKey("api_keys.id"), nullable=False),
    Column("org_id", UUID(as_uuid=True), ForeignKey("organisations.id"), nullable=False),
    Column("created_at", TZ, nullable=False, server_default=NOW),
    Column("expires_at", TZ, nullable=False),
    # Signed out: the session names nothing from then on.
    Column("ended_at", TZ),
    Index("ix_console_sessions_expires_at", "expires_at"),
)

idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("org_id", UUID(as_uuid=True), ForeignKey("organisations.id"), nullable=False),
    Column("key", Text, nullable=False),
    Column("request_hash", Text, nullable=False),
    Column("status_code", Integer, nullable=False),
    Column("response", JSONB, nullable=False),
    Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("created_at", TZ, nullable=False, server_default=NOW),
    PrimaryKeyConstraint("org_id", "key"),
    Index("ix_idempotency_keys_created_at", "created_at"),
)

# The checkpoint signing key: the private half encrypted by the application's secret box.
audit_keys = Table(
    "audit_keys",
    metadata,
    Column("fingerprint", Text, primary_key=True),
    Column("public_key", LargeBinary, nullable=False),
    Column("private_key", LargeBinary, nullable=False),
    Column("created_at", TZ, nullable=False, server_default=NOW),
    Index("ux_audit_keys_one", text("(true)"), unique=True),
)

# Signed checkpoints: the event count and the heads of the chains that moved since the last one.
audit_checkpoints = Table(
    "audit_checkpoints",
    metadata,
    Column("number", BigInteger, primary_key=True, autoincrement=False),
    Column("at", TZ, nullable=False),
    Column("cut", TZ, nullable=False),
    Column("prev_hash", LargeBinary),
    Column("events", BigInteger, nullable=False),
    Column("tail", BigInteger, nullable=False),
    Column("heads", BigInteger, nullable=False),
    Column("heads_digest", LargeBinary, nullable=False),
    Column("hash", LargeBinary, nullable=False),
    Column("key_fingerprint", Text, ForeignKey("audit_keys.fingerprint"), nullable=False),
    Column("signature", LargeBinary, nullable=False),
)

audit_checkpoint_heads = Table(
    "audit_checkpoint_heads",
    metadata,
    Column("checkpoint", BigInteger, ForeignKey("audit_checkpoints.number"), nullable=False),
    Column("entity", Text, nullable=False),
    Column("entity_id", UUID(as_uuid=True), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("hash", LargeBinary, nullable=False),
    Column("at", TZ, nullable=False),
    PrimaryKeyConstraint("checkpoint", "entity", "entity_id"),
)

__all__ = [
    "api_keys",
    "audit_checkpoint_heads",
    "audit_checkpoints",
    "audit_keys",
    "backups",
    "console_sessions",
    "event_consumers",
    "idempotency_keys",
    "instance_events",
    "instances",
    "job_events",
    "job_fence_seq",
    "job_steps",
    "jobs",
    "lifecycle_transitions",
    "metadata",
    "meter_events_sent",
    "notification_deliveries",
    "notification_targets",
    "organisations",
    "recovery_windows",
    "stripe_events",
    "usage_reports",
]
