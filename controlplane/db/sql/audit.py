"""Statements on the audit log: SRE views, replay and chain checks, dwell, checkpoints, the key, exports."""

from __future__ import annotations

from controlplane.core.lifecycle import INSTANCE
from controlplane.db.sql.template import ENTITY_TABLES, HELD, EntityTable, _live_states

# ---- SRE views: the audit log of all instances, stuck instances, silent jobs -------------------------

# The audit log of all instances, filtered, oldest first after a cursor (SRE views: API and CLI).
SEARCH_INSTANCE_EVENTS = """
SELECT e.*, i.org_id, i.name AS instance_name, o.name AS org_name
FROM instance_events e JOIN instances i ON i.id = e.instance_id JOIN organisations o ON o.id = i.org_id
WHERE e.id > %(after)s
  AND (%(instance)s::uuid IS NULL OR e.instance_id = %(instance)s::uuid)
  AND (%(org)s::uuid IS NULL OR i.org_id = %(org)s::uuid)
  AND (%(actor_kind)s::text = ''
       OR (e.actor_kind = %(actor_kind)s::text
           AND (%(actor_id)s::text = '' OR e.actor_id = %(actor_id)s::text))
       -- or a move of a job that actor enqueued (a Stripe event's suspend, a customer's resize)
       OR EXISTS (SELECT 1 FROM job_events je
                  WHERE je.job_id = (e.detail->>'job_id')::uuid AND je.from_state IS NULL
                    AND je.actor_kind = %(actor_kind)s::text
                    AND (%(actor_id)s::text = '' OR je.actor_id = %(actor_id)s::text)))
  AND (%(event)s::text IS NULL OR e.event = %(event)s::text)
  AND (%(to_state)s::text IS NULL OR e.to_state = %(to_state)s::text)
  AND (%(since)s::timestamptz IS NULL OR e.at >= %(since)s::timestamptz)
  AND (%(until)s::timestamptz IS NULL OR e.at < %(until)s::timestamptz)
ORDER BY e.id
LIMIT %(limit)s
"""

# Stuck: live instances past their state deadline (ix_instances_live_state serves it).
STUCK_INSTANCES = f"""
SELECT id, org_id, name, state, state_entered_at, deadline_at, deadline_retries, progress,
       now() - deadline_at AS overdue
FROM instances
WHERE {_live_states("", INSTANCE.terminal, INSTANCE.states)} AND deadline_at < now()
ORDER BY deadline_at
"""

# Stuck: claimed or running jobs whose heartbeat is older than the reclaim threshold.
SILENT_JOBS = f"""
SELECT id, kind, instance_id, state, claimed_by, heartbeat_at, attempt, now() - heartbeat_at AS silent_for
FROM jobs
WHERE state IN {HELD}
  AND heartbeat_at < now() - make_interval(secs => %(stale_after_s)s::float8)
ORDER BY heartbeat_at
"""

# ---- the audit log: replay and chain checks, dwell times ------------------------------------------

# Rows and logs read at one moment: the audit checks' transaction (a checkpoint's also writes).
READ_ONLY_SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"
SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"

# What the replay and the chain check read of each event (the detail as its jsonb text: hashed).
_AUDIT_COLUMNS = """
       r.id AS entity_id, r.state AS current_state, r.state_version AS current_version,
       r.chain_seq, r.chain_head,
       e.id, e.seq, e.prev_hash, e.hash, e.from_state, e.to_state, e.event, e.actor_kind, e.actor_id,
       e.reason, e.detail::text AS detail_text, e.request_id, e.state_version, e.at
"""

# Every row of an entity with its events in order (rows without events too): the whole-log check.
AUDIT_LOG = {
    entity: f"""
SELECT {_AUDIT_COLUMNS}
FROM {spec.table} r LEFT JOIN {spec.events_table} e ON e.{spec.fk} = r.id
ORDER BY r.id, e.id
"""
    for entity, spec in ENTITY_TABLES.items()
}

