"""Bulk-loaded history for the reconciler workload: dead instances and their jobs, with their events.

The state guards only admit inserts in the initial state at state_version 0, so the tables' triggers
are disabled for the load (in the bench's scratch database only) and enabled again in the same
transaction; every inserted row gets the event rows of the legal path that leads to its state, and
every event row references a row inserted just before (the foreign keys hold by construction). The
secondary indexes are dropped during the load and created again from their own definitions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

# The legal paths to the terminal states: (state_version after the move, from, to, event).
DELETED_PATH = (
    (0, None, "pending", "create"),
    (1, "pending", "provisioning", "start_provisioning"),
    (2, "provisioning", "ready", "provisioned"),
    (3, "ready", "deprovisioning", "deprovision"),
    (4, "deprovisioning", "deleted", "deprovisioned"),
)
FAILED_PATH = (
    (0, None, "pending", "create"),
    (1, "pending", "failed", "fail"),
)
# Each dead instance also left one completed provisioning job behind.
JOB_PATH = (
    (0, None, "queued", "enqueue"),
    (1, "queued", "claimed", "claim"),
    (2, "claimed", "running", "start"),
    (3, "running", "completed", "finish"),
)
LOADED_TABLES = ("instances", "instance_events", "jobs", "job_events")
# entity -> (entity table, event table, foreign key)
CHAINED = {
    "instance": ("instances", "instance_events", "instance_id"),
    "job": ("jobs", "job_events", "job_id"),
}
ORGS = 100
# One in FAILED_EVERY dead instances failed while pending; the others were deleted.
FAILED_EVERY = 5


def load_terminal_instances(url: str, count: int) -> None:
    """Insert `count` deleted/failed instances spread over ORGS organisations, with matching events."""
    with psycopg.connect(url) as conn:
        partitions_since(conn, 40)
        conn.execute(
            "INSERT INTO organisations (name) SELECT 'bench-dead-' || g FROM generate_series(1, %s) g",
            (ORGS,),
        )
        indexes = drop_indexes(conn, LOADED_TABLES)
        for table in LOADED_TABLES:
            conn.execute(f"ALTER TABLE {table} DISABLE TRIGGER ALL")
        conn.execute(
            """
            INSERT INTO instances (org_id, name, spec, state, state_version, state_entered_at,
                                   failure_reason, observed_generation, created_at, updated_at)
            SELECT o.ids[1 + g %% %(orgs)s], 'dead-' || g, '{"plan": "dev", "region": "local"}'::jsonb,
                   CASE WHEN g %% %(every)s = 0 THEN 'failed' ELSE 'deleted' END,
                   CASE WHEN g %% %(every)s = 0 THEN 1 ELSE 4 END,
                   now() - interval '1 day',
                   CASE WHEN g %% %(every)s = 0 THEN 'bench: failed while pending' END,
                   CASE WHEN g %% %(every)s = 0 THEN 0 ELSE 1 END,
                   now() - interval '30 days', now() - interval '1 day'
            FROM generate_series(1, %(count)s) g,
                 (SELECT array_agg(id ORDER BY id) AS ids FROM organisations
                  WHERE name LIKE 'bench-dead-%%') o
            """,
            {"orgs": ORGS, "every": FAILED_EVERY, "count": count},
        )
        conn.execute(
            """
            INSERT INTO jobs (kind, instance_id, payload, state, state_version, attempt, claimed_by,
                              claimed_at, fence, verdict, run_at, created_at, updated_at, state_entered_at)
            SELECT 'provision', i.id, '{}'::jsonb, 'completed', 3, 1, 'bench-load', i.created_at,
                   nextval('job_fence_seq'), '{"result": "ready"}'::jsonb, i.created_at, i.created_at,
                   i.created_at, i.created_at
            FROM instances i WHERE i.name LIKE 'dead-%%'
            """
        )
        load_chains(
            conn,
            "job",
            "SELECT id, created_at AS base FROM jobs WHERE claimed_by = 'bench-load'",
            JOB_PATH,
            "base + {v} * interval '1 second'",
        )
        for state, path in (("deleted", DELETED_PATH), ("failed", FAILED_PATH)):
            load_chains(
                conn,
                "instance",
                "SELECT id, created_at AS base FROM instances"
                f" WHERE state = '{state}' AND name LIKE 'dead-%%'",
                path,
                "base + {v} * interval '1 hour'",
            )
        create_indexes(conn, indexes)
        for table in LOADED_TABLES:
            conn.execute(f"ALTER TABLE {table} ENABLE TRIGGER ALL")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) instances")
        conn.execute("VACUUM (ANALYZE) instance_events")
        conn.execute("VACUUM (ANALYZE) organisations")
        conn.execute("VACUUM (ANALYZE) jobs")
        conn.execute("VACUUM (ANALYZE) job_events")


def load_terminal_jobs(url: str, count: int) -> None:
    """Insert `count` completed jobs (no instance, no events: what a claim never reads), server-side
    in one statement with the table's indexes dropped and its triggers disabled for the load."""
    with psycopg.connect(url) as conn:
        indexes = drop_indexes(conn, ("jobs",))
        conn.execute("ALTER TABLE jobs DISABLE TRIGGER ALL")
        conn.execute(
            """
            INSERT INTO jobs (id, kind, payload, state, state_version, attempt, claimed_by, claimed_at,
                              fence, verdict, run_at, created_at, updated_at, state_entered_at,
                              chain_seq)
            SELECT lpad(to_hex(g), 32, '0')::uuid, 'bench_noop', '{}'::jsonb, 'completed', 3, 1,
                   'bench-load', t, g, '{"result": "done"}'::jsonb, t, t, t, t, 3
            FROM generate_series(1, %(count)s) g,
                 LATERAL (SELECT now() - interval '30 days' + g * interval '1 ms' AS t) at
            """,
            {"count": count},
        )
        create_indexes(conn, indexes)
        conn.execute("ALTER TABLE jobs ENABLE TRIGGER ALL")
    with psycopg.connect(url, autocommit=True) as conn:
        # Vacuumed now, not by autovacuum in the middle of a later workload (a load of millions of
        # rows is worth a vacuum of the whole table, whose I/O and CPU would land in its minutes).
        conn.execute("VACUUM (ANALYZE) jobs")


