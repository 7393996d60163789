"""Every statement on the control plane's database, each named for what it does, in sections by area.

The transition statements are built from one template so that instances and jobs share one path:
guarded UPDATE (id + state_version + state), version bump, event row, pg_notify, in one statement.
Every write to `instances` and `jobs` is here. (The servers the control plane runs, its embedded
database and the local provisioner's instances, are administered in `postgres.py`, `embedded.py`
and `provisioners/local/`.)
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.core.lifecycle import INSTANCE, JOB, JOB_HELD, JOB_TERMINAL


def state_list(states: tuple[str, ...]) -> str:
    """A state set as an SQL list literal, e.g. ('claimed', 'running')."""
    return "(" + ", ".join(f"'{s}'" for s in states) + ")"


# Jobs a worker holds, and finished jobs (the partial indexes' predicates use the same lists).
HELD = state_list(JOB_HELD)
FINISHED = state_list(JOB_TERMINAL)


def _live_states(table: str, terminal: frozenset[str], states: tuple[str, ...]) -> str:
    """Both forms of "live": NOT IN (terminal) matches the partial indexes' predicate, and IN (live)
    keeps the planner's row estimate honest (it multiplies the NOT IN's selectivities otherwise,
    and on a large table of terminal rows it then plans parallel workers for a hundred rows)."""
    dead = ", ".join(f"'{s}'" for s in states if s in terminal)
    live = ", ".join(f"'{s}'" for s in states if s not in terminal)
    return f"{table}state NOT IN ({dead}) AND {table}state IN ({live})"


LIVE_INSTANCE = _live_states("i.", INSTANCE.terminal, INSTANCE.states)
# An instance's reconciler shard (0 .. shard_count - 1), from its id (see JOIN_SHARDS).
SHARD_OF = "mod(hashtext({id}::text) & 2147483647, %(shard_count)s)"

# ---- the one transition path (instances and jobs) -------------------------------------------------

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
        f"heartbeat_at = CASE WHEN m.to_state IN {HELD} THEN now() END",
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
    """The hash of an event (cp_event_hash; `controlplane/audit/chain.py` is its Python twin), from SQL
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


def _audit_ctes(spec: EntityTable) -> str:
    """Event rows and notifications for the rows in `moved` (a final SELECT must read both CTEs).

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
)"""


# The moved rows themselves, once their event rows and notifications are written.
_RETURN_MOVED = """
SELECT moved.*, (SELECT count(*) FROM audit) AS _audited, (SELECT count(*) FROM notified) AS _notified
FROM moved
"""


def _audit_tail(spec: EntityTable) -> str:
    """Event rows and notifications for the rows in `moved`, then the moved rows themselves."""
    return _audit_ctes(spec) + _RETURN_MOVED


def _chain_sets(entity: str, fields: str) -> str:
    """The UPDATE's assignments that move the row, its time in state and its chain head by one event."""
    head = event_hash(entity, "t.id", "COALESCE(t.chain_seq, -1) + 1", "t.chain_head", fields, _EVENT_AT)
    return f"""state_entered_at = {_EVENT_AT},
        chain_seq = COALESCE(t.chain_seq, -1) + 1,
        chain_head = {head}"""


def _transition_ctes(spec: EntityTable, moves_input: str, *, by_ctid: bool = False) -> str:
    """The transition's CTEs (`m`, `moved`, `audit`, `notified`): a final SELECT completes them.

    `by_ctid`: the input also names each row's ctid (`row_ctid`, of a row this transaction holds
    locked), so the UPDATE reads it by a TID scan, and the moved rows carry their new `_ctid`."""
    sets = ",\n        ".join(spec.sets)
    locate = "t.ctid = m.row_ctid AND " if by_ctid else ""
    locate_prev = "prev.ctid = m.row_ctid AND " if by_ctid else ""
    new_ctid = "t.ctid AS _ctid, " if by_ctid else ""
    return f"""
WITH m AS ({moves_input}), moved AS (
    UPDATE {spec.table} AS t
    SET state = m.to_state,
        state_version = t.state_version + 1,
        {_chain_sets(spec.entity, _MOVED_FIELDS)},
        {sets}
    FROM m JOIN {spec.table} AS prev ON {locate_prev}prev.id = m.id
    WHERE {locate}t.id = m.id AND t.state_version = m.expected_version AND t.state = m.from_state
      AND t.chain_seq IS NOT DISTINCT FROM prev.chain_seq
    RETURNING t.*, {new_ctid}m.from_state AS _from_state, m.event AS _event, m.reason AS _reason,
              m.detail AS _detail, prev.chain_head AS _prev_hash,
              extract(epoch FROM now() - prev.state_entered_at)::float8 AS _dwell_s,
              extract(epoch FROM now() - t.created_at)::float8 AS _age_s
){_audit_ctes(spec)}"""


def _transition(spec: EntityTable, moves_input: str) -> str:
    return _transition_ctes(spec, moves_input) + _RETURN_MOVED


# Move rows along their lifecycle (one or many): the one transition path.
TRANSITION = {entity: _transition(spec, _MOVES_INPUT) for entity, spec in ENTITY_TABLES.items()}
# The same statement for a single move (scalar parameters instead of arrays).
TRANSITION_ONE = {entity: _transition(spec, _MOVE_INPUT) for entity, spec in ENTITY_TABLES.items()}

# After a transition matched nothing: where the rows really are.
CURRENT_STATES = {
    entity: f"SELECT id, state, state_version FROM {spec.table} WHERE id = ANY(%(ids)s::uuid[])"
    for entity, spec in ENTITY_TABLES.items()
}

# ---- jobs: the queue's hot path (claim, heartbeat, enqueue) ---------------------------------------

# The claim's event fields: the fence is taken once per row (in `picked`), for the row and its event.
_CLAIM_FIELDS = (
    "'queued', 'claimed', 'claim', %(actor_kind)s, %(actor_id)s, NULL,"
    " jsonb_build_object('worker', %(worker)s::text, 'fence', picked.fence), %(request_id)s,"
    " t.state_version + 1"
)

# The claim's order: priority, then work already begun (a reclaimed or retried job, attempt > 0)
# before fresh work, then run_at; served by the partial index ix_jobs_queued_order, whose columns
# are these expressions. A reclaimed job keeps its run_at, so without the middle key it could wait
# behind a backlog enqueued at the same moment.
CLAIM_ORDER = "priority, attempt = 0, run_at"

# Where in that order a claim reads fresh work: at (from_priority, from_fresh, from_run_at) or
# after. A worker passes a point just before the fresh jobs it claimed last, so that its index scan
# does not walk the entries of the rows claimed since (dead, but kept while any snapshot is older
# than them). What sorts before fresh work of that priority (a higher priority, a reclaimed or
# retried job: few rows) is read at every claim too (CLAIM_BEFORE); only fresh work that sorts
# before the point (an enqueue that committed late) waits for a claim from the start of the order
# (CLAIM_FROM_START), which a worker makes every so often.
_CLAIM_KEY = "(priority, attempt = 0, run_at)"
CLAIM_FROM = (
    f"{_CLAIM_KEY} >= (%(from_priority)s::int, %(from_fresh)s::boolean, %(from_run_at)s::timestamptz)"
)
CLAIM_BEFORE = (
    f"{_CLAIM_KEY} < (%(from_priority)s::int, true, '-infinity'::timestamptz)"
    f" AND {_CLAIM_KEY} < (%(from_priority)s::int, %(from_fresh)s::boolean, %(from_run_at)s::timestamptz)"
)
CLAIM_FROM_START = {"from_priority": -(2**31), "from_fresh": False, "from_run_at": "-infinity"}


