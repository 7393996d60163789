"""audit chain: hash-chained events, monthly partitions, signed checkpoints

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

Every event row carries its entity's sequence number (0, 1, 2 ... without gaps), the hash of its
predecessor for the same instance or job, and its own hash over a canonical encoding of its
fields (`cp_event_hash`; `controlplane/audit/chain.py` computes the same bytes in Python). Each instance
and job row keeps its chain's head (`chain_seq`, `chain_head`), so that the statement writing an
event finds its predecessor in the row it already updates.

The event tables become partitioned by month of `at` (the primary key is `(id, at)`); existing
rows are copied with their chains computed in id order, and partitions are made from the oldest
event's month to three months ahead. `cp_ensure_event_partitions` (security definer, so that the
runtime role, which owns nothing, can call it) makes the months ahead; nothing drops them.

`audit_keys` holds the checkpoint signing key (the private half encrypted by the application),
`audit_checkpoints` and `audit_checkpoint_heads` the signed checkpoints; all three, like the event
tables, refuse UPDATE, DELETE and TRUNCATE.
"""

from __future__ import annotations

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None

# (entity, event table, foreign key, entity table)
EVENT_TABLES = (
    ("instance", "instance_events", "instance_id", "instances"),
    ("job", "job_events", "job_id", "jobs"),
)
APPEND_ONLY = ("audit_keys", "audit_checkpoints", "audit_checkpoint_heads")
PARTITIONS_AHEAD = "3 months"

EVENT_HASH = """
CREATE FUNCTION cp_event_hash(
    entity text, entity_id uuid, seq bigint, prev_hash bytea, from_state text, to_state text,
    event text, actor_kind text, actor_id text, reason text, detail jsonb, request_id text,
    state_version bigint, at timestamptz
) RETURNS bytea LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT sha256(convert_to(json_build_array(
        'cp-event-1'::text, entity, entity_id, seq, encode(prev_hash, 'hex'), from_state, to_state,
        event, actor_kind, actor_id, reason, detail, request_id, state_version,
        (extract(epoch FROM at) * 1000000)::bigint
    )::text, 'UTF8'))
$$
"""

# Monthly partitions (UTC) of both event tables from `since`'s month to `through`'s. A new table
# is attached rather than created as a partition: attaching locks the parent SHARE UPDATE
# EXCLUSIVE, which writers and readers of the log do not wait for.
ENSURE_PARTITIONS = """
CREATE FUNCTION cp_ensure_event_partitions(through timestamptz, since timestamptz DEFAULT NULL)
RETURNS SETOF text LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, public SET timezone = 'UTC' SET lock_timeout = '5s' AS $$
DECLARE
    parent text;
    month timestamptz;
    last timestamptz := date_trunc('month', through);
    name text;
BEGIN
    IF through > now() + interval '5 years' THEN
        RAISE EXCEPTION 'partitions are made at most 5 years ahead, not through %', through
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF since IS NOT NULL AND since < last - interval '50 years' THEN
        RAISE EXCEPTION 'partitions are made for at most 50 years at once, not since %', since
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_advisory_xact_lock(7306086939504817016);
    FOREACH parent IN ARRAY ARRAY['instance_events', 'job_events'] LOOP
        month := date_trunc('month', LEAST(COALESCE(since, now()), now()));
        WHILE month <= last LOOP
            name := parent || to_char(month, '"_y"YYYY"m"MM');
            IF to_regclass('public.' || quote_ident(name)) IS NULL THEN
                EXECUTE format('CREATE TABLE public.%I (LIKE public.%I INCLUDING DEFAULTS)', name, parent);
                EXECUTE format('ALTER TABLE public.%I ATTACH PARTITION public.%I'
                               ' FOR VALUES FROM (%L) TO (%L)',
                               parent, name, month, month + interval '1 month');
                EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON public.%I'
                               ' FOR EACH STATEMENT EXECUTE FUNCTION cp_append_only()',
                               name || '_no_truncate', name);
                RETURN NEXT name;
            END IF;
            month := month + interval '1 month';
        END LOOP;
    END LOOP;
END $$
"""

# The chain head of an entity row moves one event at a time, never sideways or back.
REFUSE_CHAIN_REWRITE = """
CREATE FUNCTION cp_refuse_chain_rewrite() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% %: the chain head may only advance by one event (seq % to %)',
        TG_ARGV[0], OLD.id, OLD.chain_seq, NEW.chain_seq
        USING ERRCODE = 'check_violation';
END $$
"""
CHAIN_GUARD_WHEN = (
    "(NEW.chain_seq, NEW.chain_head) IS DISTINCT FROM (OLD.chain_seq, OLD.chain_head)"
    " AND (NEW.chain_seq IS DISTINCT FROM COALESCE(OLD.chain_seq, -1) + 1 OR NEW.chain_head IS NULL)"
)

EVENT_COLUMNS = (
    "from_state, to_state, event, actor_kind, actor_id, reason, detail, request_id, state_version, at"
)