def drop_indexes(conn: psycopg.Connection[Any], tables: Sequence[str]) -> list[str]:
    """Drop the tables' secondary indexes (a partitioned table's with its partitions'); return
    their definitions for create_indexes."""
    rows = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'"
        " AND tablename = ANY(%s) AND indexname NOT LIKE 'pk\\_%%'",
        (list(tables),),
    ).fetchall()
    for name, _ in rows:
        conn.execute(f"DROP INDEX {name}")
    # A partitioned table's index is printed `ON ONLY parent`: made so, it would cover no partition.
    return [definition.replace(" ON ONLY ", " ON ", 1) for _, definition in rows]


def create_indexes(conn: psycopg.Connection[Any], definitions: Sequence[str]) -> None:
    for definition in definitions:
        conn.execute(definition)


def partitions_since(conn: psycopg.Connection[Any], days: int) -> None:
    """The event tables' monthly partitions from `days` ago (the loaded history is in the past)."""
    conn.execute(
        "SELECT count(*) FROM cp_ensure_event_partitions(now() + interval '3 months',"
        " now() - make_interval(days => %s))",
        (days,),
    )


def load_chains(
    conn: psycopg.Connection[Any],
    entity: str,
    entities: str,
    path: Sequence[tuple[int, str | None, str, str]],
    at: str,
) -> None:
    """Give each entity `entities` selects (id, base time) the events of `path`, hash-chained as the
    product writes them: one statement per step for all entities, each event linked to the one
    before it; `at` is each event's time from `base` and the step `{v}`. The rows' chain heads end
    at the last step."""
    table, events, fk = CHAINED[entity]
    # Each step reads the heads of the step before from one table and writes the new heads into the
    # other, which the step after reads while the first is emptied: one transaction updating one
    # table in place would leave every earlier version behind for each later step to scan.
    conn.execute(f"CREATE TEMP TABLE bench_base AS SELECT id, base FROM ({entities}) q")
    conn.execute("CREATE TEMP TABLE bench_heads_a (id uuid, hash bytea)")
    conn.execute("CREATE TEMP TABLE bench_heads_b (id uuid, hash bytea)")
    conn.execute("ANALYZE bench_base")
    read, write = "bench_heads_a", "bench_heads_b"
    for v, src, dst, event in path:
        fields = f"%(src)s, %(dst)s, %(event)s, 'system', 'bench-load', NULL, '{{}}'::jsonb, NULL, {v}"
        conn.execute(
            f"""
            WITH ins AS (
                INSERT INTO {events} ({fk}, from_state, to_state, event, actor_kind, actor_id, reason,
                                      detail, request_id, state_version, at, seq, prev_hash, hash)
                SELECT b.id, {fields}, b.at, {v}, h.hash,
                       cp_event_hash('{entity}', b.id, {v}, h.hash, {fields}, b.at)
                FROM (SELECT id, {at.format(v=v)} AS at FROM bench_base) b
                LEFT JOIN {read} h ON h.id = b.id
                RETURNING {fk} AS id, hash
            )
            INSERT INTO {write} SELECT id, hash FROM ins
            """,
            {"src": src, "dst": dst, "event": event},
        )
        conn.execute(f"TRUNCATE {read}")
        conn.execute(f"ANALYZE {write}")
        read, write = write, read
    last = path[-1][0]
    conn.execute(
        f"UPDATE {table} t SET chain_seq = {last}, chain_head = h.hash, state_entered_at = b.at"
        f" FROM {read} h JOIN (SELECT id, {at.format(v=last)} AS at FROM bench_base) b ON b.id = h.id"
        " WHERE t.id = h.id"
    )
    conn.execute("DROP TABLE bench_base, bench_heads_a, bench_heads_b")