def _claim_range(condition: str) -> str:
    """Due queued jobs in one range of the claim's order, locked (SKIP LOCKED), as the index
    reads them; the claim takes the first `limit` of both ranges."""
    return f"""SELECT * FROM (
        SELECT ctid AS row_ctid, state AS row_state, id, state_version, state_entered_at, created_at,
               chain_seq, chain_head, priority, attempt = 0 AS fresh, run_at
        FROM jobs
        WHERE state = 'queued' AND run_at <= now() AND kind = ANY(%(kinds)s::text[]) AND {condition}
        ORDER BY {CLAIM_ORDER}
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) AS in_range"""


# Claim up to `limit` due queued jobs, each with a new fence, as a transition with its event row.
# The UPDATE finds each locked row by its ctid (unchanged while the lock is held), and its guard
# compares the state with the locked row's rather than with a constant: a constant lets a plan
# made while `jobs` looked small read a partial index (queued, live) whole for every row instead,
# and under a pinned xmin horizon those hold the dead entry of every job claimed since.
_CLAIM_CTES = f"""
WITH candidates AS (
    {_claim_range(CLAIM_BEFORE)}
    UNION ALL
    {_claim_range(CLAIM_FROM)}
), locked AS (
    SELECT * FROM candidates ORDER BY priority, fresh, run_at LIMIT %(limit)s
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
    WHERE t.ctid = picked.row_ctid
      AND t.id = picked.id AND t.state_version = picked.state_version AND t.state = picked.row_state
      AND t.chain_seq IS NOT DISTINCT FROM picked.chain_seq
    RETURNING t.*, t.ctid AS _ctid, 'queued'::text AS _from_state, 'claim'::text AS _event,
              NULL::text AS _reason,
              jsonb_build_object('worker', %(worker)s::text, 'fence', t.fence) AS _detail,
              picked.chain_head AS _prev_hash,
              extract(epoch FROM now() - picked.state_entered_at)::float8 AS _dwell_s,
              extract(epoch FROM now() - picked.created_at)::float8 AS _age_s
){_audit_ctes(JOB_TABLE)}"""


def _substitute(statement: str, **expressions: str) -> str:
    """`statement` with each %(name)s placeholder named replaced by an SQL expression."""
    for name, expression in expressions.items():
        statement = statement.replace(f"%({name})s", expression)
    return statement


def _bind(statement: str, **expressions: str) -> str:
    """`statement` with every placeholder replaced by an SQL expression (a function's body)."""
    statement = _substitute(statement, **expressions)
    assert "%(" not in statement, f"unbound placeholder in {statement}"
    return statement


# The claim on its own (a claimed job is started by a transition of its own), over the whole queue.
CLAIM_JOBS = (
    _substitute(
        _CLAIM_CTES,
        from_priority=f"({CLAIM_FROM_START['from_priority']})",
        from_fresh="false",
        from_run_at="'-infinity'",
    )
    + _RETURN_MOVED
)


# The start of the rows a claim just took, as the transition template's input (in the function),
# each with the ctid and the state its claim left it at (no constant state: see _CLAIM_CTES).
_START_CLAIMED_INPUT = """
    SELECT c.id, c.version AS expected_version, c.from_state,
           'running'::text AS to_state, 'start'::text AS event, NULL::text AS reason,
           NULL::jsonb AS detail, '{}'::jsonb AS patch, c.row_ctid
    FROM unnest(v_ids, v_versions, v_ctids, v_states) AS c(id, version, row_ctid, from_state)
"""
_WORKER_ACTOR = {"actor_kind": "'worker'::text", "actor_id": "p_worker", "request_id": "NULL::text"}
_CLAIM_FROM_ARGS = {
    "from_priority": "p_from_priority",
    "from_fresh": "p_from_fresh",
    "from_run_at": "p_from_run_at",
}

# The body of cp_claim_and_start (migration 0009 holds this text; tests/integration/test_schema.py
# checks that the installed function still matches it, so a change here needs a migration).
# Two statements in one call, one round trip: the claim (CLAIM_JOBS: SKIP LOCKED, a new fence,
# its event rows), then the start of what it claimed through the one transition template (guarded
# on id, version and state, its own event rows); the state trigger checks each. Returns the jobs as
# started, with how long each had been queued.
CLAIM_AND_START_BODY = f"""
DECLARE
    v_ids uuid[];
    v_versions bigint[];
    v_ctids tid[];
    v_states text[];
    v_queued float8[];
    v_audited bigint;
    v_notified bigint;
BEGIN
{_bind(_CLAIM_CTES, kinds="p_kinds", limit="p_limit", worker="p_worker", **_CLAIM_FROM_ARGS, **_WORKER_ACTOR)}
SELECT array_agg(moved.id), array_agg(moved.state_version), array_agg(moved._ctid),
       array_agg(moved.state), array_agg(moved._dwell_s), (SELECT count(*) FROM audit),
       (SELECT count(*) FROM notified)
INTO v_ids, v_versions, v_ctids, v_states, v_queued, v_audited, v_notified
FROM moved;
IF v_ids IS NULL THEN
    RETURN;
END IF;
{_bind(_transition_ctes(JOB_TABLE, _START_CLAIMED_INPUT, by_ctid=True), **_WORKER_ACTOR)}
SELECT array_agg(moved._ctid), (SELECT count(*) FROM audit), (SELECT count(*) FROM notified)
INTO v_ctids, v_audited, v_notified
FROM moved;
-- The rows the start wrote (their ctids: this transaction holds them locked).
RETURN QUERY
    SELECT q.queued_s, j FROM unnest(v_ids, v_queued) AS q(id, queued_s)
    JOIN jobs AS j ON j.ctid = ANY(v_ctids) AND j.id = q.id;
END
"""
CLAIM_AND_START_SIGNATURE = (
    "cp_claim_and_start(p_kinds text[], p_limit integer, p_worker text,"
    " p_from_priority integer, p_from_fresh boolean, p_from_run_at timestamptz)"
)
# The function's own planner settings (migrations 0012 and 0013 set them; the schema test checks
# them). Its cached plans are generic and made while `jobs` may look small, so they cannot know
# that the claim's starting point leaves little of the queued index to read, nor that the table
# will grow before the next ANALYZE. No sort (but the merge of the claim's two ranges, a few rows):
# the claim's order is the queued index's; a sort took the live-state index instead, which reads
# the dead entry of every job claimed while the xmin horizon is pinned. No sequential scan: every
# row the function touches is found by its ctid or its id; a small table's plan joined the locked
# rows with a scan of all of `jobs`. No JIT: the cost a disabled plan type adds would otherwise
# have each call compiled, for a second and more.
CLAIM_AND_START_CONFIG = ("enable_sort=off", "jit=off", "enable_seqscan=off")

# Claim up to `limit` jobs of `kinds` and start them, in one statement (see CLAIM_AND_START_BODY).
CLAIM_AND_START = """
SELECT (c.job).*, c.queued_s AS _queued_s
FROM cp_claim_and_start(
    %(kinds)s::text[], %(limit)s::int, %(worker)s::text,
    %(from_priority)s::int, %(from_fresh)s::boolean, %(from_run_at)s::timestamptz
) AS c
"""

