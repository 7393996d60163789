"""SRE commands against a real database: events, stats dwell, stuck."""

from __future__ import annotations

import asyncio
import json

import pytest

from controlplane.cli import main
from controlplane.db.connection import AsyncConn
from controlplane.db.job_rows import NewJob, enqueue
from controlplane.db.transitions import transition
from controlplane.queue.moves import claim
from tests.factories import TEST_ACTOR, make_instance


async def cli(argv: list[str]) -> int:
    """The command line, off the event loop (it runs its own)."""
    return await asyncio.to_thread(main, argv)


async def test_events_stats_and_stuck(
    conn: AsyncConn, fresh_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    late = await make_instance(conn)
    await conn.execute(
        "UPDATE instances SET deadline_at = now() - interval '1 hour' WHERE id = %s", (late["id"],)
    )
    moved = await make_instance(conn)
    await transition(
        conn,
        "instance",
        moved["id"],
        "start_provisioning",
        0,
        expected_state="pending",
        actor=TEST_ACTOR,
        reason="tested",
    )
    await enqueue(conn, NewJob("provision", moved["id"]), TEST_ACTOR)
    (job,) = await claim(conn, "gone-worker", ["provision"], 1)
    await conn.execute("UPDATE jobs SET heartbeat_at = now() - interval '1 hour' WHERE id = %s", (job["id"],))
    db = ["--database-url", fresh_database]

    assert await cli(["events", *db, "--to-state", "provisioning", "--json"]) == 0
    (event,) = json.loads(capsys.readouterr().out)
    assert event["instance_id"] == str(moved["id"]) and event["reason"] == "tested"
    assert await cli(["events", *db, "--actor", "system:tests"]) == 0
    table = capsys.readouterr().out
    assert table.count("\n") == 4 and "start_provisioning" in table
    # By name, under one header case; --columns picks any field, --limit the first ones.
    assert table.splitlines()[0].split() == ["at", "instance", "from", "to", "event", "actor", "reason"]
    assert moved["name"] in table and str(moved["id"]) not in table
    assert (
        await cli(
            ["events", *db, "--actor", "system:tests", "--columns", "instance_id,event", "--limit", "1"]
        )
        == 0
    )
    assert capsys.readouterr().out.splitlines()[1].split() == [str(late["id"]), "create"]

    assert await cli(["stats", "dwell", *db, "--json"]) == 0
    stats = {s["state"]: s for s in json.loads(capsys.readouterr().out)["states"]}
    assert stats["pending"]["count"] == 2 and stats["pending"]["current"] == 1

    await enqueue(conn, NewJob("provision", late["id"]), TEST_ACTOR)
    assert await cli(["jobs", "list", *db, "--instance", str(moved["id"]), "--json"]) == 0
    assert [j["id"] for j in json.loads(capsys.readouterr().out)] == [str(job["id"])]

    assert await cli(["stuck", *db, "--json"]) == 0
    stuck = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in stuck["instances_past_deadline"]] == [str(late["id"])]
    assert [r["id"] for r in stuck["jobs_without_heartbeat"]] == [str(job["id"])]
    assert await cli(["stuck", *db]) == 0
    text = capsys.readouterr().out
    assert "instances past their deadline: 1" in text and "gone-worker" in text
