"""The schema: migrations both ways, no drift, and the database defending the lifecycles itself."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest
from alembic.config import Config

from alembic import command
from controlplane.core import lifecycle
from controlplane.db import connection as db
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.job_rows import NewJob, enqueue, enqueue_many
from controlplane.db.transitions import Actor, Move, transition, transition_many
from tests.factories import TEST_ACTOR, make_instance, make_org

TABLES = {
    "lifecycle_transitions",
    "organisations",
    "api_keys",
    "instances",
    "backups",
    "instance_events",
    "jobs",
    "job_events",
    "job_steps",
    "stripe_events",
    "idempotency_keys",
    "console_sessions",
    "audit_keys",
    "audit_checkpoints",
    "audit_checkpoint_heads",
}
GUARD_FUNCTIONS = {
    "cp_guard_state",
    "cp_guard_event",
    "cp_append_only",
    "cp_event_hash",
    "cp_ensure_event_partitions",
}
APPEND_ONLY = (
    "instance_events",
    "job_events",
    "job_steps",
    "audit_keys",
    "audit_checkpoints",
    "audit_checkpoint_heads",
)
TRIGGERS = {
    "instances_guard_state",
    "jobs_guard_state",
    "instances_guard_chain",
    "jobs_guard_chain",
    "instance_events_guard_event",
    "job_events_guard_event",
    *(f"{table}_{kind}" for table in APPEND_ONLY for kind in ("append_only", "no_truncate")),
}
# Finished jobs behind the live ones in the supervisor-scan test: 250 per live job.
TERMINAL_JOBS = 5000


def alembic_config(url: str) -> Config:
    config = db.alembic_config(url)
    assert isinstance(config, Config)
    return config


def schema_objects(url: str) -> tuple[set[str], set[str], set[str]]:
    """Tables, functions and triggers of the public schema (the event tables' partitions left out)."""
    with psycopg.connect(url) as conn:
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace"
                " AND relkind IN ('r', 'p') AND NOT relispartition"
            )
        }
        functions = {
            r[0]
            for r in conn.execute("SELECT proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace")
        }
        triggers = {
            r[0]
            for r in conn.execute(
                "SELECT t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
                " WHERE NOT t.tgisinternal AND NOT c.relispartition"
            )
        }
    return tables, functions, triggers


def test_upgrade_downgrade_upgrade(empty_database: str) -> None:
    config = alembic_config(empty_database)
    command.upgrade(config, "head")
    tables, functions, triggers = schema_objects(empty_database)
    assert tables >= TABLES | {"alembic_version"}
    assert functions >= GUARD_FUNCTIONS
    assert triggers == TRIGGERS

    command.downgrade(config, "base")
    tables, functions, triggers = schema_objects(empty_database)
    assert tables == {"alembic_version"}
    assert not functions & GUARD_FUNCTIONS
    assert not triggers
    with psycopg.connect(empty_database) as conn:
        assert conn.execute("SELECT count(*) FROM alembic_version").fetchone() == (0,)
        assert conn.execute("SELECT to_regclass('job_fence_seq')").fetchone() == (None,)

    command.upgrade(config, "head")
    tables, functions, triggers = schema_objects(empty_database)
    assert tables >= TABLES and functions >= GUARD_FUNCTIONS and triggers == TRIGGERS
    with psycopg.connect(empty_database) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == (db.head_revision(),)


def test_models_and_migrations_do_not_drift(fresh_database: str) -> None:
    command.check(alembic_config(fresh_database))


def test_installed_claim_and_start_is_the_one_sql_py_builds(fresh_database: str) -> None:
    # The function's body is built from the transition template: a change there needs a migration.
    with psycopg.connect(fresh_database) as conn:
        row = conn.execute(
            "SELECT prosrc, proconfig FROM pg_proc WHERE proname = 'cp_claim_and_start'"
        ).fetchone()
    assert row is not None and row[0] == sql.CLAIM_AND_START_BODY
    assert tuple(row[1] or ()) == sql.CLAIM_AND_START_CONFIG