# Heartbeat: touches heartbeat_at only; returns the ids (and fences) the worker still holds. A
# row locked by another writer (this worker's own batch of finishes, a reclaim) is not waited for
# (SKIP LOCKED): waiting there, each statement holding rows the other needed, was a deadlock. Such a
# row is still reported as held if it was, and gets its beat next time. The rows are read by id
# alone (a materialized CTE), then each is locked by the ctid it was read at, its state compared
# with the state read: no held-state constant or parameter reaches a scan of `jobs`. With one, the
# planner proved the predicate of the partial index of live jobs and read it whole for the lock,
# which under a pinned xmin horizon holds the dead entry of every job moved since (110 ms and
# 92,000 buffers a beat after 8 minutes, against a TID lookup per held row).
HEARTBEAT_JOBS = f"""
WITH rows AS MATERIALIZED (
    SELECT ctid AS row_ctid, id, fence, state, claimed_by FROM jobs WHERE id = ANY(%(ids)s::uuid[])
), held AS (
    SELECT row_ctid, id, fence, state FROM rows
    WHERE claimed_by = %(worker)s AND state IN {HELD} AND fence = ANY(%(fences)s::bigint[])
), locked AS (
    SELECT j.ctid AS row_ctid FROM held JOIN jobs AS j ON j.ctid = held.row_ctid
    WHERE j.id = held.id AND j.claimed_by = %(worker)s AND j.state = held.state
      AND j.fence = held.fence
    FOR NO KEY UPDATE OF j SKIP LOCKED
), beat AS (
    UPDATE jobs SET heartbeat_at = now() FROM locked WHERE jobs.ctid = locked.row_ctid
    RETURNING 1
)
SELECT id, fence FROM held
"""

# The creation event's fields of a job (from the input row, or the created one: the same names).
_ENQUEUE_FIELDS = (
    "NULL, 'queued', 'enqueue', %(actor_kind)s, %(actor_id)s, NULL, jsonb_build_object('kind', kind),"
    " %(request_id)s, 0"
)

# The per-job input of an enqueue: many as arrays, or one as scalars (cheaper to send).
_ENQUEUE_INPUT = """
    SELECT gen_random_uuid() AS id, now() AS at, i.* FROM unnest(
        %(kinds)s::text[], %(instance_ids)s::uuid[], %(payloads)s::jsonb[], %(priorities)s::int[],
        %(max_attempts)s::int[], %(delays)s::float8[]
    ) AS i(kind, instance_id, payload, priority, max_attempts, delay_s)
"""
_ENQUEUE_ONE_INPUT = """
    SELECT gen_random_uuid() AS id, now() AS at, %(kinds)s::text AS kind,
           %(instance_ids)s::uuid AS instance_id, %(payloads)s::jsonb AS payload,
           %(priorities)s::int AS priority, %(max_attempts)s::int AS max_attempts,
           %(delays)s::float8 AS delay_s
"""


def _enqueue_ctes(job_input: str, prefix: str = "") -> str:
    """Enqueue jobs with their creation events (CTEs `input`, `created`, `audit`, `notified`, each
    name prefixed); a second live job of the same (instance, kind) is not created: the partial
    unique index turns it into a no-op."""
    return f"""{prefix}input AS ({job_input}), {prefix}created AS (
    INSERT INTO jobs (id, kind, instance_id, payload, state, priority, max_attempts, run_at,
                      state_entered_at, chain_seq, chain_head)
    SELECT id, kind, instance_id, payload, 'queued', priority, max_attempts,
           now() + make_interval(secs => delay_s), at, 0,
           {event_hash("job", "id", "0", "NULL", _ENQUEUE_FIELDS, "at")}
    FROM {prefix}input
    ON CONFLICT (instance_id, kind) WHERE state NOT IN {FINISHED} DO NOTHING
    RETURNING *
), {prefix}audit AS (
    INSERT INTO job_events (job_id, {EVENT_FIELDS}, at, seq, prev_hash, hash)
    SELECT id, {_ENQUEUE_FIELDS}, state_entered_at, 0, NULL, chain_head
    FROM {prefix}created
    RETURNING 1
), {prefix}notified AS (
    SELECT pg_notify('cp_job_queued', id::text || ':0') FROM {prefix}created
)"""


def _enqueue(job_input: str) -> str:
    return f"""
WITH {_enqueue_ctes(job_input)}
SELECT created.*, (SELECT count(*) FROM audit) AS _audited, (SELECT count(*) FROM notified) AS _n
FROM created
"""


ENQUEUE_JOBS = _enqueue(_ENQUEUE_INPUT)
# The same statement for a single job (as TRANSITION_ONE is for a single move).
ENQUEUE_JOB = _enqueue(_ENQUEUE_ONE_INPUT)

# The live job of each (instance, kind) pair: what a de-duplicated enqueue found instead.
LIVE_JOBS_FOR = f"""
SELECT * FROM jobs
WHERE (instance_id, kind) IN (SELECT * FROM unnest(%(instance_ids)s::uuid[], %(kinds)s::text[]))
  AND state NOT IN {FINISHED}
"""

# ---- instances: creation ---------------------------------------------------------------------------

# The creation event's fields of an instance (from the input row, or the created one); a retry's
# names the failed instance it replaces.
_CREATE_FIELDS = (
    "NULL, 'pending', 'create', %(actor_kind)s, %(actor_id)s, NULL, jsonb_build_object('spec', spec)"
    " || CASE WHEN replaces IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('replaces', replaces) END,"
    " %(request_id)s, 0"
)

# Create an instance in its initial state with its creation event (a retry names the failed one).
_CREATE_INSTANCE_CTES = f"""
WITH input AS (
    SELECT gen_random_uuid() AS id, now() AS at, %(spec)s::jsonb AS spec, %(replaces)s::uuid AS replaces
), created AS (
    INSERT INTO instances (id, org_id, name, spec, state, deletion_protection, deadline_at,
                           state_entered_at, chain_seq, chain_head, replaces)
    SELECT id, %(org_id)s, %(name)s, spec, 'pending', %(deletion_protection)s,
           now() + make_interval(secs => %(deadline_s)s::float8), at, 0,
           {event_hash("instance", "id", "0", "NULL", _CREATE_FIELDS, "at")}, replaces
    FROM input
    RETURNING *
), audit AS (
    INSERT INTO instance_events (instance_id, {EVENT_FIELDS}, at, seq, prev_hash, hash)
    SELECT id, {_CREATE_FIELDS}, state_entered_at, 0, NULL, chain_head
    FROM created
    RETURNING 1
), notified AS (
    SELECT pg_notify('cp_instance_pending', id::text || ':0') FROM created
)"""
_CREATED_INSTANCE = """
SELECT created.*, o.billing_hold, 0::float8 AS time_in_state_s,
       (SELECT count(*) FROM audit) AS _audited, (SELECT count(*) FROM notified) AS _n{more}
FROM created JOIN organisations o ON o.id = created.org_id
"""
CREATE_INSTANCE = _CREATE_INSTANCE_CTES + _CREATED_INSTANCE.format(more="")

# The new instance's first job, from the instance the same statement creates.
_FIRST_JOB_INPUT = """
    SELECT gen_random_uuid() AS id, now() AS at, %(job_kind)s::text AS kind,
           created.id AS instance_id, %(job_payload)s::jsonb AS payload,
           %(job_priority)s::int AS priority, %(job_max_attempts)s::int AS max_attempts,
           0::float8 AS delay_s
    FROM created
"""