# The events at or after a checkpoint's cut, with their rows: the incremental check. Each chain is
# in time order, so these are the end of each chain that moved (partitions pruned, the at index).
AUDIT_LOG_SINCE = {
    entity: f"""
SELECT {_AUDIT_COLUMNS}
FROM {spec.events_table} e JOIN {spec.table} r ON r.id = e.{spec.fk}
WHERE e.at >= %(since)s
ORDER BY e.{spec.fk}, e.id
"""
    for entity, spec in ENTITY_TABLES.items()
}

# Time in each state, per entity. Each event opens a stay in its to_state; the entity's next
# event (by id) closes it. A stay not yet closed is measured up to now(). Terminal states are
# never left, so they are not stays.
DWELL_STATS = {
    entity: f"""
WITH stays AS (
    SELECT e.to_state AS state, e.at AS entered_at,
           lead(e.at) OVER (PARTITION BY e.{spec.fk} ORDER BY e.id) AS left_at
    FROM {spec.events_table} e
), measured AS (
    SELECT state, left_at IS NULL AS open,
           extract(epoch FROM COALESCE(left_at, now()) - entered_at)::float8 AS seconds
    FROM stays
    WHERE state = ANY(%(states)s::text[])
      AND (%(since)s::timestamptz IS NULL OR COALESCE(left_at, now()) >= %(since)s::timestamptz)
)
SELECT state,
       count(*) AS count,
       count(*) FILTER (WHERE open) AS current,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY seconds) AS p50_s,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY seconds) AS p95_s,
       max(seconds) AS max_s
FROM measured
GROUP BY state
"""
    for entity, spec in ENTITY_TABLES.items()
}

# ---- the audit log: signed checkpoints, the signing key, partitions, exports ----------------------

# Before a checkpoint's snapshot: no running transaction started earlier than this.
CHECKPOINT_CUT = """
SELECT least(clock_timestamp(), min(xact_start)) AS cut FROM pg_stat_activity
WHERE xact_start IS NOT NULL AND pid <> pg_backend_pid()
"""
LOCK_CHECKPOINTS = "SELECT pg_advisory_lock(%(key)s)"
UNLOCK_CHECKPOINTS = "SELECT pg_advisory_unlock(%(key)s)"
DATABASE_NOW = "SELECT now() AS now"
LATEST_CHECKPOINT = "SELECT * FROM audit_checkpoints ORDER BY number DESC LIMIT 1"
CHECKPOINT_BY_NUMBER = "SELECT * FROM audit_checkpoints WHERE number = %(number)s"
CHECKPOINTS_FROM = "SELECT * FROM audit_checkpoints WHERE number >= %(since)s ORDER BY number"
CHECKPOINTS_BETWEEN = (
    "SELECT * FROM audit_checkpoints WHERE number BETWEEN %(first)s AND %(last)s ORDER BY number"
)
# The time an export's window starts: the earliest cut of the checkpoints it covers.
CHECKPOINTS_EARLIEST_CUT = (
    "SELECT min(cut) AS start FROM audit_checkpoints WHERE number BETWEEN %(first)s AND %(last)s"
)
NEWEST_CHECKPOINT_AT_OR_BEFORE = "SELECT max(number) AS number FROM audit_checkpoints WHERE at <= %(at)s"
RECORD_CHECKPOINT = """
INSERT INTO audit_checkpoints
    (number, at, cut, prev_hash, events, tail, heads, heads_digest, hash, key_fingerprint, signature)
VALUES (%(number)s, %(at)s, %(cut)s, %(prev_hash)s, %(events)s, %(tail)s, %(heads)s,
        %(heads_digest)s, %(hash)s, %(key)s, %(signature)s)
RETURNING *
"""
COPY_CHECKPOINT_HEADS = (
    "COPY audit_checkpoint_heads (checkpoint, entity, entity_id, seq, hash, at) FROM STDIN"
)
CHECKPOINT_HEADS = (
    "SELECT * FROM audit_checkpoint_heads WHERE checkpoint = %(number)s ORDER BY entity, entity_id"
)


def _chain_heads(spec: EntityTable, windowed: bool) -> str:
    """The last event of each chain with events in the window (all chains without one)."""
    window = "WHERE e.at >= %(since)s" if windowed else ""
    return f"""
SELECT DISTINCT ON (e.{spec.fk}) e.{spec.fk} AS entity_id, e.seq, e.hash, e.at
FROM {spec.events_table} e {window}
ORDER BY e.{spec.fk}, e.id DESC
"""


