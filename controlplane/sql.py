"""Hot-path SQL: every statement that moves state, heartbeats or scans, each named for what it does.

The transition statements are built from one template so that instances and jobs share one path:
guarded UPDATE (id + state_version + state), version bump, event row, pg_notify, in one statement.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.lifecycle import INSTANCE, JOB


def _live_states(table: str, terminal: frozenset[str], states: tuple[str, ...]) -> str:
    """Both forms of "live": NOT IN (terminal) matches the partial indexes' predicate, and IN (live)
    keeps the planner's row estimate honest (it multiplies the NOT IN's selectivities otherwise,
    and on a large table of terminal rows it then plans parallel workers for a hundred rows)."""
    dead = ", ".join(f"'{s}'" for s in states if s in terminal)
    live = ", ".join(f"'{s}'" for s in states if s not in terminal)
    return f"{table}state NOT IN ({dead}) AND {table}state IN ({live})"


LIVE_INSTANCE = _live_states("i.", INSTANCE.terminal, INSTANCE.states)

# The per-row input of every transition: which row, from where, by which event, with what patch.
_MOVES_INPUT = """
    SELECT * FROM unnest(
        %(ids)s::uuid[], %(versions)s::bigint[], %(from_states)s::text[], %(to_states)s::text[],
        %(events)s::text[], %(reasons)s::text[], %(details)s::jsonb[], %(patches)s::jsonb[]
    ) AS m(id, expected_version, from_state, to_state, event, reason, detail, patch)
"""


# The same input for exactly one move, as scalar parameters: cheaper to send than arrays.
_MOVE_INPUT = """
    SELECT %(ids)s::uuid AS id, %(versions)s::bigint AS expected_version,
           %(from_states)s::text AS from_state, %(to_states)s::text AS to_state,
           %(events)s::text AS event, %(reasons)s::text AS reason, %(details)s::jsonb AS detail,
           %(patches)s::jsonb AS patch
"""


def _keep_unless(column: str, expression: str) -> str:
    """Set `column` from the patch when the patch names it, else keep it."""
    return f"{column} = CASE WHEN m.patch ? '{column}' THEN {expression} ELSE t.{column} END"


@dataclass(frozen=True)
class EntityTable:
    entity: str
    table: str
    events_table: str
    fk: str
    # Column assignments applied on every transition of this entity, beyond state and version.
    sets: tuple[str, ...]


INSTANCE_TABLE = EntityTable(
    entity="instance",
    table="instances",
    events_table="instance_events",
    fk="instance_id",
    sets=(
        "updated_at = now()",
        "progress = m.patch->>'progress'",
        "deadline_at = now() + make_interval(secs => (m.patch->>'deadline_s')::float8)",
        "deadline_retries = COALESCE((m.patch->>'deadline_retries')::int, 0)",
        _keep_unless("failure_reason", "m.patch->>'failure_reason'"),
        _keep_unless("failure_code", "m.patch->>'failure_code'"),
        _keep_unless("observed_generation", "(m.patch->>'observed_generation')::bigint"),
        _keep_unless("failed_generation", "(m.patch->>'failed_generation')::bigint"),
        _keep_unless("observed_spec", "m.patch->'observed_spec'"),
        # Ready again: the heal backoff starts over.
        "heal_failures = CASE WHEN m.to_state = 'ready' THEN 0 ELSE t.heal_failures END",
        "heal_given_up_at = CASE WHEN m.to_state = 'ready' THEN NULL ELSE t.heal_given_up_at END",
        _keep_unless("connection", "m.patch->'connection'"),
        _keep_unless("secret", "decode(m.patch->>'secret', 'base64')"),
        _keep_unless("suspended_by_billing", "(m.patch->>'suspended_by_billing')::boolean"),
    ),
)

JOB_TABLE = EntityTable(
    entity="job",
    table="jobs",
    events_table="job_events",
    fk="job_id",
    sets=(
        "updated_at = now()",
        "heartbeat_at = CASE WHEN m.to_state IN ('claimed', 'running') THEN now() END",
        "claimed_by = CASE WHEN m.to_state = 'queued' THEN NULL ELSE t.claimed_by END",
        "run_at = CASE WHEN m.patch ? 'delay_s'"
        " THEN now() + make_interval(secs => (m.patch->>'delay_s')::float8) ELSE t.run_at END",
        _keep_unless("attempt", "(m.patch->>'attempt')::int"),
        _keep_unless("last_error", "m.patch->>'last_error'"),
        _keep_unless("error_kind", "m.patch->>'error_kind'"),
        _keep_unless("verdict", "m.patch->'verdict'"),
    ),
)

ENTITY_TABLES = {"instance": INSTANCE_TABLE, "job": JOB_TABLE}


def event_hash(entity: str, entity_id: str, seq: str, prev_hash: str, fields: str, at: str) -> str:
    """The hash of an event (cp_event_hash; `controlplane/chain.py` is its Python twin), from SQL
    expressions for its fields; `fields` lists from_state .. state_version in the table's order."""
    return f"cp_event_hash('{entity}', {entity_id}, {seq}, {prev_hash}, {fields}, {at})"