# Create an instance and its first job, each with its creation event, in one statement: the rows
# a create needs, in one round trip.
CREATE_INSTANCE_WITH_JOB = (
    _CREATE_INSTANCE_CTES
    + ", "
    + _enqueue_ctes(_FIRST_JOB_INPUT, "job_")
    + _CREATED_INSTANCE.format(
        more=",\n       (SELECT count(*) FROM job_audit) + (SELECT count(*) FROM job_notified) AS _job_n,"
        "\n       (SELECT kind FROM job_created) AS _job_kind"
    )
)

# ---- the supervisor's scans -------------------------------------------------------------------------

# Supervisor: claimed or running jobs whose heartbeat is older than the threshold (as of `now`,
# injected by the caller or the database's own), locked so two supervisors do not both act.
# Served by the partial index ix_jobs_live_heartbeat.
SCAN_STALE_JOBS = f"""
SELECT * FROM jobs
WHERE state IN {HELD}
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

# ---- the reconciler ---------------------------------------------------------------------------------

# Reconciler: a batch of live instances (of the given shards, or all), least recently reconciled
# first, with the kinds of their live jobs and their organisation's hold. Served by the partial
# index ix_instances_live_state (and ux_jobs_live_instance_kind for the jobs), so its cost follows
# live work, not table size.
SCAN_LIVE_INSTANCES = f"""
SELECT i.id, i.state, i.state_version, i.spec, i.spec_generation, i.observed_generation,
       i.failed_generation, i.deadline_at, i.deadline_retries, i.heal_failures, i.heal_given_up_at,
       i.deletion_requested_at IS NOT NULL AS deletion_requested,
       i.suspended_by_billing, o.billing_hold, i.failure_code, i.created_at,
       ARRAY(SELECT j.kind FROM jobs j
             WHERE j.instance_id = i.id AND j.state NOT IN {FINISHED}) AS live_jobs,
       (SELECT max(b.taken_at) FROM backups b
        WHERE b.instance_id = i.id AND b.removed_at IS NULL) AS newest_backup_at,
       COALESCE(%(now)s::timestamptz, now()) AS now
FROM instances i JOIN organisations o ON o.id = i.org_id
WHERE {LIVE_INSTANCE}
  AND (%(shards)s::int[] IS NULL OR {SHARD_OF.format(id="i.id")} = ANY(%(shards)s::int[]))
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
INSTANCES_BY_ID = f"""
SELECT i.id, i.state, i.spec, i.spec_generation,
       EXISTS (SELECT 1 FROM jobs j WHERE j.instance_id = i.id
               AND j.state NOT IN {FINISHED}) AS has_live_job
FROM instances i WHERE i.id = ANY(%(ids)s::uuid[])
"""

# A fence for work done outside a job (the orphan sweep): higher than every claim so far.
NEXT_FENCE = "SELECT nextval('job_fence_seq') AS fence"

# ---- SRE views: the audit log of all instances, stuck instances, silent jobs -------------------------

# The audit log of all instances, filtered, oldest first after a cursor (SRE views: API and CLI).
SEARCH_INSTANCE_EVENTS = """
SELECT e.*, i.org_id FROM instance_events e JOIN instances i ON i.id = e.instance_id
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

# ---- instances as the customer sees them (the use cases and the API) --------------------------

# The row, its organisation's billing hold, its time in state and the instance that retried it (the
# table is `i`, its organisation `o`; ux_instances_replaces serves the look-up).
_CUSTOMER_INSTANCE = """
SELECT i.*, o.billing_hold,
       extract(epoch FROM clock_timestamp() - i.state_entered_at)::float8 AS time_in_state_s,
       (SELECT r.id FROM instances r WHERE r.replaces = i.id) AS replaced_by
FROM instances i JOIN organisations o ON o.id = i.org_id
"""

# One instance of an organisation (scoped in SQL: another organisation's id finds nothing).
ORG_INSTANCE = _CUSTOMER_INSTANCE + "WHERE i.id = %(id)s AND i.org_id = %(org)s"
# The same, locked for a change (plan, deletion protection, deletion request). FOR NO KEY UPDATE,
# the lock an UPDATE of non-key columns takes: it serialises the writers of the row but lets a
# worker's transaction take the FOR KEY SHARE lock of its foreign-key checks (a job or event row
# naming the instance), so the change's job insert, which may wait for that transaction, cannot
# wait on it in a cycle (FOR UPDATE made the two deadlock).
LOCK_ORG_INSTANCE = ORG_INSTANCE + " FOR NO KEY UPDATE OF i"
# Whether an organisation has (or had) an instance of this id, live or not (a restore's source).
ORG_HAS_INSTANCE = "SELECT 1 FROM instances WHERE id = %(id)s AND org_id = %(org)s"
# One instance of any organisation (an SRE's look-up: its backups, a restore it decides), and locked.
ANY_INSTANCE = _CUSTOMER_INSTANCE + "WHERE i.id = %(id)s"
LOCK_ANY_INSTANCE = ANY_INSTANCE + " FOR NO KEY UPDATE OF i"

# The instances an organisation's name may mean: its live instance of that name if any, else the
# ones of that name neither archived nor replaced by a retry (newest first).
INSTANCES_NAMED = """
SELECT i.id, i.state NOT IN ('deleted', 'failed') AS live FROM instances i
WHERE i.org_id = %(org)s AND i.name = %(name)s AND i.archived_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM instances r WHERE r.replaces = i.id)
ORDER BY live DESC, i.created_at DESC, i.id LIMIT 10
"""

# A page of an organisation's instances, oldest first, after a (created_at, id) cursor; archived
# ones only when asked for, and optionally those of one name.
LIST_ORG_INSTANCES = (
    _CUSTOMER_INSTANCE
    + """WHERE i.org_id = %(org)s
  AND (%(archived)s OR i.archived_at IS NULL)
  AND (%(name)s::text IS NULL OR i.name = %(name)s::text)
  AND (%(state)s::text IS NULL OR i.state = %(state)s::text)
  AND (NOT %(live)s OR i.state NOT IN ('deleted', 'failed'))
  AND (%(after_created)s::timestamptz IS NULL
       OR (i.created_at, i.id) > (%(after_created)s::timestamptz, %(after_id)s::uuid))
ORDER BY i.created_at, i.id LIMIT %(limit)s
"""
)

# A page of one instance's audit log, oldest first, after an event id.
ORG_INSTANCE_EVENTS = """
SELECT e.* FROM instance_events e JOIN instances i ON i.id = e.instance_id
WHERE e.instance_id = %(id)s AND i.org_id = %(org)s AND e.id > %(after)s ORDER BY e.id LIMIT %(limit)s
"""

# The transitions of an organisation's instance after a state_version (a watch that reconnects).
ORG_INSTANCE_MOVES_AFTER = """
SELECT e.to_state, e.state_version FROM instance_events e JOIN instances i ON i.id = e.instance_id
WHERE e.instance_id = %(id)s AND i.org_id = %(org)s AND e.state_version > %(after)s ORDER BY e.id
"""

# Change: a new plan is a new spec generation; deletion protection takes effect at once.
CHANGE_INSTANCE_SPEC = """
UPDATE instances SET
    spec = CASE WHEN %(new_plan)s THEN spec || jsonb_build_object('plan', %(plan)s::text) ELSE spec END,
    spec_generation = spec_generation + CASE WHEN %(new_plan)s THEN 1 ELSE 0 END,
    deletion_protection = COALESCE(%(protection)s, deletion_protection),
    updated_at = now()