async def test_database_lifecycle_rows_equal_the_python_tables(conn: AsyncConn) -> None:
    cursor = await conn.execute("SELECT entity, from_state, event, to_state FROM lifecycle_transitions")
    rows = {(r["entity"], r["from_state"], r["event"], r["to_state"]) for r in await cursor.fetchall()}
    expected = {
        (entity, src, event, dst)
        for entity, table in lifecycle.LIFECYCLES.items()
        for (src, event), dst in table.transitions.items()
    }
    assert rows == expected
    assert len(rows) == 18 + 11


async def _row_in_state(conn: AsyncConn, entity: str, state: str, version: int = 3) -> uuid.UUID:
    """A row put in `state` behind the guard's back (the trigger is off only for this write)."""
    table = "instances" if entity == "instance" else "jobs"
    trigger = f"{table}_guard_state"
    if entity == "instance":
        row = await make_instance(conn)
        row_id: uuid.UUID = row["id"]
    else:
        row_id = (await enqueue(conn, NewJob("probe"), TEST_ACTOR)).job["id"]
    async with conn.transaction():
        await conn.execute(f"ALTER TABLE {table} DISABLE TRIGGER {trigger}")
        await conn.execute(
            f"UPDATE {table} SET state = %s, state_version = %s WHERE id = %s", (state, version, row_id)
        )
        await conn.execute(f"ALTER TABLE {table} ENABLE TRIGGER {trigger}")
    return row_id


@pytest.mark.parametrize("entity", ["instance", "job"])
async def test_database_edge_set_equals_the_python_table(conn: AsyncConn, entity: str) -> None:
    """Try every (from, to) pair on a real row: the trigger allows exactly the table's edges."""
    table = lifecycle.lifecycle(entity)
    relation = "instances" if entity == "instance" else "jobs"
    allowed: set[tuple[str, str]] = set()
    for src in table.states:
        row_id = await _row_in_state(conn, entity, src)
        for dst in table.states:
            if dst == src:
                continue
            try:
                async with conn.transaction(force_rollback=True):
                    await conn.execute(
                        f"UPDATE {relation} SET state = %s, state_version = state_version + 1 WHERE id = %s",
                        (dst, row_id),
                    )
            except psycopg.errors.CheckViolation:
                continue
            allowed.add((src, dst))
    assert allowed == table.edges()


# An event row as a writer could insert one by hand (the hash made up: the chain is the audit's).
INSERT_EVENT = """
INSERT INTO {table} ({fk}, from_state, to_state, event, actor_kind, actor_id, state_version, seq, hash{at})
VALUES (%s, %s, %s, %s, 'operator', 'hand', %s, %s, '\\x00'{at_value})
"""


async def _insert_event(
    conn: AsyncConn, entity: str, row_id: uuid.UUID, src: str | None, dst: str, event: str, at: Any = None
) -> None:
    table, fk = ("instance_events", "instance_id") if entity == "instance" else ("job_events", "job_id")
    version = 0 if src is None else 7
    dated = ("", "") if at is None else (", at", ", %s")
    await conn.execute(
        INSERT_EVENT.format(table=table, fk=fk, at=dated[0], at_value=dated[1]),
        (row_id, src, dst, event, version, version, *(() if at is None else (at,))),
    )


@pytest.mark.parametrize("entity", ["instance", "job"])
async def test_database_event_moves_equal_the_python_table(runtime_url: str, entity: str) -> None:
    """As the runtime role, an event row of every (from, event, to) of the table's states and events:
    exactly the table's moves, and its creation, are accepted (the row's own guard is not asked)."""
    table = lifecycle.lifecycle(entity)
    async with await db.connect(runtime_url) as conn:
        if entity == "instance":
            row_id = (await make_instance(conn))["id"]
        else:
            row_id = (await enqueue(conn, NewJob("probe"), TEST_ACTOR)).job["id"]
        accepted: set[tuple[str | None, str, str]] = set()
        events = (table.creation_event, *table.events())
        for src in (None, *table.states):
            for event in events:
                for dst in table.states:
                    try:
                        async with conn.transaction(force_rollback=True):
                            await _insert_event(conn, entity, row_id, src, dst, event)
                    except psycopg.errors.CheckViolation as refused:
                        assert "illegal event" in str(refused)
                        continue
                    accepted.add((src, event, dst))
    moves = {(src, event, dst) for (src, event), dst in table.transitions.items()}
    assert accepted == moves | {(None, table.creation_event, table.initial)}


