"""the claim and start returns where the worker's next claim may start

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-03

`cp_claim_and_start` first reads the database's bound (`controlplane.db.sql.LOOK_FROM`: the start
of the oldest transaction of this database that has written, or now), before its claim's snapshot,
and returns it with each job as `look_from`. No job that claim could not see sorts before the
bound, but for the moment between an insert's clock and its xid: the worker's next claim starts
just before the older of the bound and the fresh jobs it claimed, instead of a fixed second before
the jobs. Under a pinned xmin horizon, a claim from a second before re-read the dead index entries
of every job claimed in that second. The body is `controlplane.db.sql.CLAIM_AND_START_BODY` at
this revision; the planner settings are those 0012 and 0013 set.
"""

# ruff: noqa: E501 (the function body is SQL text, as controlplane/db/sql builds it)

from __future__ import annotations

import runpy
from pathlib import Path

from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | None = None
depends_on: str | None = None

SIGNATURE = (
    "cp_claim_and_start(p_kinds text[], p_limit integer, p_worker text,"
    " p_from_priority integer, p_from_fresh boolean, p_from_run_at timestamptz)"
)
CONFIG = " SET enable_sort = off SET jit = off SET enable_seqscan = off"

BODY = """
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
SELECT least(now(), min(xact_start)) INTO v_look_from FROM pg_stat_activity WHERE backend_xid IS NOT NULL AND datname = current_database();

WITH candidates AS (
    SELECT * FROM (
        SELECT ctid AS row_ctid, state AS row_state, id, state_version, state_entered_at, created_at,
               chain_seq, chain_head, priority, attempt = 0 AS fresh, run_at
        FROM jobs
        WHERE state = 'queued' AND run_at <= now() AND kind = ANY(p_kinds::text[]) AND (priority, attempt = 0, run_at) < (p_from_priority::int, true, '-infinity'::timestamptz) AND (priority, attempt = 0, run_at) < (p_from_priority::int, p_from_fresh::boolean, p_from_run_at::timestamptz)
        ORDER BY priority, attempt = 0, run_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ) AS in_range
    UNION ALL
    SELECT * FROM (
        SELECT ctid AS row_ctid, state AS row_state, id, state_version, state_entered_at, created_at,
               chain_seq, chain_head, priority, attempt = 0 AS fresh, run_at
        FROM jobs
        WHERE state = 'queued' AND run_at <= now() AND kind = ANY(p_kinds::text[]) AND (priority, attempt = 0, run_at) >= (p_from_priority::int, p_from_fresh::boolean, p_from_run_at::timestamptz)
        ORDER BY priority, attempt = 0, run_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ) AS in_range
), locked AS (
    SELECT * FROM candidates ORDER BY priority, fresh, run_at LIMIT p_limit
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
    WHERE t.ctid = picked.row_ctid
      AND t.id = picked.id AND t.state_version = picked.state_version AND t.state = picked.row_state
      AND t.chain_seq IS NOT DISTINCT FROM picked.chain_seq
    RETURNING t.*, t.ctid AS _ctid, 'queued'::text AS _from_state, 'claim'::text AS _event,
              NULL::text AS _reason,
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
SELECT array_agg(moved.id), array_agg(moved.state_version), array_agg(moved._ctid),
       array_agg(moved.state), array_agg(moved._dwell_s), (SELECT count(*) FROM audit),
       (SELECT count(*) FROM notified)
INTO v_ids, v_versions, v_ctids, v_states, v_queued, v_audited, v_notified
FROM moved;
IF v_ids IS NULL THEN
    RETURN;
END IF;

WITH m AS (
    SELECT c.id, c.version AS expected_version, c.from_state,
           'running'::text AS to_state, 'start'::text AS event, NULL::text AS reason,
           NULL::jsonb AS detail, '{}'::jsonb AS patch, c.row_ctid
    FROM unnest(v_ids, v_versions, v_ctids, v_states) AS c(id, version, row_ctid, from_state)
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
    FROM m JOIN jobs AS prev ON prev.ctid = m.row_ctid AND prev.id = m.id
    WHERE t.ctid = m.row_ctid AND t.id = m.id AND t.state_version = m.expected_version AND t.state = m.from_state
      AND t.chain_seq IS NOT DISTINCT FROM prev.chain_seq
    RETURNING t.*, t.ctid AS _ctid, m.from_state AS _from_state, m.event AS _event, m.reason AS _reason,
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
SELECT array_agg(moved._ctid), (SELECT count(*) FROM audit), (SELECT count(*) FROM notified)
INTO v_ctids, v_audited, v_notified
FROM moved;
-- The rows the start wrote (their ctids: this transaction holds them locked).
RETURN QUERY
    SELECT q.queued_s, j, v_look_from FROM unnest(v_ids, v_queued) AS q(id, queued_s)
    JOIN jobs AS j ON j.ctid = ANY(v_ctids) AND j.id = q.id;
END
"""


def _create(body: str, returns: str) -> None:
    # The returned row changes, which CREATE OR REPLACE cannot do: dropped and made again.
    op.execute("DROP FUNCTION cp_claim_and_start(text[], integer, text, integer, boolean, timestamptz)")
    op.execute(
        f"CREATE FUNCTION {SIGNATURE} RETURNS TABLE ({returns}) LANGUAGE plpgsql{CONFIG} AS $fn${body}$fn$"
    )


def upgrade() -> None:
    _create(BODY, "queued_s float8, job jobs, look_from timestamptz")


def downgrade() -> None:
    # The body of revision 0012, with the settings of 0012 and 0013.
    _create(
        str(runpy.run_path(str(Path(__file__).with_name("0012_claim_by_ctid.py")))["BODY"]),
        "queued_s float8, job jobs",
    )