WHERE id = %(id)s AND org_id = %(org)s
"""

# Delete a failed instance: archived (once; asking again keeps the first time), out of the lists.
ARCHIVE_INSTANCE = """
UPDATE instances SET archived_at = COALESCE(archived_at, now()), updated_at = now()
WHERE id = %(id)s AND org_id = %(org)s AND state = 'failed'
"""

# Delete: record the request (carried out now or as soon as the instance can be deprovisioned).
REQUEST_DELETION = """
UPDATE instances SET deletion_requested_at = now(), skip_final_backup = %(skip_final_backup)s,
    updated_at = now()
WHERE id = %(id)s AND org_id = %(org)s
"""

# ---- billing (Stripe events) ------------------------------------------------------------------

# Store a verified event by id; a duplicate returns nothing (and is a no-op).
RECORD_STRIPE_EVENT = """
INSERT INTO stripe_events (id, type, customer_id, created, status, outcome)
VALUES (%(id)s, %(type)s, %(customer)s, %(created)s, %(status)s, 'received')
ON CONFLICT (id) DO NOTHING RETURNING id
"""
# The newest decisive (hold or release) event recorded for a customer no organisation was linked to then.
NEWEST_UNMAPPED_STRIPE_EVENT = """
SELECT id, status, created FROM stripe_events
WHERE customer_id = %(customer)s AND outcome = 'unknown_customer' AND status = ANY(%(decisive)s)
ORDER BY created DESC, received_at DESC LIMIT 1
"""
SET_STRIPE_EVENT_OUTCOME = "UPDATE stripe_events SET outcome = %(outcome)s WHERE id = %(id)s"

# The organisation of a Stripe customer, locked while its hold is decided (FOR NO KEY UPDATE: the
# instances and keys being created for it meanwhile need only their foreign-key share lock).
LOCK_ORGANISATION_OF_CUSTOMER = """
SELECT id, billing_event_created FROM organisations WHERE stripe_customer_id = %(customer)s
FOR NO KEY UPDATE
"""
SET_BILLING_HOLD = """
UPDATE organisations SET billing_hold = %(hold)s, billing_status = %(status)s,
    billing_event_created = %(created)s
WHERE id = %(id)s
"""

# An organisation's instances in some states (a hold suspends those that can be suspended).
ORG_INSTANCES_IN = "SELECT id FROM instances WHERE org_id = %(org)s AND state = ANY(%(states)s::text[])"
# Those the billing hold suspended (a release resumes them, and only them).
ORG_INSTANCES_SUSPENDED_BY_BILLING = ORG_INSTANCES_IN + " AND suspended_by_billing"

# ---- instances: look-ups, and as the operations see them (job handlers, abandonment hooks) ----------

INSTANCE_BY_ID = "SELECT * FROM instances WHERE id = %(id)s"
# The ids of the instances in some states (`up` starts their servers again after a restart).
INSTANCE_IDS_IN = "SELECT id FROM instances WHERE state = ANY(%(states)s::text[])"

# One instance with its organisation's billing hold (what a handler decides from).
INSTANCE_WITH_HOLD = """
SELECT i.*, o.billing_hold FROM instances i JOIN organisations o ON o.id = i.org_id WHERE i.id = %(id)s
"""

# One instance, locked (an abandonment hook, in the abandoning transaction), as LOCK_ORG_INSTANCE.
LOCK_INSTANCE = "SELECT * FROM instances WHERE id = %(id)s FOR NO KEY UPDATE"

# The step a handler runs now; matches nothing once the instance has moved (the handler decides again).
SET_PROGRESS = """
UPDATE instances SET progress = %(progress)s, updated_at = now()
WHERE id = %(id)s AND state = %(state)s AND state_version = %(state_version)s
"""

# A degraded instance whose suspend, resume or heal was given up: the reason and its code, and for a
# heal the count and time the reconciler's heal backoff reads (not a state change).
RECORD_DEGRADED_FAILURE = """
UPDATE instances SET failure_reason = %(reason)s, failure_code = %(code)s, progress = NULL,
    updated_at = now(),
    heal_failures = heal_failures + CASE WHEN %(heal)s THEN 1 ELSE 0 END,
    heal_given_up_at = CASE WHEN %(heal)s THEN now() ELSE heal_given_up_at END
WHERE id = %(id)s
"""

# ---- jobs: look-ups and the operator's list -------------------------------------------------------

JOB_BY_ID = "SELECT * FROM jobs WHERE id = %(id)s"
# The current rows of jobs whose moves conflicted (did the holder's own earlier write land?).
JOBS_BY_IDS = "SELECT * FROM jobs WHERE id = ANY(%(ids)s::uuid[])"

# Jobs newest first, optionally of one state, kind and/or instance (SRE views: API and CLI).
LIST_JOBS = """
SELECT id, kind, instance_id, state, state_version, attempt, max_attempts, priority, run_at,
       claimed_by, fence, heartbeat_at, error_kind, last_error, verdict, created_at,
       state_entered_at
FROM jobs
WHERE (%(state)s::text IS NULL OR state = %(state)s)
  AND (%(kind)s::text IS NULL OR kind = %(kind)s)
  AND (%(instance)s::uuid IS NULL OR instance_id = %(instance)s::uuid)
ORDER BY created_at DESC, id
LIMIT %(limit)s
"""

# ---- notifications: the channels the transition path notifies, and who listens -------------------

# `cp_<entity>_<state>` carries '<id>:<state_version>' of each move into that state (see _audit_tail).
INSTANCE_CHANNEL_PREFIX = "cp_instance_"
JOB_QUEUED_CHANNEL = "cp_job_queued"
# A worker wakes on every enqueued or re-queued job.
LISTEN_JOB_QUEUED = f"LISTEN {JOB_QUEUED_CHANNEL}"
# A watch follows every state an instance can reach.
INSTANCE_CHANNELS = tuple(INSTANCE_CHANNEL_PREFIX + state for state in INSTANCE.states)
LISTEN_INSTANCE_CHANNELS = "; ".join(f"LISTEN {channel}" for channel in INSTANCE_CHANNELS)

# ---- organisations and API keys ---------------------------------------------------------------------

CREATE_ORGANISATION = """
INSERT INTO organisations (name, stripe_customer_id) VALUES (%(name)s, %(stripe_customer_id)s) RETURNING *
"""
ORGANISATION_BY_ID = "SELECT * FROM organisations WHERE id = %(id)s"

CREATE_API_KEY = """
INSERT INTO api_keys (org_id, is_admin, prefix, key_hash, name)
VALUES (%(org_id)s, %(is_admin)s, %(prefix)s, %(key_hash)s, %(name)s) RETURNING id
"""
# Serialises the first start's admin key across replicas (a transaction-scoped advisory lock).
LOCK_ADMIN_KEY_CREATION = "SELECT pg_advisory_xact_lock(%(key)s)"
ANY_LIVE_ADMIN_KEY = "SELECT 1 FROM api_keys WHERE is_admin AND revoked_at IS NULL LIMIT 1"
LIVE_KEY_BY_PREFIX = """
SELECT id, org_id, is_admin, key_hash FROM api_keys WHERE prefix = %(prefix)s AND revoked_at IS NULL
"""
# Revoke a live key of an organisation (any organisation's when org is NULL: an admin).
REVOKE_API_KEY = """
UPDATE api_keys SET revoked_at = now()
WHERE id = %(id)s AND revoked_at IS NULL AND (%(org)s::uuid IS NULL OR org_id = %(org)s::uuid)
RETURNING id
"""
# The organisations, oldest first, or the one of a name.
LIST_ORGANISATIONS = """
SELECT id, name, stripe_customer_id, billing_hold, billing_status, created_at FROM organisations
WHERE %(name)s::text IS NULL OR name = %(name)s::text ORDER BY created_at, id LIMIT %(limit)s
"""
# One job's history, oldest first.
JOB_EVENTS = "SELECT * FROM job_events WHERE job_id = %(id)s ORDER BY id LIMIT %(limit)s"
# A page of an organisation's keys (revoked ones too), oldest first, after a (created_at, id) cursor.
LIST_API_KEYS = """
SELECT id, prefix, name, created_at, revoked_at FROM api_keys
WHERE org_id = %(org)s
  AND (%(after_created)s::timestamptz IS NULL
       OR (created_at, id) > (%(after_created)s::timestamptz, %(after_id)s::uuid))
