"""The control plane's PostgreSQL killed (kill -9 of the postmaster) and started again, on a server of
the test's own with the durable settings: under load, every acknowledged write survives and
nothing is half-applied (F7); creates with an Idempotency-Key in flight are retried by their
clients into one instance per key (F8)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controlplane.audit import verify as audit
from controlplane.db import connection as db
from controlplane.db.job_rows import NewJob, enqueue
from controlplane.queue.supervisor import Supervisor
from controlplane.queue.worker import Worker
from controlplane.runtime.embedded import SERVER_SETTINGS, EmbeddedDatabase, open_embedded
from controlplane.runtime.postgres import PostgresError
from controlplane.runtime.settings import Settings
from tests.api_support import make_tenant, serving
from tests.factories import TEST_ACTOR
from tests.provisioning_support import pg_bindir
from tests.queue_kinds import build_registry
from tests.support import eventually
from tests.up_support import scratch_dir

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def own_server() -> Iterator[tuple[EmbeddedDatabase, str]]:
    """A PostgreSQL of this test alone (durable, as in production), migrated."""
    with scratch_dir("cp-crash-") as root:
        server = open_embedded(root / "db", SERVER_SETTINGS, bindir=pg_bindir())
        try:
            url = server.create_database()
            db.migrate(url)
            yield server, url
        finally:
            server.stop()


def crash_and_restart(server: EmbeddedDatabase) -> None:
    """kill -9 of the postmaster (its backends die with it), then a start: crash recovery."""
    pid = int((server.server.datadir / "postmaster.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    server.server.wait_until_down(30)
    deadline = time.monotonic() + 60
    while True:  # its orphaned backends hold the lock file a moment longer: start again, as `up` does
        try:
            server.server.start(30)
            return
        except PostgresError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


async def test_f7_postgresql_crash_under_load(
    own_server: tuple[EmbeddedDatabase, str], tmp_path: Path
) -> None:
    server, url = own_server
    settings = Settings(database_url=url, data_dir=tmp_path, heartbeat_interval_s=0.2, poll_interval_s=0.1)
    acknowledged: list[uuid.UUID] = []
    stop = asyncio.Event()

    async def enqueuer() -> None:
        """Enqueue noop jobs one commit at a time; a job counts once its commit is acknowledged."""
        while not stop.is_set():
            try:
                conn = await db.connect(url)
                async with conn:
                    while not stop.is_set():
                        acknowledged.append((await enqueue(conn, NewJob("noop"), TEST_ACTOR)).job["id"])
            except Exception:  # the server went away: connect again
                await asyncio.sleep(0.2)

    pool = db.pool(url, max_size=12, name="crash-worker")
    async with pool:
        worker = Worker("crash-worker", settings, pool, build_registry())
        running = asyncio.create_task(worker.run())
        try:
            writers = [asyncio.create_task(enqueuer()) for _ in range(4)]
            await eventually(
                lambda: len(acknowledged) >= 200 and worker.counts["completed"] >= 50,
                lambda: (len(acknowledged), dict(worker.counts)),
                60,
            )
            before, done = len(acknowledged), worker.counts["completed"]
            await asyncio.to_thread(crash_and_restart, server)
            await eventually(  # both sides came back
                lambda: len(acknowledged) >= before + 200 and worker.counts["completed"] >= done + 50,
                lambda: (before, len(acknowledged), dict(worker.counts)),
                60,
            )
            stop.set()
            await asyncio.gather(*writers)
            conn = await db.connect(url)
            async with conn:
                # Jobs whose claim or finish was lost with the crash are reclaimed and run again.
                supervisor = Supervisor(pool, settings, build_registry(), supervisor_id="sup")

                async def drained() -> bool:
                    await supervisor.run_once()
                    return await _all_done(conn)

                await eventually(drained, "every acknowledged job is drained", 90)
                cursor = await conn.execute("SELECT id, state, state_version FROM jobs")
                rows = {r["id"]: r for r in await cursor.fetchall()}
                assert set(acknowledged) <= rows.keys()  # every acknowledged enqueue survived
                cursor = await conn.execute(
                    "SELECT job_id, count(*) FILTER (WHERE event = 'finish') AS finishes, count(*) AS events"
                    " FROM job_events GROUP BY job_id"
                )
                per_job = {r["job_id"]: r for r in await cursor.fetchall()}
                # Nothing half-applied: each row's version is its number of moves (one event each),
                # and each job was finished exactly once.
                assert [i for i in rows if per_job[i]["finishes"] != 1] == []
                assert [i for i in rows if per_job[i]["events"] != rows[i]["state_version"] + 1] == []
                assert await audit.verify(conn) == []
        finally:
            stop.set()
            worker.request_stop()
            await asyncio.wait_for(running, timeout=30)


async def test_f8_postgresql_restart_with_idempotent_creates_in_flight(
    own_server: tuple[EmbeddedDatabase, str], tmp_path: Path
) -> None:
    server, url = own_server
    # No per-key limit: 24 clients retrying through the restart pass 600 a minute on a fast machine,
    # and 429 is not what this test is about (tests/integration/test_rate_limits.py is).
    settings = Settings(database_url=url, data_dir=tmp_path, api_rate_limit=0)
    conn = await db.connect(url)
    async with conn:
        tenant = await make_tenant(conn, "in-flight")
    keys = [str(uuid.uuid4()) for _ in range(24)]
    answered: dict[str, str] = {}
    async with serving(settings) as client:

        async def create_until_answered(n: int, key: str) -> None:
            """A client: POST, and on a 5xx, a 409 in flight or no answer, the same POST again."""
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    response = await client.post(
                        "/v1/instances",
                        json={"name": f"flight-{n}", "plan": "dev"},
                        headers=tenant.headers | {"Idempotency-Key": key},
                    )
                    if response.status_code == 202:
                        answered[key] = response.json()["id"]
                        return
                    assert response.status_code in (409, 503), response.text
                await asyncio.sleep(0.1)

        first = [asyncio.create_task(create_until_answered(n, k)) for n, k in enumerate(keys[:12])]
        await asyncio.sleep(0)  # the first ones are on their way
        restart = asyncio.create_task(asyncio.to_thread(crash_and_restart, server))
        later = [asyncio.create_task(create_until_answered(n + 12, k)) for n, k in enumerate(keys[12:])]
        await restart
        await asyncio.wait_for(asyncio.gather(*first, *later), timeout=120)
        # Every client's key again: the stored answer, the same instance.
        for n, key in enumerate(keys):
            again = await client.post(
                "/v1/instances",
                json={"name": f"flight-{n}", "plan": "dev"},
                headers=tenant.headers | {"Idempotency-Key": key},
            )
            assert again.status_code == 202 and again.json()["id"] == answered[key]
    conn = await db.connect(url)
    async with conn:
        cursor = await conn.execute("SELECT id::text AS id FROM instances")
        assert sorted(r["id"] for r in await cursor.fetchall()) == sorted(answered.values())  # no orphan
        cursor = await conn.execute("SELECT key, response->>'id' AS id FROM idempotency_keys")
        assert {r["key"]: r["id"] for r in await cursor.fetchall()} == answered
        cursor = await conn.execute(
            "SELECT instance_id FROM jobs WHERE kind = 'provision' GROUP BY instance_id HAVING count(*) <> 1"
        )
        assert await cursor.fetchall() == []
        assert await audit.verify(conn) == []


async def _all_done(conn: db.AsyncConn) -> bool:
    cursor = await conn.execute("SELECT count(*) AS n FROM jobs WHERE state <> 'completed'")
    row = await cursor.fetchone()
    return row is not None and row["n"] == 0
