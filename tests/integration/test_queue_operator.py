"""Operator actions on jobs (pause, resume, retry, abandon) through the queue and the CLI."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest

from controlplane.audit import verify as audit
from controlplane.cli import main as cli_main
from controlplane.core import exit_codes
from controlplane.core.lifecycle import IllegalTransition
from controlplane.core.retry import RetryDecision
from controlplane.db import connection as db
from controlplane.db.job_rows import NewJob, enqueue, get_job
from controlplane.db.transitions import Actor
from controlplane.queue import moves as queue
from controlplane.queue.registry import JobKind, JobRegistry
from tests.factories import TEST_ACTOR
from tests.queue_kinds import WORKER, build_registry, running_job

ACTOR = Actor("worker", WORKER)


async def reason_of(conn: db.AsyncConn, job_id: uuid.UUID, event: str) -> tuple[str, str, str]:
    cursor = await conn.execute(
        "SELECT actor_kind, actor_id, reason FROM job_events"
        " WHERE job_id = %s AND event = %s ORDER BY id DESC",
        (job_id, event),
    )
    row = await cursor.fetchone()
    assert row is not None
    return row["actor_kind"], row["actor_id"], row["reason"]


async def test_pause_resume_retry_abandon_with_operator_and_reason(conn: db.AsyncConn) -> None:
    hooked: list[Any] = []

    async def on_abandoned(c: db.AsyncConn, row: Any, actor: Actor) -> None:
        hooked.append((row["id"], actor))

    noop = build_registry().get("noop")
    assert noop is not None
    registry = JobRegistry([JobKind("noop", noop.handler, on_abandoned)])
    row = await running_job(conn)
    paused = await queue.pause(conn, row["id"], "alice", "looks stuck")
    assert paused["state"] == "paused"
    assert await reason_of(conn, row["id"], "pause") == ("operator", "alice", "looks stuck")
    resumed = await queue.resume(conn, row["id"], "alice", "false alarm")
    assert resumed["state"] == "running"
    # Not an attempt spent: its next claim (after the reclaim) is the attempt it was paused on.
    assert (paused["attempt"], resumed["attempt"]) == (1, 0)
    failed = await queue.error(
        conn, queue.JobFailure(resumed, "boom", "temporary", RetryDecision("retry", 600, "backoff")), ACTOR
    )
    retried = await queue.retry(conn, failed["id"], "bob", "fixed the network")
    assert retried["state"] == "queued" and retried["run_at"] <= failed["run_at"]
    assert await reason_of(conn, row["id"], "retry") == ("operator", "bob", "fixed the network")

    row2 = await running_job(conn)
    await queue.pause(conn, row2["id"], "alice", "hold on")
    gone = await queue.abandon(conn, row2["id"], "alice", "customer cancelled", registry)
    assert gone["state"] == "abandoned"
    assert hooked == [(row2["id"], Actor("operator", "alice"))]
    assert await audit.verify(conn) == []


async def test_illegal_actions_are_refused_naming_the_state(conn: db.AsyncConn) -> None:
    queued = (await enqueue(conn, NewJob("noop"), TEST_ACTOR)).job
    with pytest.raises(queue.ActionRefused, match="it is 'queued'") as refused:
        await queue.pause(conn, queued["id"], "alice", "why not")
    assert isinstance(refused.value.__cause__, IllegalTransition)
    assert refused.value.state == "queued" and refused.value.allowed == []

    row = await running_job(conn)
    with pytest.raises(queue.ActionRefused, match=r"it is 'running'.*allowed from 'running': pause"):
        await queue.retry(conn, row["id"], "alice", "again")
    await queue.finish_many(conn, [(row, {"result": "ok"})], ACTOR)
    with pytest.raises(queue.ActionRefused, match=r"it is 'completed'.*it is final"):
        await queue.resume(conn, row["id"], "alice", "again")
    final = await get_job(conn, row["id"])
    assert final is not None and final["state"] == "completed"


async def test_a_reason_is_required(conn: db.AsyncConn) -> None:
    row = await running_job(conn)
    for reason in ("", "   "):
        with pytest.raises(ValueError, match="reason"):
            await queue.pause(conn, row["id"], "alice", reason)


async def test_abandon_of_an_unregistered_kind_needs_force(conn: db.AsyncConn) -> None:
    row = await running_job(conn, "mystery")
    await queue.pause(conn, row["id"], "alice", "hold")
    with pytest.raises(queue.ActionRefused, match="not registered"):
        await queue.abandon(conn, row["id"], "alice", "drop it", build_registry())
    gone = await queue.abandon(conn, row["id"], "alice", "drop it", None, force=True)
    assert gone["state"] == "abandoned"


def test_cli_lists_steers_and_reports_dwell(fresh_database: str, capsys: pytest.CaptureFixture[str]) -> None:
    async def prepare() -> uuid.UUID:
        conn = await db.connect(fresh_database)
        async with conn:
            row = await running_job(conn)
            await enqueue(conn, NewJob("noop"), TEST_ACTOR)
            job_id: uuid.UUID = row["id"]
            return job_id

    job_id = asyncio.run(prepare())
    url = ["--database-url", fresh_database]
    assert (
        cli_main(["jobs", "pause", str(job_id), "--reason", "investigating", "--operator", "carol", *url])
        == 0
    )
    assert "is now paused" in capsys.readouterr().out
    assert cli_main(["jobs", "pause", str(job_id), "--reason", "again", *url]) == exit_codes.CONFLICT
    assert "it is 'paused'" in capsys.readouterr().err
    assert cli_main(["jobs", "list", "--state", "paused", *url]) == 0
    out = capsys.readouterr().out
    assert str(job_id) in out and "paused" in out
    assert cli_main(["jobs", "list", "--json", *url]) == 0
    assert {j["state"] for j in json.loads(capsys.readouterr().out)} == {"paused", "queued"}
    assert cli_main(["jobs", "dwell", *url]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["state", "stays", "now_in", "p50_s", "p95_s", "max_s"]
    assert {line.split()[0] for line in table[1:]} == {"queued", "claimed", "running", "paused"}
    assert cli_main(["jobs", "dwell", "--json", "--entity", "instance", *url]) == 0
    assert json.loads(capsys.readouterr().out) == {"entity": "instance", "states": []}
    assert (
        cli_main(
            [
                "jobs",
                "abandon",
                str(job_id),
                "--reason",
                "x",
                "--force",
                *url,
            ]
        )
        == 0
    )
    assert "is now abandoned" in capsys.readouterr().out