# The event row's columns after the entity's id, in the order of cp_event_hash's arguments.
EVENT_FIELDS = "from_state, to_state, event, actor_kind, actor_id, reason, detail, request_id, state_version"
_MOVED_FIELDS = (
    "m.from_state, m.to_state, m.event, %(actor_kind)s, %(actor_id)s, m.reason,"
    " COALESCE(m.detail, '{}'::jsonb), %(request_id)s, t.state_version + 1"
)
# An event's time: its transaction's start, or its predecessor's if that is later (a transaction
# that waited for the row's lock), so that each entity's events are in time order.
_EVENT_AT = "GREATEST(now(), t.state_entered_at)"


def _audit_tail(spec: EntityTable) -> str:
    """Event rows and notifications for the rows in `moved`, then the moved rows themselves.

    The moved rows carry the new chain head (`chain_seq`, `chain_head`, set by the UPDATE) and the
    previous one (`_prev_hash`): the event row is the head, linked to its predecessor."""
    return f"""
, audit AS (
    INSERT INTO {spec.events_table}
        ({spec.fk}, {EVENT_FIELDS}, at, seq, prev_hash, hash)
    SELECT id, _from_state, state, _event, %(actor_kind)s, %(actor_id)s, _reason,
           COALESCE(_detail, '{{}}'::jsonb), %(request_id)s, state_version, state_entered_at,
           chain_seq, _prev_hash, chain_head
    FROM moved
    RETURNING 1
), notified AS (
    SELECT pg_notify('cp_{spec.entity}_' || state, id::text || ':' || state_version) FROM moved
)
SELECT moved.*, (SELECT count(*) FROM audit) AS _audited, (SELECT count(*) FROM notified) AS _notified
FROM moved
"""


def _chain_sets(entity: str, fields: str) -> str:
    """The UPDATE's assignments that move the row, its time in state and its chain head by one event."""
    head = event_hash(entity, "t.id", "COALESCE(t.chain_seq, -1) + 1", "t.chain_head", fields, _EVENT_AT)
    return f"""state_entered_at = {_EVENT_AT},
        chain_seq = COALESCE(t.chain_seq, -1) + 1,
        chain_head = {head}"""


def _transition(spec: EntityTable, moves_input: str) -> str:
    sets = ",\n        ".join(spec.sets)
    return f"""
WITH m AS ({moves_input}), moved AS (
    UPDATE {spec.table} AS t
    SET state = m.to_state,
        state_version = t.state_version + 1,
        {_chain_sets(spec.entity, _MOVED_FIELDS)},
        {sets}
    FROM m JOIN {spec.table} AS prev ON prev.id = m.id
    WHERE t.id = m.id AND t.state_version = m.expected_version AND t.state = m.from_state
      AND t.chain_seq IS NOT DISTINCT FROM prev.chain_seq
    RETURNING t.*, m.from_state AS _from_state, m.event AS _event, m.reason AS _reason,
              m.detail AS _detail, prev.chain_head AS _prev_hash,
              extract(epoch FROM now() - prev.state_entered_at)::float8 AS _dwell_s,
              extract(epoch FROM now() - t.created_at)::float8 AS _age_s
){_audit_tail(spec)}
"""


# Move rows along their lifecycle (one or many): the one transition path.
TRANSITION = {entity: _transition(spec, _MOVES_INPUT) for entity, spec in ENTITY_TABLES.items()}
# The same statement for a single move (scalar parameters instead of arrays).
TRANSITION_ONE = {entity: _transition(spec, _MOVE_INPUT) for entity, spec in ENTITY_TABLES.items()}

# After a transition matched nothing: where the rows really are.
CURRENT_STATES = {
    entity: f"SELECT id, state, state_version FROM {spec.table} WHERE id = ANY(%(ids)s::uuid[])"
    for entity, spec in ENTITY_TABLES.items()
}