ORDER BY created_at, id LIMIT %(limit)s
"""
# The organisation, locked while a key is added (two creations count its live keys one at a time).
LOCK_ORGANISATION = "SELECT id FROM organisations WHERE id = %(id)s FOR NO KEY UPDATE"
COUNT_LIVE_KEYS = "SELECT count(*) AS n FROM api_keys WHERE org_id = %(org)s AND revoked_at IS NULL"

# ---- console sessions (an organisation key signed in to the console) -----------------------------

START_CONSOLE_SESSION = """
INSERT INTO console_sessions (key_id, org_id, expires_at)
VALUES (%(key_id)s, %(org_id)s, now() + make_interval(secs => %(ttl_s)s))
RETURNING id, key_id, org_id, expires_at
"""
# A session that is live at `now` (default the database's time): not ended, not expired, its key live.
LIVE_CONSOLE_SESSION = """
SELECT s.id, s.key_id, s.org_id, s.expires_at
FROM console_sessions s JOIN api_keys k ON k.id = s.key_id
WHERE s.id = %(id)s AND s.ended_at IS NULL AND k.revoked_at IS NULL
  AND s.expires_at > COALESCE(%(now)s::timestamptz, now())
"""
END_CONSOLE_SESSION = "UPDATE console_sessions SET ended_at = now() WHERE id = %(id)s AND ended_at IS NULL"
# Sessions expired a day ago (ended ones too, once expired): nothing reads them any more.
PURGE_CONSOLE_SESSIONS = "DELETE FROM console_sessions WHERE expires_at < now() - interval '1 day'"

# ---- idempotency keys (the API's creating requests) ----------------------------------------------

# Claim an (organisation, key) pair for this transaction; false while another request holds it.
TRY_IDEMPOTENCY_LOCK = "SELECT pg_try_advisory_xact_lock(hashtextextended(%(lock)s, 0)) AS locked"
# The response stored for a key within its retention.
STORED_RESPONSE = """
SELECT request_hash, status_code, response, headers FROM idempotency_keys
WHERE org_id = %(org)s AND key = %(key)s AND created_at >= now() - make_interval(secs => %(retention_s)s)
"""
SAVE_RESPONSE = """
INSERT INTO idempotency_keys (org_id, key, request_hash, status_code, response, headers)
VALUES (%(org)s, %(key)s, %(hash)s, %(status)s, %(response)s, %(headers)s)
ON CONFLICT (org_id, key) DO UPDATE SET request_hash = EXCLUDED.request_hash,
    status_code = EXCLUDED.status_code, response = EXCLUDED.response,
    headers = EXCLUDED.headers, created_at = now()
"""
# Delete a bounded batch of expired keys (skipping rows another purge holds).
PURGE_IDEMPOTENCY_KEYS = """
DELETE FROM idempotency_keys WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idempotency_keys WHERE created_at < now() - make_interval(secs => %(retention_s)s)
    LIMIT %(limit)s FOR UPDATE SKIP LOCKED))
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

# ---- the schema's revision (readiness) and the reconciler's leader lock ----------------------------

SCHEMA_REVISION = "SELECT version_num FROM alembic_version"
# Whether this session can write (a standby, or default_transaction_read_only, says off).
SESSION_WRITABLE = "SELECT current_setting('transaction_read_only') = 'off' AS writable"

PING = "SELECT 1"
TRY_LEADER_LOCK = "SELECT pg_try_advisory_lock(%(key)s) AS locked"
RELEASE_LEADER_LOCK = "SELECT pg_advisory_unlock(%(key)s)"

# Reconciler shards: an instance's shard is a hash of its id; each shard is a session advisory lock
# (class, shard) held by one reconciler process, and each process holds a membership lock
# (class, its backend pid) so that the others can count the processes sharing the shards.
JOIN_SHARDS = "SELECT pg_advisory_lock(%(members)s, pg_backend_pid()), pg_backend_pid() AS pid"
SHARD_MEMBERS = """
SELECT count(*) AS members FROM pg_locks
WHERE locktype = 'advisory' AND classid = %(members)s::oid AND objsubid = 2 AND granted
"""
TRY_SHARD = "SELECT pg_try_advisory_lock(%(shards)s, %(shard)s) AS locked"
RELEASE_SHARD = "SELECT pg_advisory_unlock(%(shards)s, %(shard)s)"
# Inside the transaction that acts on an instance: its shard's lock is still held by `pid`.
HOLDS_SHARD_OF = f"""
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND classid = %(shards)s::oid AND objsubid = 2 AND granted
      AND pid = %(pid)s AND objid = {SHARD_OF.format(id="%(id)s")}::oid
) AS held
"""

# ---- backups: what the control plane holds of each instance -----------------------------------------

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

# ---- job steps: the named steps of the instance jobs, and the progress they show ---------------------

# Notified with '<instance id>:<step row id>' for every step record (the watch stream's step events).
STEP_CHANNEL = "cp_step"
LISTEN_STEP_CHANNEL = f"LISTEN {STEP_CHANNEL}"

# The job as its holder runs it: running, at the holder's fence (a step record of anyone else's is refused).
_HELD_JOB = """
held AS (
    SELECT id, kind, attempt, fence FROM jobs
    WHERE id = %(job_id)s AND fence = %(fence)s AND state = 'running'
)"""

_NOTIFY_STEP = f"""
notified AS (
    SELECT pg_notify('{STEP_CHANNEL}', instance_id::text || ':' || id::text) FROM recorded
)"""

# A step starts: shown on the instance (guarded like SET_PROGRESS: nothing if the instance moved)
# and recorded, if the job is still held at this fence; one round trip.
RECORD_STEP_STARTED = f"""
WITH {_HELD_JOB}, shown AS (
    UPDATE instances SET progress = %(step)s, updated_at = now()
    WHERE id = %(instance_id)s AND state = %(state)s AND state_version = %(state_version)s
      AND EXISTS (SELECT 1 FROM held)
    RETURNING id
), recorded AS (
    INSERT INTO job_steps (job_id, instance_id, kind, step, event, attempt, fence, worker)
    SELECT held.id, %(instance_id)s, held.kind, %(step)s, 'started', held.attempt, held.fence, %(worker)s
    FROM held WHERE EXISTS (SELECT 1 FROM shown)
    RETURNING id, instance_id
), {_NOTIFY_STEP}
SELECT (SELECT count(*) FROM held) AS held, (SELECT count(*) FROM shown) AS shown,
       (SELECT count(*) FROM notified) AS _n
"""

