"""Statements on `instances`: creation, reconciler scans and writes, the customer's views, changes, look-ups.

The transitions of instances are in `transitions.py`; a step's start shows it on its instance in
`steps.py` (one statement with its record).
"""

from controlplane.core.lifecycle import INSTANCE, JOB
from controlplane.db.sql.template import (
    EVENT_FIELDS,
    FINISHED,
    LIVE_INSTANCE,
    SHARD_OF,
    _enqueue_ctes,
    _live_states,
    event_hash,
)

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
        "\n       (SELECT kind FROM job_created) AS _job_kind, (SELECT id FROM job_created) AS _job_id"
    )
)

# ---- the reconciler ---------------------------------------------------------------------------------

# Reconciler: a batch of live instances (of the given shards, or all), least recently reconciled
# first, with the kinds of their live jobs and their organisation's hold. Served by the partial
# index ix_instances_live_state (and ux_jobs_live_instance_kind for the jobs), so its cost follows
# live work, not table size.
SCAN_LIVE_INSTANCES = f"""
SELECT i.id, i.state, i.state_version, i.spec, i.spec_generation, i.observed_generation,
       i.failed_generation, i.deadline_at, i.deadline_retries, i.heal_failures, i.heal_given_up_at,
       i.deletion_requested_at IS NOT NULL AS deletion_requested,
       i.suspended_by_billing, o.billing_hold, i.failure_code, i.created_at, i.org_id,
       i.storage_grown_at, i.storage_full_warned_at, i.primary_seen,
       ARRAY(SELECT j.kind FROM jobs j
             WHERE j.instance_id = i.id AND j.state NOT IN {FINISHED}) AS live_jobs,
       (SELECT max(b.taken_at) FROM backups b
        WHERE b.instance_id = i.id AND b.removed_at IS NULL) AS newest_backup_at,
       CASE WHEN i.failure_code = 'data_lost' THEN
         COALESCE((SELECT j.state = 'abandoned' FROM jobs j WHERE j.instance_id = i.id AND j.kind = 'restore'
                   ORDER BY j.created_at DESC LIMIT 1), false)
       ELSE false END AS restore_given_up,
       EXISTS (SELECT 1 FROM recovery_windows w
               WHERE w.instance_id = i.id AND w.earliest_at IS NOT NULL) AS window_held,
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

# Reconciler (storage autoscaling): a larger allocation as a new spec generation (of a ready instance,
# or of one held read-only for outgrowing its allocation), and when it was
# grown (the cooldown), guarded by version; the update job then applies it.
SET_STORAGE_GROWN = """
UPDATE instances
SET spec = spec || jsonb_build_object('storage_gb', %(storage_gb)s::int),
    spec_generation = spec_generation + 1, storage_grown_at = COALESCE(%(now)s::timestamptz, now()),
    storage_full_warned_at = NULL, updated_at = now()
WHERE id = %(id)s AND state_version = %(state_version)s
  AND (state = 'ready' OR (state = 'suspended' AND failure_code = 'storage_full'))
RETURNING spec_generation
"""

# Reconciler (storage autoscaling): the customer was told the database is nearly full at its
# plan's maximum (once per cooldown).
WARN_STORAGE_FULL = """
UPDATE instances SET storage_full_warned_at = COALESCE(%(now)s::timestamptz, now()), updated_at = now()
WHERE id = %(id)s AND state_version = %(state_version)s
"""

# Reconciler: the primary it saw (where the infrastructure fails over by itself), guarded by version.
SET_PRIMARY_SEEN = """
UPDATE instances SET primary_seen = %(primary)s
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
# The queue by kind: how many wait, and how long the oldest due one has waited past its run_at
# (served by ix_jobs_queued_order, partial on the queued jobs).
QUEUED_BY_KIND = """
SELECT kind, count(*) AS depth,
       coalesce(extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at <= now())), 0)::float8
         AS oldest_s
FROM jobs WHERE state = 'queued' GROUP BY kind
"""

# Orphan sweep: what the database knows of the instances the provisioner's inventory names.
INSTANCES_BY_ID = f"""
SELECT i.id, i.state, i.spec, i.spec_generation,
       EXISTS (SELECT 1 FROM jobs j WHERE j.instance_id = i.id
               AND j.state NOT IN {FINISHED}) AS has_live_job
FROM instances i WHERE i.id = ANY(%(ids)s::uuid[])
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

# The live instances of any organisation with a name (an SRE names one by it).
LIVE_INSTANCES_NAMED_ANYWHERE = """
SELECT i.id FROM instances i
WHERE i.name = %(name)s AND i.state NOT IN ('deleted', 'failed')
ORDER BY i.created_at, i.id LIMIT 10
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

# The newest audit event of an organisation's instance (a deleted one's: its deletion, with the
# final backup it kept).
ORG_INSTANCE_LAST_EVENT = """
SELECT e.* FROM instance_events e JOIN instances i ON i.id = e.instance_id
WHERE e.instance_id = %(id)s AND i.org_id = %(org)s ORDER BY e.id DESC LIMIT 1
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