# What a checkpoint records: the heads of the chains that moved since the previous one's cut.
CHAIN_HEADS_SINCE = {entity: _chain_heads(spec, True) for entity, spec in ENTITY_TABLES.items()}
CHAIN_HEADS = {entity: _chain_heads(spec, False) for entity, spec in ENTITY_TABLES.items()}
COUNT_EVENTS = (
    "SELECT "
    + " + ".join(f"(SELECT count(*) FROM {spec.events_table})" for spec in ENTITY_TABLES.values())
    + " AS n"
)
COUNT_EVENTS_SINCE = (
    "SELECT "
    + " + ".join(
        f"(SELECT count(*) FROM {spec.events_table} WHERE at >= %(since)s)" for spec in ENTITY_TABLES.values()
    )
    + " AS n"
)

# Each head the checkpoints from `since` recorded, with the hash of that event in the log now.
RECORDED_HEADS_IN_LOG = (
    " UNION ALL ".join(
        f"""
(SELECT h.checkpoint, h.entity, h.entity_id, h.seq, h.hash, h.at, e.hash AS event_hash
 FROM audit_checkpoint_heads h
 LEFT JOIN {spec.events_table} e ON e.{spec.fk} = h.entity_id AND e.seq = h.seq AND e.at = h.at
 WHERE h.checkpoint >= %(since)s AND h.entity = '{entity}')
"""
        for entity, spec in ENTITY_TABLES.items()
    )
    + " ORDER BY checkpoint, entity, entity_id"
)

# The count the newest checkpoint states: every chain's newest recorded head, seq + 1.
EVENTS_COVERED_BY_HEADS = """
SELECT COALESCE(sum(seq + 1), 0) AS n FROM (
    SELECT DISTINCT ON (entity, entity_id) seq FROM audit_checkpoint_heads
    ORDER BY entity, entity_id, checkpoint DESC
) heads
"""
# The heads one checkpoint recorded, for an incremental check starting from it.
HEADS_OF_CHECKPOINT = (
    "SELECT entity, entity_id, seq, hash FROM audit_checkpoint_heads WHERE checkpoint = %(number)s"
)

# The event tables' monthly partitions through a time (cp_ensure_event_partitions, as the owner).
ENSURE_PARTITIONS = "SELECT cp_ensure_event_partitions(%(through)s::timestamptz) AS name"

# The signing key: stored once (the table holds one), read with its private half encrypted.
STORE_SIGNING_KEY = """
INSERT INTO audit_keys (fingerprint, public_key, private_key)
VALUES (%(fingerprint)s, %(public)s, %(private)s)
ON CONFLICT DO NOTHING
"""
SIGNING_KEY = "SELECT fingerprint, public_key, private_key FROM audit_keys"
PUBLIC_KEYS = "SELECT fingerprint, public_key FROM audit_keys"


def _export_events(spec: EntityTable, windowed: bool) -> str:
    """The events the checkpoints `first`..`last` cover (up to each chain's newest recorded head)."""
    window = "AND e.at >= %(start)s" if windowed else ""
    return f"""
WITH heads AS (
    SELECT DISTINCT ON (entity_id) entity_id, seq FROM audit_checkpoint_heads
    WHERE entity = %(entity)s AND checkpoint BETWEEN %(first)s AND %(last)s
    ORDER BY entity_id, checkpoint DESC
)
SELECT e.{spec.fk} AS entity_id, e.seq, e.prev_hash, e.hash, e.at, e.from_state, e.to_state,
       e.event, e.actor_kind, e.actor_id, e.reason, e.request_id, e.state_version,
       e.detail::text AS detail_text
FROM {spec.events_table} e JOIN heads h ON h.entity_id = e.{spec.fk}
WHERE e.seq <= h.seq {window}
ORDER BY e.{spec.fk}, e.id
"""


EXPORT_EVENTS = {entity: _export_events(spec, False) for entity, spec in ENTITY_TABLES.items()}
EXPORT_EVENTS_SINCE = {entity: _export_events(spec, True) for entity, spec in ENTITY_TABLES.items()}