async def test_an_illegal_event_is_refused_in_a_partition_made_later_and_moves_still_land(
    conn: AsyncConn, runtime_url: str
) -> None:
    """The trigger is the partitioned table's: a month's partition made after the migration has it."""
    inst = await make_instance(conn)
    month = await _scalar(conn, "SELECT date_trunc('month', now()) + interval '3 years' AS month")
    made = await _scalar(conn, "SELECT array_agg(p) AS made FROM cp_ensure_event_partitions(%s) p", (month,))
    assert made and any(name.startswith("instance_events_") for name in made)
    async with await db.connect(runtime_url) as runtime:
        with pytest.raises(psycopg.errors.CheckViolation, match="is not a move of the instance lifecycle"):
            await _insert_event(runtime, "instance", inst["id"], "pending", "ready", "provisioned", at=month)
        with pytest.raises(psycopg.errors.CheckViolation, match="must be created by create in state pending"):
            await _insert_event(runtime, "instance", inst["id"], None, "ready", "create", at=month)
        moved = await transition(
            runtime,
            "instance",
            inst["id"],
            "start_provisioning",
            0,
            expected_state="pending",
            actor=TEST_ACTOR,
        )
    assert (moved["state"], moved["state_version"]) == ("provisioning", 1)
    assert (
        await _scalar(conn, "SELECT count(*) FROM instance_events WHERE instance_id = %s", (inst["id"],)) == 2
    )


async def _scalar(conn: AsyncConn, query: str, params: Any = None) -> Any:
    cursor = await conn.execute(query, params)
    row = await cursor.fetchone()
    assert row is not None
    return next(iter(row.values()))


async def test_hand_typed_illegal_update_is_refused(conn: AsyncConn) -> None:
    inst = await make_instance(conn)
    with pytest.raises(psycopg.errors.CheckViolation, match="illegal transition"):
        await conn.execute("UPDATE instances SET state = 'ready' WHERE id = %s", (inst["id"],))
    with pytest.raises(psycopg.errors.CheckViolation, match="illegal transition"):
        await conn.execute(
            "UPDATE instances SET state = 'ready', state_version = state_version + 1 WHERE id = %s",
            (inst["id"],),
        )
    assert await _scalar(conn, "SELECT state FROM instances WHERE id = %s", (inst["id"],)) == "pending"


async def test_legal_edge_must_bump_the_version_by_exactly_one(conn: AsyncConn) -> None:
    inst = await make_instance(conn)
    for version in ("state_version", "state_version + 2", "state_version - 1"):
        with pytest.raises(psycopg.errors.CheckViolation, match="must bump state_version"):
            await conn.execute(
                f"UPDATE instances SET state = 'provisioning', state_version = {version} WHERE id = %s",
                (inst["id"],),
            )
    await conn.execute(
        "UPDATE instances SET state = 'provisioning', state_version = state_version + 1 WHERE id = %s",
        (inst["id"],),
    )
    row = await (await conn.execute("SELECT * FROM instances WHERE id = %s", (inst["id"],))).fetchone()
    assert row is not None and (row["state"], row["state_version"]) == ("provisioning", 1)


