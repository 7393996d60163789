"""The API under uvicorn on a real socket: it serves, and a watcher that hangs up frees its connection."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controlplane import db, tenants
from controlplane.api import watch
from tests.factories import walk
from tests.queue_kinds import until
from tests.reconciler_support import to_ready
from tests.up_support import Served


async def _org_key(url: str) -> str:
    conn = await db.connect(url)
    async with conn:
        _, key = await tenants.create_org(conn, "served")
    return key.plaintext


async def _watchers(url: str) -> int:
    conn = await db.connect(url)
    async with conn:
        cursor = await conn.execute(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = %s",
            (watch.APPLICATION_NAME,),
        )
        row = await cursor.fetchone()
    return int(row["n"]) if row else 0


def _eventually(url: str, watchers: int) -> bool:
    deadline = time.monotonic() + 10
    while asyncio.run(_watchers(url)) != watchers:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def served(fresh_database: str, tmp_path: Path) -> Iterator[Served]:
    server = Served(fresh_database, tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def _to_ready(url: str, instance_id: uuid.UUID) -> None:
    conn = await db.connect(url)
    async with conn:
        await to_ready(conn, instance_id)


async def _update_given_up(url: str, instance_id: uuid.UUID) -> None:
    """Once the resize's update job is queued, the update runs and is given up (as the abandoned
    job's hook does)."""

    async def resized(conn: db.AsyncConn) -> bool:
        cursor = await conn.execute("SELECT count(*) AS n FROM jobs WHERE kind = 'update'")
        row = await cursor.fetchone()
        return bool(row and row["n"])

    await until(url, resized, channels=("cp_job_queued",))
    conn = await db.connect(url)
    async with conn:
        await walk(conn, instance_id, "update")
        reason = "update failed after 1 attempt(s): apply_plan: plan small cannot be applied here"
        await walk(conn, instance_id, "degrade", patch={"failure_reason": reason, "failed_generation": 2})


def test_resize_wait_ends_with_a_one_line_error_when_the_update_is_given_up(
    served: Served, fresh_database: str
) -> None:
    key = asyncio.run(_org_key(fresh_database))
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as http:
        iid = uuid.UUID(http.post("/v1/instances", json={"name": "orders", "plan": "dev"}).json()["id"])
    asyncio.run(_to_ready(fresh_database, iid))
    env = {**os.environ, "CONTROLPLANE_URL": served.url, "CONTROLPLANE_API_KEY": key}
    resize = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "controlplane.cli",
            "instances",
            "resize",
            str(iid),
            "--plan",
            "small",
            "--wait",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        asyncio.run(_update_given_up(fresh_database, iid))
        out, err = resize.communicate(timeout=30)
    finally:
        resize.kill()
    assert resize.returncode == 1, (out, err)
    assert err.strip().splitlines() == [
        "controlplane: error: resize to small did not complete: instance is degraded"
        " (update failed after 1 attempt(s): apply_plan: plan small cannot be applied here)"
    ]


def test_watchers_share_one_connection_sigterm_ends_their_streams_and_the_cli_resumes_after_a_restart(
    served: Served, fresh_database: str
) -> None:
    key = asyncio.run(_org_key(fresh_database))
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=served.url, headers=headers, timeout=10) as http:
        created = http.post("/v1/instances", json={"name": "orders", "plan": "dev"})
        assert created.status_code == 202 and created.headers["location"].endswith(created.json()["id"])
        iid = uuid.UUID(created.json()["id"])
        env = {**os.environ, "CONTROLPLANE_URL": served.url, "CONTROLPLANE_API_KEY": key}
        watching = subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", "instances", "watch", str(iid), "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert watching.stdout is not None
        try:
            with http.stream("GET", f"/v1/instances/{iid}/watch") as other:
                lines = other.iter_lines()  # kept: dropping it would close the stream
                assert next(line for line in lines if line.startswith("event:")) == "event: instance"
                assert json.loads(watching.stdout.readline())["state"] == "pending"
                assert _eventually(fresh_database, 1)  # two watchers, one LISTEN connection
                asyncio.run(_drive(fresh_database, iid, "start_provisioning"))
                assert json.loads(watching.stdout.readline())["state"] == "provisioning"
                # SIGTERM (a rollout): the streams end at once, and the process exits without
                # waiting for its watchers to hang up.
                assert served.process is not None
                served.process.terminate()
                assert [line for line in lines if line.startswith("event:")][-1:] == ["event: transition"]
                assert served.process.wait(timeout=10) == 0
            # What happens while no API runs is not lost: the CLI resumes with Last-Event-ID.
            asyncio.run(_drive(fresh_database, iid, "provisioned"))
            served.start()
            asyncio.run(_drive(fresh_database, iid, "deprovision", "deprovisioned"))
            out, err = watching.communicate(timeout=30)
        finally:
            watching.kill()
    assert watching.returncode == 0, err
    states = [json.loads(line)["state"] for line in out.splitlines()]
    assert states == ["ready", "deprovisioning", "deleted"]  # each once, in order, then it ends


async def _drive(url: str, instance_id: uuid.UUID, *events: str) -> None:
    conn = await db.connect(url)
    async with conn:
        await walk(conn, instance_id, *events)