# The claim's event fields: the fence is taken once per row (in `picked`), for the row and its event.
_CLAIM_FIELDS = (
    "'queued', 'claimed', 'claim', %(actor_kind)s, %(actor_id)s, NULL,"
    " jsonb_build_object('worker', %(worker)s::text, 'fence', picked.fence), %(request_id)s,"
    " t.state_version + 1"
)

# Claim up to `limit` due queued jobs, each with a new fence, as a transition with its event row.
CLAIM_JOBS = f"""
WITH locked AS (
    SELECT id, state_version, state_entered_at, created_at, chain_seq, chain_head FROM jobs
    WHERE state = 'queued' AND run_at <= now() AND kind = ANY(%(kinds)s::text[])
    ORDER BY priority, run_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT locked.*, nextval('job_fence_seq') AS fence FROM locked
), moved AS (
    UPDATE jobs AS t
    SET state = 'claimed',
        state_version = t.state_version + 1,
        updated_at = now(),
        claimed_by = %(worker)s,
        claimed_at = now(),
        heartbeat_at = now(),
        attempt = t.attempt + 1,
        fence = picked.fence,
        {_chain_sets("job", _CLAIM_FIELDS)}
    FROM picked
    WHERE t.id = picked.id AND t.state_version = picked.state_version AND t.state = 'queued'
      AND t.chain_seq IS NOT DISTINCT FROM picked.chain_seq
    RETURNING t.*, 'queued'::text AS _from_state, 'claim'::text AS _event, NULL::text AS _reason,
              jsonb_build_object('worker', %(worker)s::text, 'fence', t.fence) AS _detail,
              picked.chain_head AS _prev_hash,
              extract(epoch FROM now() - picked.state_entered_at)::float8 AS _dwell_s,
              extract(epoch FROM now() - picked.created_at)::float8 AS _age_s
){_audit_tail(JOB_TABLE)}
"""

# Heartbeat: touches heartbeat_at only; returns the ids the worker still holds.
HEARTBEAT_JOBS = """
UPDATE jobs SET heartbeat_at = now()
WHERE id = ANY(%(ids)s::uuid[]) AND claimed_by = %(worker)s AND state IN ('claimed', 'running')
  AND fence = ANY(%(fences)s::bigint[])
RETURNING id, fence
"""

# The creation event's fields of a job (from the input row, or the created one: the same names).
_ENQUEUE_FIELDS = (
    "NULL, 'queued', 'enqueue', %(actor_kind)s, %(actor_id)s, NULL, jsonb_build_object('kind', kind),"
    " %(request_id)s, 0"
)

# Enqueue jobs (one or many) with their creation events; a second live job of the same
# (instance, kind) is not created: the partial unique index turns it into a no-op.
ENQUEUE_JOBS = f"""
WITH input AS (
    SELECT gen_random_uuid() AS id, now() AS at, i.* FROM unnest(
        %(kinds)s::text[], %(instance_ids)s::uuid[], %(payloads)s::jsonb[], %(priorities)s::int[],
        %(max_attempts)s::int[], %(delays)s::float8[]
    ) AS i(kind, instance_id, payload, priority, max_attempts, delay_s)
), created AS (
    INSERT INTO jobs (id, kind, instance_id, payload, state, priority, max_attempts, run_at,
                      state_entered_at, chain_seq, chain_head)
    SELECT id, kind, instance_id, payload, 'queued', priority, max_attempts,
           now() + make_interval(secs => delay_s), at, 0,
           {event_hash("job", "id", "0", "NULL", _ENQUEUE_FIELDS, "at")}
    FROM input
    ON CONFLICT (instance_id, kind) WHERE state NOT IN ('completed', 'abandoned') DO NOTHING
    RETURNING *
), audit AS (
    INSERT INTO job_events (job_id, {EVENT_FIELDS}, at, seq, prev_hash, hash)
    SELECT id, {_ENQUEUE_FIELDS}, state_entered_at, 0, NULL, chain_head
    FROM created
    RETURNING 1
), notified AS (
    SELECT pg_notify('cp_job_queued', id::text || ':0') FROM created
)
SELECT created.*, (SELECT count(*) FROM audit) AS _audited, (SELECT count(*) FROM notified) AS _n
FROM created
"""

# The live job of each (instance, kind) pair: what a de-duplicated enqueue found instead.
LIVE_JOBS_FOR = """
SELECT * FROM jobs
WHERE (instance_id, kind) IN (SELECT * FROM unnest(%(instance_ids)s::uuid[], %(kinds)s::text[]))
  AND state NOT IN ('completed', 'abandoned')
"""

