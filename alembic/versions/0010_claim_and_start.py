"""claim and start in one call; reclaimed and retried jobs claimed first

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

`cp_claim_and_start(kinds, limit, worker, from...)` claims due queued jobs with SKIP LOCKED
(from a point of the claim's order on) and starts them, two statements in one call: the worker's
path to its handlers is one round trip per batch.
Each move is the transition path's (guarded UPDATE, version bump, state trigger, an event row
each with its chain hash); the body is the text of `controlplane.db.sql.CLAIM_AND_START_BODY` at this
revision, and the schema tests check the installed function against it.

`ix_jobs_queued_order` becomes `(priority, (attempt = 0), run_at)`: the claim takes work already
begun (a reclaimed or retried job) before fresh work of the same priority.
"""

# ruff: noqa: E501 (the function body is SQL text, as controlplane/db/sql.py builds it)

from __future__ import annotations

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None

SIGNATURE = (
    "cp_claim_and_start(p_kinds text[], p_limit integer, p_worker text,"
    " p_from_priority integer, p_from_fresh boolean, p_from_run_at timestamptz)"
)

BODY = """
DECLARE
    v_ids uuid[];
    v_versions bigint[];
    v_queued float8[];
    v_rows bigint;
    v_audited bigint;
    v_notified bigint;
BEGIN

WITH locked AS (
    SELECT id, state_version, state_entered_at, created_at, chain_seq, chain_head FROM jobs
    WHERE state = 'queued' AND run_at <= now() AND kind = ANY(p_kinds::text[])
      AND (priority, attempt = 0, run_at) >= (p_from_priority::int, p_from_fresh::boolean, p_from_run_at::timestamptz)
    ORDER BY priority, attempt = 0, run_at
    LIMIT p_limit
    FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT locked.*, nextval('job_fence_seq') AS fence FROM locked
), moved AS (
    UPDATE jobs AS t
    SET state = 'claimed',
        state_version = t.state_version + 1,
        updated_at = now(),
        claimed_by = p_worker,
        claimed_at = now(),
        heartbeat_at = now(),
        attempt = t.attempt + 1,
        fence = picked.fence,
        state_entered_at = GREATEST(now(), t.state_entered_at),
        chain_seq = COALESCE(t.chain_seq, -1) + 1,
        chain_head = cp_event_hash('job', t.id, COALESCE(t.chain_seq, -1) + 1, t.chain_head, 'queued', 'claimed', 'claim', 'worker'::text, p_worker, NULL, jsonb_build_object('worker', p_worker::text, 'fence', picked.fence), NULL::text, t.state_version + 1, GREATEST(now(), t.state_entered_at))
    FROM picked
    WHERE t.id = picked.id AND t.state_version = picked.state_version AND t.state = 'queued'
      AND t.chain_seq IS NOT DISTINCT FROM picked.chain_seq
    RETURNING t.*, 'queued'::text AS _from_state, 'claim'::text AS _event, NULL::text AS _reason,
              jsonb_build_object('worker', p_worker::text, 'fence', t.fence) AS _detail,
              picked.chain_head AS _prev_hash,
              extract(epoch FROM now() - picked.state_entered_at)::float8 AS _dwell_s,
              extract(epoch FROM now() - picked.created_at)::float8 AS _age_s
)
, audit AS (
    INSERT INTO job_events
        (job_id, from_state, to_state, event, actor_kind, actor_id, reason, detail, request_id, state_version, at, seq, prev_hash, hash)
    SELECT id, _from_state, state, _event, 'worker'::text, p_worker, _reason,
           COALESCE(_detail, '{}'::jsonb), NULL::text, state_version, state_entered_at,
           chain_seq, _prev_hash, chain_head
    FROM moved
    RETURNING 1
), notified AS (
    SELECT pg_notify('cp_job_' || state, id::text || ':' || state_version) FROM moved
)
SELECT array_agg(moved.id), array_agg(moved.state_version), array_agg(moved._dwell_s),
       (SELECT count(*) FROM audit), (SELECT count(*) FROM notified)
INTO v_ids, v_versions, v_queued, v_audited, v_notified
FROM moved;
IF v_ids IS NULL THEN
    RETURN;
END IF;

WITH m AS (
    SELECT c.id, c.version AS expected_version, 'claimed'::text AS from_state,
           'running'::text AS to_state, 'start'::text AS event, NULL::text AS reason,
           NULL::jsonb AS detail, '{}'::jsonb AS patch
    FROM unnest(v_ids, v_versions) AS c(id, version)
), moved AS (
    UPDATE jobs AS t
    SET state = m.to_state,
        state_version = t.state_version + 1,
        state_entered_at = GREATEST(now(), t.state_entered_at),
        chain_seq = COALESCE(t.chain_seq, -1) + 1,
        chain_head = cp_event_hash('job', t.id, COALESCE(t.chain_seq, -1) + 1, t.chain_head, m.from_state, m.to_state, m.event, 'worker'::text, p_worker, m.reason, COALESCE(m.detail, '{}'::jsonb), NULL::text, t.state_version + 1, GREATEST(now(), t.state_entered_at)),
        updated_at = now(),
        heartbeat_at = CASE WHEN m.to_state IN ('claimed', 'running') THEN now() END,
        claimed_by = CASE WHEN m.to_state = 'queued' THEN NULL ELSE t.claimed_by END,
        run_at = CASE WHEN m.patch ? 'delay_s' THEN now() + make_interval(secs => (m.patch->>'delay_s')::float8) ELSE t.run_at END,
        attempt = CASE WHEN m.patch ? 'attempt' THEN (m.patch->>'attempt')::int ELSE t.attempt END,
        last_error = CASE WHEN m.patch ? 'last_error' THEN m.patch->>'last_error' ELSE t.last_error END,
        error_kind = CASE WHEN m.patch ? 'error_kind' THEN m.patch->>'error_kind' ELSE t.error_kind END,
        verdict = CASE WHEN m.patch ? 'verdict' THEN m.patch->'verdict' ELSE t.verdict END
    FROM m JOIN jobs AS prev ON prev.id = m.id
    WHERE t.id = m.id AND t.state_version = m.expected_version AND t.state = m.from_state
      AND t.chain_seq IS NOT DISTINCT FROM prev.chain_seq
    RETURNING t.*, m.from_state AS _from_state, m.event AS _event, m.reason AS _reason,
              m.detail AS _detail, prev.chain_head AS _prev_hash,
              extract(epoch FROM now() - prev.state_entered_at)::float8 AS _dwell_s,
              extract(epoch FROM now() - t.created_at)::float8 AS _age_s
)
, audit AS (
    INSERT INTO job_events
        (job_id, from_state, to_state, event, actor_kind, actor_id, reason, detail, request_id, state_version, at, seq, prev_hash, hash)
    SELECT id, _from_state, state, _event, 'worker'::text, p_worker, _reason,
           COALESCE(_detail, '{}'::jsonb), NULL::text, state_version, state_entered_at,
           chain_seq, _prev_hash, chain_head
    FROM moved
    RETURNING 1
), notified AS (
    SELECT pg_notify('cp_job_' || state, id::text || ':' || state_version) FROM moved
)
SELECT count(*), (SELECT count(*) FROM audit), (SELECT count(*) FROM notified)
INTO v_rows, v_audited, v_notified
FROM moved;
RETURN QUERY
    SELECT q.queued_s, j FROM jobs AS j
    JOIN unnest(v_ids, v_queued) AS q(id, queued_s) ON q.id = j.id
    WHERE j.state = 'running' AND j.claimed_by = p_worker;
END
"""


def upgrade() -> None:
    op.execute(
        f"CREATE FUNCTION {SIGNATURE} RETURNS TABLE (queued_s float8, job jobs)"
        f" LANGUAGE plpgsql AS $fn${BODY}$fn$"
    )
    op.execute("DROP INDEX ix_jobs_queued_order")
    op.execute(
        "CREATE INDEX ix_jobs_queued_order ON jobs (priority, (attempt = 0), run_at) WHERE state = 'queued'"
    )


def downgrade() -> None:
    op.execute("DROP INDEX ix_jobs_queued_order")
    op.execute("CREATE INDEX ix_jobs_queued_order ON jobs (priority, run_at) WHERE state = 'queued'")
    op.execute("DROP FUNCTION cp_claim_and_start(text[], integer, text, integer, boolean, timestamptz)")
