"""Replay check: the event logs rebuild every current row, and every disagreement is reported."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.rows import DictRow

from controlplane.audit import verify as audit
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.job_rows import NewJob, enqueue
from controlplane.db.transitions import Actor, transition
from tests.factories import TEST_ACTOR, append_event, make_instance
from tests.support import ROOT


async def walk(conn: AsyncConn, entity: str, row: DictRow, *events: str) -> DictRow:
    for event in events:
        row = await transition(
            conn,
            entity,
            row["id"],
            event,
            row["state_version"],
            expected_state=row["state"],
            actor=TEST_ACTOR,
        )
    return row


async def busy_history(conn: AsyncConn) -> dict[str, Any]:
    """Instances and jobs moved along many legal paths, including claims by the claim statement."""
    ready = await walk(
        conn, "instance", await make_instance(conn), "start_provisioning", "provisioned", "update", "updated"
    )
    deleted = await walk(
        conn,
        "instance",
        await make_instance(conn),
        "start_provisioning",
        "provisioned",
        "suspend",
        "resume",
        "degrade",
        "deprovision",
        "deprovisioned",
    )
    failed = await walk(conn, "instance", await make_instance(conn), "fail")
    job = (await enqueue(conn, NewJob("provision", ready["id"]), TEST_ACTOR)).job
    cursor = await conn.execute(
        sql.CLAIM_JOBS,
        {
            "kinds": ["provision"],
            "limit": 5,
            "worker": "w1",
            "actor_kind": "worker",
            "actor_id": "w1",
            "request_id": None,
        },
    )
    (claimed,) = await cursor.fetchall()
    job = await walk(conn, "job", claimed, "start", "error", "retry", "claim", "start", "finish")
    abandoned = (await enqueue(conn, NewJob("heal", ready["id"]), TEST_ACTOR)).job
    abandoned = await walk(conn, "job", abandoned, "claim", "start", "pause", "abandon")
    queued = (await enqueue(conn, NewJob("backup", ready["id"]), TEST_ACTOR)).job
    return {
        "ready": ready,
        "deleted": deleted,
        "failed": failed,
        "job": job,
        "abandoned": abandoned,
        "queued": queued,
    }


async def test_clean_history_verifies(conn: AsyncConn) -> None:
    rows = await busy_history(conn)
    assert rows["deleted"]["state"] == "deleted" and rows["job"]["state"] == "completed"
    assert await audit.verify(conn) == []


async def test_empty_database_verifies(conn: AsyncConn) -> None:
    assert await audit.verify(conn) == []


async def test_a_bogus_event_row_is_reported(conn: AsyncConn) -> None:
    rows = await busy_history(conn)
    ready = rows["ready"]
    await append_event(conn, "instance", ready["id"], "ready", "suspended", "suspend", 5)

    mismatches = await audit.verify(conn)

    assert {m.entity_id for m in mismatches} == {ready["id"]}
    assert all(m.entity == "instance" for m in mismatches)
    text = "\n".join(str(m) for m in mismatches)
    assert f"instance {ready['id']}: row is 'ready' v4, log replays to 'suspended' v5" in text


async def test_each_kind_of_disagreement_is_reported(conn: AsyncConn) -> None:
    rows = await busy_history(conn)
    # An edge that is not in the table, recorded at the right version: the database refuses it, so
    # it is written as only the tables' owner could, with the event guard off for that one row.
    with pytest.raises(psycopg.errors.CheckViolation, match="illegal event"):
        await append_event(conn, "instance", rows["failed"]["id"], "failed", "ready", "revive", 2)
    async with conn.transaction():
        await conn.execute("ALTER TABLE instance_events DISABLE TRIGGER instance_events_guard_event")
        bad_edge = await append_event(conn, "instance", rows["failed"]["id"], "failed", "ready", "revive", 2)
        await conn.execute("ALTER TABLE instance_events ENABLE TRIGGER instance_events_guard_event")
    # A version gap in a job's log.
    await append_event(
        conn, "job", rows["queued"]["id"], "queued", "claimed", "claim", 7, actor=Actor("worker", "w9")
    )
    # A job inserted behind the transition path: a row with no events at all.
    cursor = await conn.execute("INSERT INTO jobs (kind, state) VALUES ('ghost', 'queued') RETURNING id")
    ghost = await cursor.fetchone()
    assert ghost is not None

    mismatches = await audit.verify(conn)
    by_id: dict[uuid.UUID, list[str]] = {}
    for mismatch in mismatches:
        by_id.setdefault(mismatch.entity_id, []).append(mismatch.problem)

    assert set(by_id) == {rows["failed"]["id"], rows["queued"]["id"], ghost["id"]}
    assert f"event {bad_edge} (failed --revive->) is illegal" in by_id[rows["failed"]["id"]]
    assert any("has state_version 7, expected 1" in p for p in by_id[rows["queued"]["id"]])
    assert by_id[ghost["id"]] == ["has no events at all"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
    return subprocess.run(
        [sys.executable, "-m", "controlplane.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


async def test_cli_audit_verify_exit_codes(conn: AsyncConn, fresh_database: str) -> None:
    rows = await busy_history(conn)
    clean = run_cli("audit", "verify", "--database-url", fresh_database)
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.strip() == (
        "audit verify: 0 problem(s): 0 replay, 0 chain, 0 checkpoint; 29 events of 6 entities;"
        " no checkpoint yet"
    )

    await append_event(conn, "instance", rows["ready"]["id"], "ready", "suspended", "suspend", 5)
    dirty = run_cli("audit", "verify", "--database-url", fresh_database)
    assert dirty.returncode == 1, dirty.stderr
    lines = dirty.stdout.strip().splitlines()
    assert lines[-1].startswith("audit verify: 1 problem(s): 1 replay, 0 chain, 0 checkpoint; 30 events")
    assert lines[0] == (f"instance {rows['ready']['id']}: row is 'ready' v4, log replays to 'suspended' v5")