# The creation event's fields of an instance (from the input row, or the created one).
_CREATE_FIELDS = (
    "NULL, 'pending', 'create', %(actor_kind)s, %(actor_id)s, NULL, jsonb_build_object('spec', spec),"
    " %(request_id)s, 0"
)

# Create an instance in its initial state with its creation event.
CREATE_INSTANCE = f"""
WITH input AS (
    SELECT gen_random_uuid() AS id, now() AS at, %(spec)s::jsonb AS spec
), created AS (
    INSERT INTO instances (id, org_id, name, spec, state, deletion_protection, deadline_at,
                           state_entered_at, chain_seq, chain_head)
    SELECT id, %(org_id)s, %(name)s, spec, 'pending', %(deletion_protection)s,
           now() + make_interval(secs => %(deadline_s)s::float8), at, 0,
           {event_hash("instance", "id", "0", "NULL", _CREATE_FIELDS, "at")}
    FROM input
    RETURNING *
), audit AS (
    INSERT INTO instance_events (instance_id, {EVENT_FIELDS}, at, seq, prev_hash, hash)
    SELECT id, {_CREATE_FIELDS}, state_entered_at, 0, NULL, chain_head
    FROM created
    RETURNING 1
), notified AS (
    SELECT pg_notify('cp_instance_pending', id::text || ':0') FROM created
)
SELECT created.*, o.billing_hold, 0::float8 AS time_in_state_s,
       (SELECT count(*) FROM audit) AS _audited, (SELECT count(*) FROM notified) AS _n
FROM created JOIN organisations o ON o.id = created.org_id
"""

# Supervisor: claimed or running jobs whose heartbeat is older than the threshold (as of `now`,
# injected by the caller or the database's own), locked so two supervisors do not both act.
# Served by the partial index ix_jobs_live_heartbeat.
SCAN_STALE_JOBS = """
SELECT * FROM jobs
WHERE state IN ('claimed', 'running')
  AND heartbeat_at < COALESCE(%(now)s::timestamptz, now()) - make_interval(secs => %(stale_after_s)s::float8)
ORDER BY heartbeat_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""

# Supervisor: failed jobs whose retry time (run_at, set by the error's backoff) has come.
# Served by the partial index ix_jobs_failed_run_at.
SCAN_DUE_FAILED_JOBS = """
SELECT * FROM jobs
WHERE state = 'failed' AND run_at <= COALESCE(%(now)s::timestamptz, now())
ORDER BY run_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""

# Reconciler: a batch of live instances, least recently reconciled first, with the kinds of
# their live jobs and their organisation's hold. Served by the partial index ix_instances_live_state
# (and ux_jobs_live_instance_kind for the jobs), so its cost follows live work, not table size.
SCAN_LIVE_INSTANCES = f"""
SELECT i.id, i.state, i.state_version, i.spec, i.spec_generation, i.observed_generation,
       i.failed_generation, i.deadline_at, i.deadline_retries, i.heal_failures, i.heal_given_up_at,
       i.deletion_requested_at IS NOT NULL AS deletion_requested,
       i.suspended_by_billing, o.billing_hold, i.failure_code, i.created_at,
       ARRAY(SELECT j.kind FROM jobs j
             WHERE j.instance_id = i.id AND j.state NOT IN ('completed', 'abandoned')) AS live_jobs,
       (SELECT max(b.taken_at) FROM backups b
        WHERE b.instance_id = i.id AND b.removed_at IS NULL) AS newest_backup_at,
       COALESCE(%(now)s::timestamptz, now()) AS now
FROM instances i JOIN organisations o ON o.id = i.org_id
WHERE {LIVE_INSTANCE}
ORDER BY i.last_reconciled_at NULLS FIRST, i.id
LIMIT %(limit)s
"""

# Reconciler: what is wrong with an instance whose state has no edge to say it (a degraded or
# suspended instance whose data is then lost): the code and reason, in place, guarded by version.
SET_FAILURE_IN_PLACE = """
UPDATE instances
SET failure_code = %(code)s, failure_reason = %(reason)s, updated_at = now()
WHERE id = %(id)s AND state_version = %(state_version)s
"""

# Reconciler: mark the instances a pass looked at.
TOUCH_RECONCILED = "UPDATE instances SET last_reconciled_at = now() WHERE id = ANY(%(ids)s::uuid[])"

# Reconciler: count a missed deadline and give the state a new one (not a state change).
EXTEND_DEADLINE = """
UPDATE instances
SET deadline_retries = deadline_retries + 1,
    deadline_at = now() + make_interval(secs => %(deadline_s)s::float8),
    updated_at = now()
WHERE id = %(id)s AND state_version = %(state_version)s
"""

