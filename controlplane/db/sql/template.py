"""The statement generator: the one transition template, and the fragments the statement modules share.

The transition statements are built from one template so that instances and jobs share one path:
guarded UPDATE (id + state_version + state), version bump, event row, pg_notify, in one statement.
Here too: the state lists, the entity tables (with the columns each transition sets), the event
hash, the event rows and notifications of a move, the enqueue of jobs with their creation events
(the queue's enqueue and an instance's first job), and the binding of placeholders. The statements
themselves are in the other modules of this package, one table family a module.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.core.lifecycle import INSTANCE, JOB_HELD, JOB_TERMINAL


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
        # A state change forgives any change of primary before it (a job's, or one it records).
        "primary_seen = NULL",
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


# ---- placeholders bound to SQL expressions --------------------------------------------------------


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


# ---- the enqueue of jobs with their events (the queue's, an instance's first job) -----------------

# The creation event's fields of a job (from the input row, or the created one: the same names).
_ENQUEUE_FIELDS = (
    "NULL, 'queued', 'enqueue', %(actor_kind)s, %(actor_id)s, NULL, jsonb_build_object('kind', kind),"
    " %(request_id)s, 0"
)


def _enqueue_ctes(job_input: str, prefix: str = "") -> str:
    """Enqueue jobs with their creation events (CTEs `input`, `created`, `audit`, `notified`, each
    name prefixed); a second live job of the same (instance, kind) is not created: the partial
    unique index turns it into a no-op."""
    return f"""{prefix}input AS ({job_input}), {prefix}created AS (
    INSERT INTO jobs (id, kind, instance_id, payload, state, priority, max_attempts, run_at,
                      state_entered_at, chain_seq, chain_head)
    SELECT id, kind, instance_id, payload, 'queued', priority, max_attempts,
           clock_timestamp() + make_interval(secs => delay_s), at, 0,
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