def _append_only(table: str) -> list[str]:
    """The triggers that refuse UPDATE, DELETE and TRUNCATE of `table`."""
    return [
        f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table}"
        " FOR EACH ROW EXECUTE FUNCTION cp_append_only()",
        f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table}"
        " FOR EACH STATEMENT EXECUTE FUNCTION cp_append_only()",
    ]


def _event_columns(fk: str) -> str:
    """The event tables' columns as 0001 made them (without the id's default)."""
    return f"""
            id bigint NOT NULL,
            {fk} uuid NOT NULL,
            from_state text,
            to_state text NOT NULL,
            event text NOT NULL,
            actor_kind text NOT NULL,
            actor_id text NOT NULL,
            reason text,
            detail jsonb NOT NULL DEFAULT '{{}}'::jsonb,
            request_id text,
            state_version bigint NOT NULL,
            at timestamptz NOT NULL DEFAULT now()"""


def _create_event_table(table: str, fk: str, entity_table: str) -> list[str]:
    return [
        f"""
        CREATE TABLE {table} ({_event_columns(fk)},
            seq bigint NOT NULL,
            prev_hash bytea,
            hash bytea NOT NULL,
            CONSTRAINT pk_{table} PRIMARY KEY (id, at),
            CONSTRAINT fk_{table}_{fk}_{entity_table} FOREIGN KEY ({fk}) REFERENCES {entity_table} (id)
        ) PARTITION BY RANGE (at)
        """,
        f"ALTER TABLE {table} ALTER COLUMN id SET DEFAULT nextval('{table}_id_seq')",
        f"ALTER SEQUENCE {table}_id_seq OWNED BY {table}.id",
        f"CREATE INDEX ix_{table}_{fk}_id ON {table} ({fk}, id)",
        # By time: btree where the log is searched by time, a small BRIN where only the
        # audit's incremental windows read it (rows arrive in time order).
        f"CREATE INDEX ix_{table}_at ON {table} (at)"
        if table == "instance_events"
        else f"CREATE INDEX ix_{table}_at ON {table} USING brin (at)",
        *_append_only(table),
    ]


def _copy_with_chain(entity: str, table: str, fk: str, entity_table: str) -> list[str]:
    """Copy the old rows, computing each entity's chain level by level (seq 0 of every entity, then 1...)."""
    old = f"{table}_0005"

    def hashed(prev: str) -> str:
        return (
            f"cp_event_hash('{entity}', c.{fk}, c.seq, {prev}, c.from_state, c.to_state, c.event,"
            " c.actor_kind, c.actor_id, c.reason, c.detail, c.request_id, c.state_version, c.at)"
        )

    return [
        f"""
        CREATE TEMP TABLE cp_chain ON COMMIT DROP AS
        SELECT o.*, (row_number() OVER (PARTITION BY o.{fk} ORDER BY o.id) - 1)::bigint AS seq,
               NULL::bytea AS prev_hash, NULL::bytea AS hash
        FROM {old} o
        """,
        f"CREATE INDEX ON cp_chain (seq, {fk})",
        f"""
        DO $$
        DECLARE
            level bigint := 1;
            top bigint;
        BEGIN
            UPDATE cp_chain c SET hash = {hashed("NULL")} WHERE c.seq = 0;
            SELECT max(seq) INTO top FROM cp_chain;
            WHILE level <= COALESCE(top, 0) LOOP
                UPDATE cp_chain c SET prev_hash = p.hash, hash = {hashed("p.hash")} FROM cp_chain p
                WHERE c.seq = level AND p.seq = level - 1 AND p.{fk} = c.{fk};
                level := level + 1;
            END LOOP;
        END $$
        """,
        f"""
        SELECT count(*) FROM cp_ensure_event_partitions(
            now() + interval '{PARTITIONS_AHEAD}', (SELECT min(at) FROM cp_chain))
        """,
        f"""
        INSERT INTO {table} (id, {fk}, {EVENT_COLUMNS}, seq, prev_hash, hash)
        SELECT id, {fk}, {EVENT_COLUMNS}, seq, prev_hash, hash FROM cp_chain ORDER BY id
        """,
        f"ALTER TABLE {entity_table} DISABLE TRIGGER {entity_table}_guard_chain",
        f"""
        UPDATE {entity_table} t SET chain_seq = h.seq, chain_head = h.hash
        FROM (SELECT DISTINCT ON ({fk}) {fk}, seq, hash FROM cp_chain ORDER BY {fk}, seq DESC) h
        WHERE t.id = h.{fk}
        """,
        f"ALTER TABLE {entity_table} ENABLE TRIGGER {entity_table}_guard_chain",
        "DROP TABLE cp_chain",
        f"DROP TABLE {old}",
    ]


def _rename_old(table: str, fk: str, entity_table: str) -> list[str]:
    old = f"{table}_0005"
    return [
        f"ALTER TABLE {table} RENAME TO {old}",
        f"ALTER TABLE {old} RENAME CONSTRAINT pk_{table} TO pk_{old}",
        f"ALTER TABLE {old} RENAME CONSTRAINT fk_{table}_{fk}_{entity_table} TO fk_{old}",
        f"ALTER INDEX ix_{table}_{fk}_id RENAME TO ix_{old}_{fk}_id",
        *([f"ALTER INDEX ix_{table}_at RENAME TO ix_{old}_at"] if table == "instance_events" else []),
        f"DROP TRIGGER {table}_append_only ON {old}",
        f"DROP TRIGGER {table}_no_truncate ON {old}",
    ]


