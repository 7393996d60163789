"""F9: a worker whose clock is 10 minutes ahead or behind (libfaketime, LD_PRELOADed into the worker
process alone): leases are kept in database time, so its job is neither reclaimed early nor stuck."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controlplane.audit import verify as audit
from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.db.job_rows import NewJob, enqueue
from controlplane.queue.supervisor import Supervisor
from controlplane.runtime.settings import Settings
from tests.factories import TEST_ACTOR
from tests.operations_support import scalar
from tests.queue_kinds import build_registry, create_tables
from tests.support import ROOT

pytestmark = pytest.mark.timeout(120)

LIBFAKETIME = sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))


def skewed_worker(url: str, worker_id: str, skew: str, logs: Path) -> subprocess.Popen[bytes]:
    """tests.worker_process with its clock (wall and monotonic) shifted by `skew`."""
    assert LIBFAKETIME, "libfaketime is missing: `python3 dev.py test` installs it (Debian libfaketime)"
    env = {"LD_PRELOAD": str(LIBFAKETIME[0]), "FAKETIME": skew, "FAKETIME_NO_CACHE": "1"}
    command = [sys.executable, "-m", "tests.worker_process", "--database-url", url, "--worker-id", worker_id]
    with (logs / f"{worker_id}.log").open("wb") as log:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.parametrize("skew", ["+10m", "-10m"])
async def test_f9_worker_clock_skewed_by_ten_minutes(
    conn: AsyncConn, fresh_database: str, settings: Settings, tmp_path: Path, skew: str
) -> None:
    await create_tables(conn)
    worker_id = f"skewed{skew[0]}"
    probe = subprocess.run(
        [sys.executable, "-c", "import time; print(int(time.time()))"],
        env={"LD_PRELOAD": str(LIBFAKETIME[0]), "FAKETIME": skew},
        capture_output=True,
        text=True,
        check=True,
    )
    assert abs(abs(int(probe.stdout) - time.time()) - 600) < 30  # the skew is real in that process
    # Three seconds of work, several heartbeats; reclaimed after 1 s of silence in database time.
    job = (await enqueue(conn, NewJob("record", payload={"seconds": 3}), TEST_ACTOR)).job
    tuned = settings.replace(heartbeat_interval_s=0.2, reclaim_after_intervals=5)
    worker = skewed_worker(fresh_database, worker_id, skew, tmp_path)
    pool = db.pool(fresh_database, max_size=2, name="clock-supervisor")
    try:
        async with pool:
            supervisor = Supervisor(pool, tuned, build_registry(), supervisor_id="sup")
            deadline = time.monotonic() + 60
            while (await _job(conn, job["id"]))["state"] != "completed":
                assert worker.poll() is None, (tmp_path / f"{worker_id}.log").read_text()[-2000:]
                assert time.monotonic() < deadline, f"job stuck: {await _job(conn, job['id'])}"
                passed = await supervisor.run_once()
                assert not passed.reclaimed, passed
                await asyncio.sleep(0.1)
    finally:
        worker.terminate()
        worker.wait(timeout=20)
    done = await _job(conn, job["id"])
    assert (done["attempt"], done["claimed_by"]) == (1, worker_id)
    assert (
        await scalar(
            conn, "SELECT count(*) FROM job_events WHERE job_id = %s AND event = 'reclaim'", (job["id"],)
        )
        == 0
    )
    assert await scalar(conn, "SELECT count(*) FROM test_executions") == 1
    assert await audit.verify(conn) == []


async def _job(conn: AsyncConn, job_id: object) -> dict[str, object]:
    cursor = await conn.execute("SELECT * FROM jobs WHERE id = %s", (job_id,))
    row = await cursor.fetchone()
    assert row is not None
    return dict(row)
