"""Statements on `job_steps`: the named steps of the instance jobs, and the progress they show."""

from controlplane.db.sql.template import FINISHED

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