def upgrade() -> None:
    op.execute(EVENT_HASH)
    op.execute(REFUSE_CHAIN_REWRITE)
    for entity, _table, _fk, entity_table in EVENT_TABLES:
        op.execute(f"ALTER TABLE {entity_table} ADD COLUMN chain_seq bigint, ADD COLUMN chain_head bytea")
        op.execute(
            f"CREATE TRIGGER {entity_table}_guard_chain BEFORE UPDATE ON {entity_table} FOR EACH ROW"
            f" WHEN ({CHAIN_GUARD_WHEN}) EXECUTE FUNCTION cp_refuse_chain_rewrite('{entity}')"
        )
    for _entity, table, fk, entity_table in EVENT_TABLES:
        for statement in _rename_old(table, fk, entity_table):
            op.execute(statement)
        for statement in _create_event_table(table, fk, entity_table):
            op.execute(statement)
    op.execute(ENSURE_PARTITIONS)
    for entity, table, fk, entity_table in EVENT_TABLES:
        for statement in _copy_with_chain(entity, table, fk, entity_table):
            op.execute(statement)
    op.execute(
        """
        CREATE TABLE audit_keys (
            fingerprint text PRIMARY KEY,
            public_key bytea NOT NULL,
            private_key bytea NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    # One signing key for now; a rotation would add rows and drop this index.
    op.execute("CREATE UNIQUE INDEX ux_audit_keys_one ON audit_keys ((true))")
    op.execute(
        """
        CREATE TABLE audit_checkpoints (
            number bigint PRIMARY KEY,
            at timestamptz NOT NULL,
            cut timestamptz NOT NULL,
            prev_hash bytea,
            events bigint NOT NULL,
            tail bigint NOT NULL,
            heads bigint NOT NULL,
            heads_digest bytea NOT NULL,
            hash bytea NOT NULL,
            key_fingerprint text NOT NULL REFERENCES audit_keys (fingerprint),
            signature bytea NOT NULL
        )
        """
    )
    op.execute(
        """
        CREATE TABLE audit_checkpoint_heads (
            checkpoint bigint NOT NULL REFERENCES audit_checkpoints (number),
            entity text NOT NULL,
            entity_id uuid NOT NULL,
            seq bigint NOT NULL,
            hash bytea NOT NULL,
            at timestamptz NOT NULL,
            PRIMARY KEY (checkpoint, entity, entity_id)
        )
        """
    )
    for table in APPEND_ONLY:
        for statement in _append_only(table):
            op.execute(statement)


def _unpartition(table: str, fk: str, entity_table: str) -> list[str]:
    flat = f"{table}_flat"
    return [
        f"CREATE TABLE {flat} ({_event_columns(fk)})",
        f"INSERT INTO {flat} SELECT id, {fk}, {EVENT_COLUMNS} FROM {table} ORDER BY id",
        f"ALTER SEQUENCE {table}_id_seq OWNED BY NONE",
        f"DROP TABLE {table}",
        f"ALTER TABLE {flat} RENAME TO {table}",
        f"ALTER TABLE {table} ALTER COLUMN id SET DEFAULT nextval('{table}_id_seq')",
        f"ALTER SEQUENCE {table}_id_seq OWNED BY {table}.id",
        f"ALTER TABLE {table} ADD CONSTRAINT pk_{table} PRIMARY KEY (id)",
        f"ALTER TABLE {table} ADD CONSTRAINT fk_{table}_{fk}_{entity_table}"
        f" FOREIGN KEY ({fk}) REFERENCES {entity_table} (id)",
        f"CREATE INDEX ix_{table}_{fk}_id ON {table} ({fk}, id)",
        *([f"CREATE INDEX ix_{table}_at ON {table} (at)"] if table == "instance_events" else []),
        *_append_only(table),
    ]


def downgrade() -> None:
    for table in reversed(APPEND_ONLY):
        op.execute(f"DROP TABLE {table}")
    for _entity, table, fk, entity_table in EVENT_TABLES:
        for statement in _unpartition(table, fk, entity_table):
            op.execute(statement)
    for _entity, _table, _fk, entity_table in EVENT_TABLES:
        op.execute(f"DROP TRIGGER {entity_table}_guard_chain ON {entity_table}")
        op.execute(f"ALTER TABLE {entity_table} DROP COLUMN chain_seq, DROP COLUMN chain_head")
    op.execute("DROP FUNCTION cp_ensure_event_partitions(timestamptz, timestamptz)")
    op.execute("DROP FUNCTION cp_refuse_chain_rewrite()")
    op.execute(
        "DROP FUNCTION cp_event_hash(text, uuid, bigint, bytea, text, text, text, text, text, text,"
        " jsonb, text, bigint, timestamptz)"
    )
