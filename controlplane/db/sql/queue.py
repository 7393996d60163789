"""Statements on `jobs` (the queue): claim, heartbeat, enqueue, the supervisor's scans, fences, look-ups.

The claim, the heartbeat and the fence sequence are here; the transitions of jobs are in
`transitions.py` and the enqueue's CTEs (also an instance's first job) in `template.py`.
"""

from __future__ import annotations

from controlplane.db.sql.template import (
    _RETURN_MOVED,
    FINISHED,
    HELD,
    JOB_TABLE,
    _audit_ctes,
    _bind,
    _chain_sets,
    _enqueue_ctes,
    _substitute,
    _transition_ctes,
)

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
#
# Each range ends where its index scan stops reading. PostgreSQL's btree stops a scan at a row
# comparison's bound only when the bound is decided by its first column, and a row comparison it
# checks first hides the bounds on the later columns: `(priority, attempt = 0, run_at) < (p, true,
# ...)` read every entry of priority p to the end of that priority, the whole backlog behind the
# point and, under a pinned xmin horizon, the dead entry of every job claimed since. So what sorts
# before the point is two ranges bounded by plain comparisons of the index's columns: a more
# urgent priority (CLAIM_BEFORE_URGENT), and begun work of the point's priority (CLAIM_BEFORE),
# which ends at its first fresh entry, or at the point's run_at when the point is in begun work.
_CLAIM_KEY = "(priority, attempt = 0, run_at)"
CLAIM_FROM = (
    f"{_CLAIM_KEY} >= (%(from_priority)s::int, %(from_fresh)s::boolean, %(from_run_at)s::timestamptz)"
)
CLAIM_BEFORE_URGENT = "priority < %(from_priority)s::int"
CLAIM_BEFORE = (
    "priority = %(from_priority)s::int AND (attempt = 0) < true AND run_at < CASE"
    " WHEN %(from_fresh)s::boolean THEN 'infinity'::timestamptz ELSE %(from_run_at)s::timestamptz END"
)
CLAIM_FROM_START = {"from_priority": -(2**31), "from_fresh": False, "from_run_at": "-infinity"}
# Whether due fresh work sorts before a worker's point (of its priority, before its run_at): what
# a claim from the point leaves out. A worker looks on its heartbeat's connection, off the claim
# path, and claims from the start of the order only when the look finds some. The look starts at
# `look_from` (LOOK_FROM at its previous look; '-infinity' for a look at the whole range): under a
# pinned xmin horizon a look walks the dead entries of every job claimed in its range, and a look
# from the start of the order those of every job claimed since the snapshot. One index range of
# ix_jobs_queued_order (its bounds plain comparisons of the index's columns, so that the scan stops
# at the point: see CLAIM_BEFORE), stopped at the first row (a row or none: EXISTS would drop the
# ORDER BY that makes the planner read that index in order).
FRESH_BEFORE_POINT = f"""
SELECT true AS found FROM jobs
WHERE state = 'queued' AND run_at <= now() AND kind = ANY(%(kinds)s::text[])
  AND priority = %(from_priority)s::int AND attempt = 0 AND %(from_fresh)s::boolean
  AND run_at >= %(look_from)s::timestamptz AND run_at < %(from_run_at)s::timestamptz
ORDER BY {CLAIM_ORDER}
LIMIT 1
"""
# Where the next look may start: no fresh job that the database shows no look yet sorts before it.
# An enqueue sets run_at by the clock of its insert (clock_timestamp(), plus its delay); one that
# commits after this statement either had written when it ran (its transaction holds an xid, and
# its run_at is not before its transaction's start) or inserts later (its run_at is later than
# this statement's start). A read-only transaction, however old (a report, a backup's snapshot),
# does not hold the bound back. The worker takes this before its look's own snapshot, and subtracts
# a margin for the moment between an insert's clock and its xid. Only sessions whose backend_xid
# this role may see count (its own and, with pg_read_all_stats, every role's): an enqueue of a
# role it may not see is found by the look at the whole range, made every so often.
_LOOK_FROM_SELECT = "SELECT least(now(), min(xact_start))"
_LOOK_FROM_WHERE = "FROM pg_stat_activity WHERE backend_xid IS NOT NULL AND datname = current_database()"
LOOK_FROM = f"{_LOOK_FROM_SELECT} AS look_from {_LOOK_FROM_WHERE}"


def _claim_range(condition: str) -> str:
    """Due queued jobs in one range of the claim's order, locked (SKIP LOCKED), as the index
    reads them; the claim takes the first `limit` of all three ranges."""
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
    {_claim_range(CLAIM_BEFORE_URGENT)}
    UNION ALL
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

# The body of cp_claim_and_start (migration 0020 holds this text; tests/integration/test_schema.py
# checks that the installed function still matches it, so a change here needs a migration).
# Three statements in one call, one round trip: the database's bound (LOOK_FROM, taken before the
# claim's snapshot: no job this claim cannot see sorts before it, less the moment between an
# insert's clock and its xid), the claim (CLAIM_JOBS: SKIP LOCKED, a new fence, its event rows),
# then the start of what it claimed through the one transition template (guarded on id, version
# and state, its own event rows); the state trigger checks each. Returns the jobs as started, with
# how long each had been queued and the bound (where the worker's next claim may start).
CLAIM_AND_START_BODY = f"""
DECLARE
    v_look_from timestamptz;
    v_ids uuid[];
    v_versions bigint[];
    v_ctids tid[];
    v_states text[];
    v_queued float8[];
    v_audited bigint;
    v_notified bigint;
BEGIN
{_LOOK_FROM_SELECT} INTO v_look_from {_LOOK_FROM_WHERE};
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
    SELECT q.queued_s, j, v_look_from FROM unnest(v_ids, v_queued) AS q(id, queued_s)
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
SELECT (c.job).*, c.queued_s AS _queued_s, c.look_from AS _look_from
FROM cp_claim_and_start(
    %(kinds)s::text[], %(limit)s::int, %(worker)s::text,
    %(from_priority)s::int, %(from_fresh)s::boolean, %(from_run_at)s::timestamptz
) AS c
"""

# A fence for work done outside a job (the orphan sweep): higher than every claim so far.
NEXT_FENCE = "SELECT nextval('job_fence_seq') AS fence"

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

# One job's history, oldest first.
JOB_EVENTS = "SELECT * FROM job_events WHERE job_id = %(id)s ORDER BY id LIMIT %(limit)s"
