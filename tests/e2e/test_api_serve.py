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

from controlplane.api import watch
from controlplane.core import exit_codes, failures
from controlplane.db import connection as db
from controlplane.services import tenants
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
        code = failures.PLAN_CHANGE_FAILED
        patch = {"failure_reason": reason, "failure_code": code, "failed_generation": 2}
        await walk(conn, instance_id, "degrade", patch=patch)


def _ready_instance(served: Served, fresh_database: str) -> tuple[str, uuid.UUID]:
    """A new organisation's key, and its instance `orders` made ready."""
    key = asyncio.run(_org_key(fresh_database))
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as http:
        iid = uuid.UUID(http.post("/v1/instances", json={"name": "orders", "plan": "dev"}).json()["id"])
    asyncio.run(_to_ready(fresh_database, iid))
    return key, iid


def _cli(served: Served, key: str, *command: str) -> subprocess.Popen[str]:
    env = {**os.environ, "CONTROLPLANE_URL": served.url, "CONTROLPLANE_API_KEY": key}
    return subprocess.Popen(
        [sys.executable, "-m", "controlplane.cli", *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_resize_wait_ends_with_a_one_line_error_when_the_update_is_given_up(
    served: Served, fresh_database: str
) -> None:
    key, iid = _ready_instance(served, fresh_database)
    resize = _cli(served, key, "instances", "resize", str(iid), "--plan", "small", "--wait")
    try:
        asyncio.run(_update_given_up(fresh_database, iid))
        out, err = resize.communicate(timeout=30)
    finally:
        resize.kill()
    assert resize.returncode == exit_codes.FAILED, (out, err)
    # The customer's words for the coded reason (the raw error is for SREs only).
    message = failures.reason(failures.PLAN_CHANGE_FAILED).message
    assert err.strip().splitlines() == [
        f"controlplane: error: resize to small did not complete: instance is degraded ({message})"
    ]


async def _billing_hold(url: str, instance_id: uuid.UUID, *events: str, on: bool) -> None:
    """The instance's organisation put on (or off) billing hold, then the instance moved by `events`
    (the first one suspending or resuming it by billing)."""
    conn = await db.connect(url)
    async with conn:
        await conn.execute(
            "UPDATE organisations SET billing_hold = %s"
            " WHERE id = (SELECT org_id FROM instances WHERE id = %s)",
            (on, instance_id),
        )
        await walk(conn, instance_id, events[0], patch={"suspended_by_billing": on})
        for event, patch in zip(events[1:], ({}, {"observed_generation": 2}), strict=False):
            await walk(conn, instance_id, event, patch=patch)


def test_resize_wait_on_a_suspended_instance_says_the_change_is_recorded_and_exits_or_waits_for_resume(
    served: Served, fresh_database: str
) -> None:
    key, iid = _ready_instance(served, fresh_database)
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as http:
        asyncio.run(_billing_hold(fresh_database, iid, "suspend", on=True))
        recorded = (
            f"controlplane: resize to small is recorded (spec generation 2); {iid} is suspended by a"
            " billing hold: the change is applied once the hold ends and it resumes; "
        )

        # --wait: it says so at once, and exits (9: recorded, not applied yet).
        resize = _cli(served, key, "instances", "resize", str(iid), "--plan", "small", "--wait", "--json")
        try:
            out, err = resize.communicate(timeout=30)
        finally:
            resize.kill()
        assert resize.returncode == exit_codes.RECORDED, (out, err)
        assert err.splitlines() == [recorded + "pass --wait-for-resume to wait for that"]
        assert json.loads(out)["state"] == "suspended"
        shown = http.get(f"/v1/instances/{iid}").json()
        assert (shown["plan"], shown["spec_generation"], shown["observed_generation"]) == ("small", 2, 1)

        # --wait-for-resume: it says so at once, and waits until the hold ends and the change is applied.
        resize = _cli(served, key, "instances", "resize", str(iid), "--plan", "small", "--wait-for-resume")
        try:
            assert resize.stderr is not None
            assert resize.stderr.readline().rstrip("\n") == recorded + "waiting for that (--wait-for-resume)"
            assert resize.poll() is None
            # The hold ends: it resumes, and the update the reconciler then enqueues runs.
            asyncio.run(_billing_hold(fresh_database, iid, "resume", "update", "updated", on=False))
            out, err = resize.communicate(timeout=30)
        finally:
            resize.kill()
        applied = http.get(f"/v1/instances/{iid}").json()
    assert resize.returncode == 0, (out, err)
    # It ends as `create --wait` does: the instance ready (on its new plan), then its URI.
    assert f"({iid}) is ready on plan small" in out
    assert (applied["state"], applied["observed_generation"]) == ("ready", 2)


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
