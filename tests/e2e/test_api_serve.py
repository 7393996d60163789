"""The API under uvicorn on a real socket: it serves, and a watcher that hangs up frees its connection."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controlplane import db, failures, tenants
from controlplane.api import watch
from tests.factories import walk
from tests.queue_kinds import until
from tests.reconciler_support import to_ready

SERVE = (
    "import sys; from controlplane.api.app import serve; from controlplane.settings import load;"
    " serve(load(database_url=sys.argv[1], api_port=int(sys.argv[2]), data_dir=sys.argv[3]))"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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
def served(fresh_database: str, tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE, fresh_database, str(port), str(tmp_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"the API did not start: {process.stderr.read() if process.stderr else ''!r}"
                )
            time.sleep(0.1)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_served_by_uvicorn_and_a_watcher_that_leaves_frees_its_connection(
    served: str, fresh_database: str
) -> None:
    key = asyncio.run(_org_key(fresh_database))
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=served, headers=headers, timeout=10) as http:
        created = http.post("/v1/instances", json={"name": "orders", "plan": "dev"})
        assert created.status_code == 202 and created.headers["location"].endswith(created.json()["id"])
        with http.stream("GET", f"/v1/instances/{created.json()['id']}/watch") as stream:
            lines = stream.iter_lines()  # kept: dropping the iterator would close the stream
            assert next(lines) == "event: instance"
            assert _eventually(fresh_database, 1)
        assert _eventually(fresh_database, 0)  # the client hung up: the stream ended, its connection closed
        assert http.get("/healthz").json()["status"] == "ok"


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


def test_resize_wait_ends_with_a_one_line_error_when_the_update_is_given_up(
    served: str, fresh_database: str
) -> None:
    key = asyncio.run(_org_key(fresh_database))
    with httpx.Client(base_url=served, headers={"Authorization": f"Bearer {key}"}, timeout=10) as http:
        iid = uuid.UUID(http.post("/v1/instances", json={"name": "orders", "plan": "dev"}).json()["id"])
    asyncio.run(_to_ready(fresh_database, iid))
    env = {**os.environ, "CONTROLPLANE_URL": served, "CONTROLPLANE_API_KEY": key}
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
    # The customer's words for the coded reason (the raw error is for SREs only).
    message = failures.reason(failures.PLAN_CHANGE_FAILED).message
    assert err.strip().splitlines() == [
        f"controlplane: error: resize to small did not complete: instance is degraded ({message})"
    ]