# A step ends (`event` finished or failed), with when that attempt of it started; only while held.
RECORD_STEP_ENDED = f"""
WITH {_HELD_JOB}, recorded AS (
    INSERT INTO job_steps
        (job_id, instance_id, kind, step, event, attempt, fence, worker, started_at, code, error)
    SELECT held.id, %(instance_id)s, held.kind, %(step)s, %(event)s, held.attempt, held.fence, %(worker)s,
           (SELECT s.at FROM job_steps s
            WHERE s.job_id = held.id AND s.step = %(step)s AND s.attempt = held.attempt
              AND s.event = 'started'
            ORDER BY s.id DESC LIMIT 1),
           %(code)s, %(error)s
    FROM held
    RETURNING id, instance_id
), {_NOTIFY_STEP}
SELECT (SELECT count(*) FROM held) AS held, (SELECT count(*) FROM notified) AS _n
"""

# The step records of instances since each entered its current state (the progress of that stay).
STEPS_SINCE = """
SELECT s.* FROM job_steps s
JOIN unnest(%(ids)s::uuid[], %(since)s::timestamptz[]) AS w(id, since)
  ON s.instance_id = w.id AND s.at >= w.since
ORDER BY s.id
"""

# The live jobs of some kinds of these instances (the job driving a state before its first step).
LIVE_JOBS_OF = f"""
SELECT id, kind, instance_id, state, attempt FROM jobs
WHERE instance_id = ANY(%(ids)s::uuid[]) AND kind = ANY(%(kinds)s::text[]) AND state NOT IN {FINISHED}
"""

# How long each (operation, step) usually takes: a high percentile of its latest finished runs
# (ix_job_steps_finished serves each sample).
STEP_DURATIONS = """
SELECT st.kind, st.step, count(h.seconds) AS samples,
       percentile_cont(%(percentile)s) WITHIN GROUP (ORDER BY h.seconds) AS expected_s
FROM unnest(%(kinds)s::text[], %(steps)s::text[]) AS st(kind, step)
CROSS JOIN LATERAL (
    SELECT extract(epoch FROM s.at - s.started_at)::float8 AS seconds FROM job_steps s
    WHERE s.kind = st.kind AND s.step = st.step AND s.event = 'finished' AND s.started_at IS NOT NULL
    ORDER BY s.id DESC LIMIT %(sample)s
) h
GROUP BY st.kind, st.step
"""

# One step record (the watch stream reads the one a notification names).
STEP_BY_ID = "SELECT * FROM job_steps WHERE id = %(id)s AND instance_id = %(instance_id)s"

# Every step record of an instance, oldest first (the SRE view), after a cursor.
INSTANCE_STEPS = """
SELECT * FROM job_steps WHERE instance_id = %(instance_id)s AND id > %(after)s ORDER BY id LIMIT %(limit)s
"""

# The last step record of a job, and its last error event's code and attempt (what an abandonment
# hook names the failure after).
LAST_STEP_OF_JOB = (
    "SELECT step, event, attempt FROM job_steps WHERE job_id = %(job_id)s ORDER BY id DESC LIMIT 1"
)
LAST_ERROR_OF_JOB = """
SELECT detail->>'code' AS code, (detail->>'attempt')::int AS attempt FROM job_events
WHERE job_id = %(job_id)s AND event = 'error' ORDER BY id DESC LIMIT 1
"""

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

# ---- least privilege: what `migrate` grants the runtime role (db.grant_runtime) -------------------

# Whether the role can be trusted with the runtime's rights: not a superuser, not the owner.
ROLE_ATTRIBUTES = """
SELECT r.rolsuper, pg_has_role(r.oid, current_user, 'MEMBER') AS member, r.rolname = current_user AS same
FROM pg_roles r WHERE r.rolname = %(role)s
"""
PUBLIC_TABLES = """
SELECT c.relname, c.relispartition FROM pg_class c
WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p') ORDER BY c.relname
"""
GRANT_SCHEMA_USAGE = "GRANT USAGE ON SCHEMA public TO {role}"
REVOKE_TABLE = "REVOKE ALL ON {table} FROM {role}"
GRANT_TABLE = "GRANT {privileges} ON {table} TO {role}"
APPEND_ONLY_PRIVILEGES = "SELECT, INSERT"
READ_ONLY_PRIVILEGES = "SELECT"
READ_WRITE_PRIVILEGES = "SELECT, INSERT, UPDATE, DELETE"
GRANT_SEQUENCES = "GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}"
REVOKE_FUNCTION_FROM_PUBLIC = "REVOKE EXECUTE ON FUNCTION {function} FROM PUBLIC"
GRANT_FUNCTION = "GRANT EXECUTE ON FUNCTION {function} TO {role}"

# ---- consumers of the instance event log ------------------------------------------------------------

# A consumer's lock (one runner at a time per consumer, across replicas), held for one pass.
TRY_CONSUMER_LOCK = "SELECT pg_try_advisory_lock(hashtextextended('cp_consumer:' || %(name)s, 0)) AS locked"
RELEASE_CONSUMER_LOCK = "SELECT pg_advisory_unlock(hashtextextended('cp_consumer:' || %(name)s, 0))"
ENSURE_CONSUMER = "INSERT INTO event_consumers (name) VALUES (%(name)s) ON CONFLICT (name) DO NOTHING"
CONSUMER_POSITION = (
    "SELECT name, last_xid::text::bigint AS last_xid, last_id FROM event_consumers WHERE name = %(name)s"
)
# The next events after a position, in (xid, id) order, only from transactions older than the
# oldest one still running: every such transaction has ended, so no event can still appear below
# the new position. (Reading by `id > last` would skip an event whose transaction took its id
# first and committed last.) Served by ix_instance_events_xid_id.
CONSUMER_EVENTS = """
SELECT e.id, e.xid::text::bigint AS xid, e.instance_id, i.org_id, e.from_state, e.to_state, e.event,
       e.actor_kind, e.actor_id, e.reason, e.detail, e.at, e.seq, e.state_version
FROM instance_events e JOIN instances i ON i.id = e.instance_id
WHERE (e.xid, e.id) > (%(last_xid)s::text::xid8, %(last_id)s)
  AND e.xid < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY e.xid, e.id
LIMIT %(limit)s
"""
ADVANCE_CONSUMER = """
UPDATE event_consumers
SET last_xid = %(last_xid)s::text::xid8, last_id = %(last_id)s, processed = processed + %(count)s,
    last_event_at = %(last_event_at)s, updated_at = now()
WHERE name = %(name)s
"""
# How far behind a consumer is: events after its position (visible now, whether or not they are
# below the horizon yet) and the age of the oldest.
CONSUMER_LAG = """
SELECT count(*) AS events, extract(epoch FROM now() - min(e.at))::float8 AS seconds
FROM instance_events e, event_consumers c
WHERE c.name = %(name)s AND (e.xid, e.id) > (c.last_xid, c.last_id)
"""
CONSUMERS = """
SELECT name, last_xid::text AS last_xid, last_id, processed, last_event_at, updated_at
FROM event_consumers ORDER BY name
"""

# ---- usage: the instance events that a window's usage is computed from ------------------------------