@pytest.mark.parametrize("table", ["instances", "jobs"])
async def test_version_may_not_move_without_the_state(conn: AsyncConn, table: str) -> None:
    if table == "instances":
        row_id = (await make_instance(conn))["id"]
    else:
        row_id = (await enqueue(conn, NewJob("probe"), TEST_ACTOR)).job["id"]
    with pytest.raises(psycopg.errors.CheckViolation, match="state_version may change only with the state"):
        await conn.execute(f"UPDATE {table} SET state_version = state_version + 1 WHERE id = %s", (row_id,))
    # Columns other than state and state_version stay writable.
    await conn.execute(f"UPDATE {table} SET updated_at = now() WHERE id = %s", (row_id,))


async def test_job_trigger_refuses_illegal_edges(conn: AsyncConn) -> None:
    job = (await enqueue(conn, NewJob("probe"), TEST_ACTOR)).job
    with pytest.raises(psycopg.errors.CheckViolation, match="illegal transition"):
        await conn.execute(
            "UPDATE jobs SET state = 'completed', state_version = 1 WHERE id = %s", (job["id"],)
        )


async def test_rows_must_be_created_in_the_initial_state(conn: AsyncConn) -> None:
    org = await make_org(conn)
    insert_instance = (
        "INSERT INTO instances (org_id, name, spec, state, state_version) VALUES (%s, %s, '{}', %s, %s)"
    )
    with pytest.raises(psycopg.errors.CheckViolation, match="must be created in state pending"):
        await conn.execute(insert_instance, (org, "a", "ready", 0))
    with pytest.raises(psycopg.errors.CheckViolation, match="must be created in state pending"):
        await conn.execute(insert_instance, (org, "b", "pending", 4))
    with pytest.raises(psycopg.errors.CheckViolation, match="must be created in state queued"):
        await conn.execute("INSERT INTO jobs (kind, state) VALUES ('probe', 'running')")
    await conn.execute(insert_instance, (org, "c", "pending", 0))
    await conn.execute("INSERT INTO jobs (kind, state) VALUES ('probe', 'queued')")


@pytest.mark.parametrize("table", ["instance_events", "job_events"])
@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE {table} SET reason = 'rewritten'",
        "DELETE FROM {table}",
        "TRUNCATE {table}",
    ],
)
async def test_event_tables_are_append_only(conn: AsyncConn, table: str, statement: str) -> None:
    inst = await make_instance(conn)
    await enqueue(conn, NewJob("provision", inst["id"]), TEST_ACTOR)
    before = await _scalar(conn, f"SELECT count(*) FROM {table}")
    assert before == 1
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
        await conn.execute(statement.format(table=table))
    assert await _scalar(conn, f"SELECT count(*) FROM {table}") == before
    assert await _scalar(conn, f"SELECT count(*) FROM {table} WHERE reason = 'rewritten'") == 0


async def test_truncating_a_parent_cannot_wipe_the_audit_log(conn: AsyncConn) -> None:
    await make_instance(conn)
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
        await conn.execute("TRUNCATE instances CASCADE")
    assert await _scalar(conn, "SELECT count(*) FROM instance_events") == 1


async def _move_all(conn: AsyncConn, rows: list[dict[str, Any]], event: str, batch: int = 5000) -> list[Any]:
    """Apply `event` to every row through the transition path, in batches; return the moved rows."""
    actor = Actor("system", "schema-test")
    moved: list[Any] = []
    for start in range(0, len(rows), batch):
        moves = [Move(r["id"], r["state"], r["state_version"], event) for r in rows[start : start + batch]]
        result = await transition_many(conn, "job", moves, actor)
        assert not result.failed
        moved += result.moved
    return moved


