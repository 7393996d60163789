"""event rows only on the lifecycles' moves

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02

`cp_guard_event`, a BEFORE INSERT row trigger on `instance_events` and `job_events` (PostgreSQL
clones it onto every monthly partition, those made later by `cp_ensure_event_partitions`
included): an event row is either its lifecycle's creation (no from-state, the initial state, the
creation event, state_version 0, the chain's first link) or a move of `lifecycle_transitions`
(from_state, event, to_state). The guard on `instances` and `jobs` refuses an illegal change of a
row; the runtime role, which may INSERT into the event tables, could still write an event row on
an illegal edge by itself. Refused now too (SQLSTATE 23514, check_violation). The transition path
writes its event rows in the statement that moves the rows; each costs one primary-key probe of
`lifecycle_transitions`.
"""

from __future__ import annotations

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | None = None
depends_on: str | None = None

# (event table, entity, its id column, initial state, creation event)
EVENT_TABLES = (
    ("instance_events", "instance", "instance_id", "pending", "create"),
    ("job_events", "job", "job_id", "queued", "enqueue"),
)

GUARD_EVENT = """
CREATE FUNCTION cp_guard_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.from_state IS NULL THEN
        IF NEW.to_state = TG_ARGV[2] AND NEW.event = TG_ARGV[3] AND NEW.state_version = 0
           AND NEW.seq = 0 AND NEW.prev_hash IS NULL THEN
            RETURN NEW;
        END IF;
        RAISE EXCEPTION 'illegal event: % % must be created by % in state % at version 0, not by % in % at %',
            TG_ARGV[0], to_jsonb(NEW) ->> TG_ARGV[1], TG_ARGV[3], TG_ARGV[2],
            NEW.event, NEW.to_state, NEW.state_version
            USING ERRCODE = 'check_violation';
    END IF;
    IF EXISTS (
        SELECT 1 FROM lifecycle_transitions t
        WHERE t.entity = TG_ARGV[0] AND t.from_state = NEW.from_state AND t.event = NEW.event
          AND t.to_state = NEW.to_state
    ) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'illegal event: % % from % to % by % is not a move of the % lifecycle',
        TG_ARGV[0], to_jsonb(NEW) ->> TG_ARGV[1], NEW.from_state, NEW.to_state, NEW.event, TG_ARGV[0]
        USING ERRCODE = 'check_violation';
END $$
"""


def upgrade() -> None:
    op.execute(GUARD_EVENT)
    for table, entity, fk, initial, creation in EVENT_TABLES:
        op.execute(
            f"CREATE TRIGGER {table}_guard_event BEFORE INSERT ON {table} FOR EACH ROW"
            f" EXECUTE FUNCTION cp_guard_event('{entity}', '{fk}', '{initial}', '{creation}')"
        )


def downgrade() -> None:
    for table, *_ in EVENT_TABLES:
        op.execute(f"DROP TRIGGER {table}_guard_event ON {table}")
    op.execute("DROP FUNCTION cp_guard_event()")