_USAGE_EVENTS = f"""
SELECT e.instance_id, i.org_id, e.seq, e.to_state, e.at, e.detail
FROM instances i JOIN instance_events e ON e.instance_id = i.id
{{join}}
WHERE i.created_at < %(end)s AND e.at < %(end)s
  AND NOT (i.state IN {state_list(tuple(sorted(INSTANCE.terminal)))} AND i.state_entered_at <= %(start)s)
  {{where}}
ORDER BY e.instance_id, e.seq
"""
# One organisation's instances that lived in [start, end), with their events up to the end.
USAGE_EVENTS_OF_ORG = _USAGE_EVENTS.format(join="", where="AND i.org_id = %(org)s")
# The same for every organisation with a Stripe customer (what a report sends).
USAGE_EVENTS_BILLED = _USAGE_EVENTS.format(
    join="JOIN organisations o ON o.id = i.org_id AND o.stripe_customer_id IS NOT NULL", where=""
)
STRIPE_CUSTOMERS = "SELECT id, stripe_customer_id FROM organisations WHERE stripe_customer_id IS NOT NULL"
LAST_USAGE_REPORT = "SELECT max(period_start) AS period_start FROM usage_reports"
# A period's report, enqueued once (a second reconciler pass finds it and does nothing).
RECORD_USAGE_REPORT = """
INSERT INTO usage_reports (period_start, period_end) VALUES (%(start)s, %(end)s)
ON CONFLICT (period_start) DO NOTHING RETURNING period_start
"""
SET_USAGE_REPORT_JOB = "UPDATE usage_reports SET job_id = %(job)s WHERE period_start = %(start)s"
FINISH_USAGE_REPORT = """
UPDATE usage_reports SET reported_at = now(), meter_events = %(count)s WHERE period_start = %(start)s
"""
METER_EVENTS_SENT_IN = "SELECT identifier FROM meter_events_sent WHERE period_start = %(start)s"
RECORD_METER_EVENT = """
INSERT INTO meter_events_sent
    (identifier, period_start, org_id, instance_id, plan, billing, event_name, value)
VALUES (%(identifier)s, %(start)s, %(org)s, %(instance)s, %(plan)s, %(billing)s, %(event_name)s, %(value)s)
ON CONFLICT (identifier) DO NOTHING
"""
METER_EVENTS_SENT = """
SELECT identifier, period_start, org_id, instance_id, plan, billing, event_name, value
FROM meter_events_sent ORDER BY period_start, identifier
"""
USAGE_REPORTS = "SELECT * FROM usage_reports ORDER BY period_start"

# ---- notifications: targets (webhook endpoints, email addresses) and deliveries --------------------

_TARGET_COLUMNS = (
    "id, org_id, kind, address, event_types, description, created_at, disabled_at, disabled_reason"
)
CREATE_NOTIFICATION_TARGET = f"""
INSERT INTO notification_targets (org_id, kind, address, event_types, description, secret)
VALUES (%(org)s, %(kind)s, %(address)s, %(event_types)s, %(description)s, %(secret)s)
RETURNING {_TARGET_COLUMNS}
"""
# One page of an organisation's live targets of a kind, oldest first, after a cursor.
NOTIFICATION_TARGETS_PAGE = f"""
SELECT {_TARGET_COLUMNS} FROM notification_targets
WHERE org_id = %(org)s AND kind = %(kind)s AND deleted_at IS NULL
  AND (%(after_created)s::timestamptz IS NULL OR (created_at, id) > (%(after_created)s, %(after_id)s))
ORDER BY created_at, id
LIMIT %(limit)s
"""
NOTIFICATION_TARGET = f"""
SELECT {_TARGET_COLUMNS} FROM notification_targets
WHERE id = %(id)s AND org_id = %(org)s AND kind = %(kind)s AND deleted_at IS NULL
"""
DELETE_NOTIFICATION_TARGET = """
UPDATE notification_targets SET deleted_at = now()
WHERE id = %(id)s AND org_id = %(org)s AND kind = %(kind)s AND deleted_at IS NULL
RETURNING id
"""
# The targets an event goes to: the organisation's, live, enabled, subscribed to its type.
TARGETS_FOR_EVENT = """
SELECT id, kind FROM notification_targets
WHERE org_id = %(org)s AND deleted_at IS NULL AND disabled_at IS NULL
  AND (%(type)s = ANY(event_types) OR '*' = ANY(event_types))
ORDER BY created_at, id
"""
# One delivery per target and event: a replayed event finds it and creates nothing.
CREATE_DELIVERY = """
INSERT INTO notification_deliveries (target_id, org_id, instance_id, event_id, event_type, body)
VALUES (%(target)s, %(org)s, %(instance)s, %(event_id)s, %(type)s, %(body)s)
ON CONFLICT (target_id, event_id) DO NOTHING
RETURNING id
"""
DELIVERY_TO_SEND = """
SELECT d.*, t.kind, t.address, t.secret, t.disabled_at, t.deleted_at
FROM notification_deliveries d JOIN notification_targets t ON t.id = d.target_id
WHERE d.id = %(id)s
"""
DELIVERY_ATTEMPTED = """
UPDATE notification_deliveries
SET attempts = attempts + 1, last_attempt_at = now(), last_status = %(status)s, last_error = %(error)s,
    state = %(state)s, delivered_at = CASE WHEN %(state)s = 'delivered' THEN now() END
WHERE id = %(id)s
RETURNING attempts, extract(epoch FROM now() - created_at)::float8 AS age_s
"""
DISABLE_TARGET = """
UPDATE notification_targets SET disabled_at = now(), disabled_reason = %(reason)s
WHERE id = %(id)s AND disabled_at IS NULL
"""
DELIVERIES_PAGE = """
SELECT id, event_id, event_type, instance_id, state, attempts, last_status, last_error, created_at,
       last_attempt_at, delivered_at
FROM notification_deliveries
WHERE target_id = %(target)s AND org_id = %(org)s
  AND (%(after_created)s::timestamptz IS NULL OR (created_at, id) < (%(after_created)s, %(after_id)s))
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s
"""
INSTANCE_FOR_NOTICE = """
SELECT id, name, state, spec->>'plan' AS plan, failure_code FROM instances WHERE id = %(id)s
"""
GIVE_UP_DELIVERY = "UPDATE notification_deliveries SET state = 'failed' WHERE id = %(id)s"

# ---- billing policy: the grace period after past_due, deletion after a long suspension -------------

MARK_PAST_DUE = """
UPDATE organisations o SET past_due_since = COALESCE(o.past_due_since, to_timestamp(%(created)s)),
    billing_status = %(status)s
FROM organisations before
WHERE o.id = %(id)s AND before.id = o.id
RETURNING o.past_due_since, before.past_due_since IS NULL AS started
"""
CLEAR_PAST_DUE = "UPDATE organisations SET past_due_since = NULL WHERE id = %(id)s"
# Organisations past due for longer than the grace period and not on hold yet.
GRACE_OVER = """
SELECT id FROM organisations
WHERE past_due_since IS NOT NULL AND NOT billing_hold
  AND past_due_since + make_interval(secs => %(grace_s)s::float8) <= %(now)s
ORDER BY past_due_since
FOR UPDATE SKIP LOCKED
"""
HOLD_AFTER_GRACE = "UPDATE organisations SET billing_hold = true WHERE id = %(id)s"
# Instances suspended by billing for longer than the deletion delay, not being deleted yet.
LONG_SUSPENDED = """
SELECT id, org_id, state_entered_at FROM instances
WHERE state = 'suspended' AND suspended_by_billing AND deletion_requested_at IS NULL
  AND NOT deletion_protection
  AND state_entered_at + make_interval(secs => %(after_s)s::float8) <= %(now)s
ORDER BY state_entered_at
LIMIT 100
"""
ORGANISATION_BILLING = """
SELECT id, billing_hold, billing_status, past_due_since FROM organisations WHERE id = %(id)s
"""