async def test_supervisor_scan_uses_the_live_heartbeat_index(conn: AsyncConn) -> None:
    done = [e.job for e in await enqueue_many(conn, [NewJob("bulk")] * TERMINAL_JOBS, TEST_ACTOR)]
    for event in ("claim", "start", "finish"):
        done = await _move_all(conn, done, event)
    live = [e.job for e in await enqueue_many(conn, [NewJob("live")] * 20, TEST_ACTOR)]
    await _move_all(conn, await _move_all(conn, live, "claim"), "start")
    await conn.execute("ANALYZE jobs")

    query = (
        "SELECT id FROM jobs WHERE state IN ('claimed','running')"
        " AND heartbeat_at < now() - interval '10 seconds'"
    )
    cursor = await conn.execute(f"EXPLAIN (FORMAT JSON) {query}")
    row = await cursor.fetchone()
    assert row is not None
    plan = json.dumps(row["QUERY PLAN"])
    assert '"Index Name": "ix_jobs_live_heartbeat"' in plan, plan
    assert "Seq Scan" not in plan, plan
    assert await _scalar(conn, "SELECT count(*) FROM jobs WHERE state = 'completed'") == TERMINAL_JOBS


async def test_one_live_job_per_instance_and_kind(conn: AsyncConn) -> None:
    inst = await make_instance(conn)
    insert = "INSERT INTO jobs (kind, instance_id, state) VALUES (%s, %s, 'queued') RETURNING *"
    first = await (await conn.execute(insert, ("provision", inst["id"]))).fetchone()
    assert first is not None
    with pytest.raises(psycopg.errors.UniqueViolation, match="ux_jobs_live_instance_kind"):
        await conn.execute(insert, ("provision", inst["id"]))
    await conn.execute(insert, ("deprovision", inst["id"]))  # another kind is another job

    row = first
    for event in ("claim", "start", "finish"):
        row = await transition(
            conn, "job", row["id"], event, row["state_version"], expected_state=row["state"], actor=TEST_ACTOR
        )
    assert row["state"] == "completed"
    second = await (await conn.execute(insert, ("provision", inst["id"]))).fetchone()
    assert second is not None and second["id"] != first["id"]


async def test_enqueue_of_a_duplicate_live_job_returns_the_live_one(conn: AsyncConn) -> None:
    inst = await make_instance(conn)
    first = await enqueue(conn, NewJob("provision", inst["id"]), TEST_ACTOR)
    again = await enqueue(conn, NewJob("provision", inst["id"]), TEST_ACTOR)
    assert first.created and not again.created and again.job["id"] == first.job["id"]
    cursor = await conn.execute(
        sql.CLAIM_JOBS,
        {
            "kinds": ["provision"],
            "limit": 1,
            "worker": "w",
            "actor_kind": "worker",
            "actor_id": "w",
            "request_id": None,
        },
    )
    claimed = await cursor.fetchone()
    assert claimed is not None and claimed["id"] == first.job["id"]
    # Still live while claimed: no second job.
    assert not (await enqueue(conn, NewJob("provision", inst["id"]), TEST_ACTOR)).created


def test_0004_fills_in_the_applied_spec_of_instances_that_run_their_declared_one(empty_database: str) -> None:
    config = alembic_config(empty_database)
    command.upgrade(config, "0003")
    with psycopg.connect(empty_database, autocommit=True) as conn:
        org = conn.execute("INSERT INTO organisations (name) VALUES ('o') RETURNING id").fetchone()
        assert org is not None
        for name, generations in (("current", (2, 2)), ("pending-change", (3, 2)), ("never", (1, 0))):
            row = conn.execute(
                "INSERT INTO instances (org_id, name, spec, state)"
                " VALUES (%s, %s, '{\"plan\": \"small\"}', 'pending') RETURNING id",
                (org[0], name),
            ).fetchone()
            assert row is not None
            # As years of transitions would have left them (the guard trigger allows no shortcut).
            conn.execute("SET session_replication_role = replica")
            conn.execute(
                "UPDATE instances SET state = 'ready', spec_generation = %s, observed_generation = %s"
                " WHERE id = %s",
                (*generations, row[0]),
            )
            conn.execute("SET session_replication_role = DEFAULT")
    command.upgrade(config, "0004")
    with psycopg.connect(empty_database) as conn:
        rows: dict[str, object] = dict(conn.execute("SELECT name, observed_spec FROM instances").fetchall())
    assert rows == {"current": {"plan": "small"}, "pending-change": None, "never": None}