# Reconciler metrics: live instances and live jobs by state, and instances past their deadline.
COUNT_LIVE_INSTANCES = f"""
SELECT state, count(*) AS n, count(*) FILTER (WHERE deadline_at < now()) AS over_deadline
FROM instances WHERE {_live_states("", INSTANCE.terminal, INSTANCE.states)} GROUP BY state
"""
COUNT_LIVE_JOBS = f"""
SELECT state, count(*) AS n FROM jobs WHERE {_live_states("", JOB.terminal, JOB.states)} GROUP BY state
"""

# Orphan sweep: what the database knows of the instances the provisioner's inventory names.
INSTANCES_BY_ID = """
SELECT i.id, i.state, i.spec, i.spec_generation,
       EXISTS (SELECT 1 FROM jobs j WHERE j.instance_id = i.id
               AND j.state NOT IN ('completed', 'abandoned')) AS has_live_job
FROM instances i WHERE i.id = ANY(%(ids)s::uuid[])
"""

# A fence for work done outside a job (the orphan sweep): higher than every claim so far.
NEXT_FENCE = "SELECT nextval('job_fence_seq') AS fence"

# The audit log of all instances, filtered, oldest first after a cursor (SRE views: API and CLI).
SEARCH_INSTANCE_EVENTS = """
SELECT e.*, i.org_id FROM instance_events e JOIN instances i ON i.id = e.instance_id
WHERE e.id > %(after)s
  AND (%(instance)s::uuid IS NULL OR e.instance_id = %(instance)s::uuid)
  AND (%(org)s::uuid IS NULL OR i.org_id = %(org)s::uuid)
  AND (%(actor_kind)s::text = '' OR e.actor_kind = %(actor_kind)s::text)
  AND (%(actor_id)s::text = '' OR e.actor_id = %(actor_id)s::text)
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
SILENT_JOBS = """
SELECT id, kind, instance_id, state, claimed_by, heartbeat_at, attempt, now() - heartbeat_at AS silent_for
FROM jobs
WHERE state IN ('claimed', 'running')
  AND heartbeat_at < now() - make_interval(secs => %(stale_after_s)s::float8)
ORDER BY heartbeat_at
"""

# Backups: what the provisioner holds after a backup job, recorded (a new one, or one seen again).
RECORD_BACKUPS = """
INSERT INTO backups (instance_id, backup_id, kind, taken_at, size_bytes, location)
SELECT %(instance_id)s::uuid, b.backup_id, b.kind, b.taken_at, b.size_bytes, b.location
FROM unnest(%(ids)s::text[], %(kinds)s::text[], %(taken)s::timestamptz[], %(sizes)s::bigint[],
            %(locations)s::text[]) AS b(backup_id, kind, taken_at, size_bytes, location)
ON CONFLICT (instance_id, backup_id)
DO UPDATE SET removed_at = NULL, size_bytes = EXCLUDED.size_bytes, location = EXCLUDED.location
"""

# Backups: those the provisioner no longer holds (retention removed them) are no longer held.
FORGET_BACKUPS = """
UPDATE backups SET removed_at = now()
WHERE instance_id = %(instance_id)s AND removed_at IS NULL AND NOT (backup_id = ANY(%(ids)s::text[]))
"""

# Backups held of one instance, newest first, after a cursor (ix_backups_held serves it).
HELD_BACKUPS = """
SELECT * FROM backups
WHERE instance_id = %(instance_id)s AND removed_at IS NULL
  AND (%(before_taken)s::timestamptz IS NULL
       OR (taken_at, backup_id) < (%(before_taken)s::timestamptz, %(before_id)s::text))
ORDER BY taken_at DESC, backup_id DESC
LIMIT %(limit)s
"""

# One held backup by its id.
HELD_BACKUP = """
SELECT * FROM backups WHERE instance_id = %(instance_id)s AND backup_id = %(backup_id)s AND removed_at IS NULL
"""

# One instance as the API shows it (with its organisation's hold and time in state), scoped to an
# organisation unless `org` is NULL (an SRE's look-up).
INSTANCE_IN_SCOPE = """
SELECT i.*, o.billing_hold,
       extract(epoch FROM clock_timestamp() - i.state_entered_at)::float8 AS time_in_state_s
FROM instances i JOIN organisations o ON o.id = i.org_id
WHERE i.id = %(id)s AND (%(org)s::uuid IS NULL OR i.org_id = %(org)s::uuid)
"""
