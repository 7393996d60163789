"""Faults caused on purpose with real worker processes: kill -9, PostgreSQL restart, SIGTERM, a drain."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from controlplane.audit import verify as audit
from controlplane.db import connection as db
from controlplane.db.job_rows import NewJob, enqueue_many
from controlplane.queue.supervisor import Supervisor
from controlplane.runtime.settings import Settings
from tests.factories import TEST_ACTOR
from tests.operations_support import scalar
from tests.queue_kinds import build_registry, count_in, create_tables, events_of, until
from tests.support import ROOT

if TYPE_CHECKING:
    from tests.conftest import TestServer

# A fault that leaves something hanging fails its test instead of stalling the run.
pytestmark = pytest.mark.timeout(150)


class Workers:
    """Worker processes (python -m tests.worker_process), each logging to its own file."""

    def __init__(self, url: str, logs: Path) -> None:
        self.url = url
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, worker_id: str, *flags: str) -> subprocess.Popen[bytes]:
        with (self.logs / f"{worker_id}.log").open("wb") as log:
            command = [sys.executable, "-m", "tests.worker_process", "--database-url", self.url]
            proc = subprocess.Popen(
                [*command, "--worker-id", worker_id, *flags],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs[worker_id] = proc
        return proc

    def terminate_all(self, timeout: float = 20) -> dict[str, int]:
        """SIGTERM every live worker; their exit codes."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        return {name: proc.wait(timeout=timeout) for name, proc in self.procs.items()}

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def log_text(self) -> str:
        return "".join(p.read_text() for p in sorted(self.logs.glob("*.log")))


@pytest.fixture
def workers(fresh_database: str, tmp_path: Path) -> Iterator[Workers]:
    logs = tmp_path / "worker-logs"
    logs.mkdir()
    group = Workers(fresh_database, logs)
    try:
        yield group
    finally:
        group.kill_all()


@contextlib.asynccontextmanager
async def supervising(url: str, settings: Settings, interval_s: float = 0.1) -> AsyncIterator[Supervisor]:
    """A supervisor loop (real clock) in this process, on its own pool."""
    pool = db.pool(url, max_size=2, name="test-supervisor")
    await pool.open(wait=True)
    supervisor = Supervisor(pool, settings, build_registry(), supervisor_id="sup")
    stop = asyncio.Event()
    loop = asyncio.create_task(supervisor.run(stop, interval_s))
    try:
        yield supervisor
    finally:
        stop.set()
        await asyncio.wait_for(loop, timeout=40)
        await pool.close()


def running_by(worker: str, n: int) -> Any:
    async def check(conn: db.AsyncConn) -> bool:
        return bool(
            await scalar(
                conn,
                "SELECT count(*) = %s FROM jobs WHERE state = 'running' AND claimed_by = %s",
                (n, worker),
            )
        )

    return check


def listeners(n: int) -> Any:
    async def check(conn: db.AsyncConn) -> bool:
        return bool(
            await scalar(
                conn,
                "SELECT count(*) >= %s FROM pg_stat_activity"
                " WHERE datname = current_database() AND query = 'LISTEN cp_job_queued'",
                (n,),
            )
        )

    return check


def executions(n: int) -> Any:
    async def check(conn: db.AsyncConn) -> bool:
        return bool(await scalar(conn, "SELECT count(*) = %s FROM test_executions", (n,)))

    return check


async def finishes_per_job(conn: db.AsyncConn) -> dict[int, int]:
    """How many jobs were finished 0, 1, 2... times."""
    cursor = await conn.execute(
        "SELECT n, count(*) AS jobs FROM (SELECT j.id, count(e.id) AS n FROM jobs j"
        " LEFT JOIN job_events e ON e.job_id = j.id AND e.event = 'finish' GROUP BY j.id) f GROUP BY n"
    )
    return {int(r["n"]): int(r["jobs"]) for r in await cursor.fetchall()}


async def test_sigterm_hands_back_a_long_job_and_exits_0(
    fresh_database: str, conn: db.AsyncConn, workers: Workers
) -> None:
    (made,) = await enqueue_many(conn, [NewJob("sleep", payload={"seconds": 120})], TEST_ACTOR)
    proc = workers.start("w-term", "--shutdown-grace", "0.3")
    await until(fresh_database, running_by("w-term", 1), channels=("cp_job_running",))
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 20) == 0
    print(f"\nSIGTERM to exit with a job handed back: {time.monotonic() - began:.2f}s")
    assert await events_of(conn, made.job["id"]) == [
        ("enqueue", "system", "tests"),
        ("claim", "worker", "w-term"),
        ("start", "worker", "w-term"),
        ("reclaim", "worker", "w-term"),
    ]
    assert await scalar(conn, "SELECT state FROM jobs WHERE id = %s", (made.job["id"],)) == "queued"


async def test_kill_9_jobs_are_reclaimed_and_completed_by_another_worker(
    fresh_database: str, conn: db.AsyncConn, settings: Settings, workers: Workers
) -> None:
    await create_tables(conn)
    # Slow on the first attempt only: the killed worker hangs in them, the next one is quick.
    made = await enqueue_many(
        conn, [NewJob("record", payload={"seconds": 120, "slow_attempts": 1}) for _ in range(6)], TEST_ACTOR
    )
    victim = workers.start("w-victim", "--concurrency", "4")
    await until(fresh_database, running_by("w-victim", 4), channels=("cp_job_running",))
    await poll_until(fresh_database, executions(4))  # its handlers got as far as recording their run
    # Two more held as claimed by the same worker (it dies between claim and start for these).
    from controlplane.queue import moves as queue

    held_claimed = await queue.claim(conn, "w-victim", ["record"], 2)
    assert len(held_claimed) == 2
    victim.kill()  # SIGKILL: no shutdown, no hand-back
    victim.wait()
    killed_at = await scalar(conn, "SELECT now()")
    began = time.monotonic()
    async with supervising(fresh_database, settings):
        workers.start("w-rescue", "--concurrency", "8")
        await until(fresh_database, count_in("completed", 6), timeout=30)
    completed_after = time.monotonic() - began
    reclaim_at = await scalar(
        conn, "SELECT max(at) FROM job_events WHERE event = 'reclaim' AND actor_kind = 'supervisor'"
    )
    reclaim_s = (reclaim_at - killed_at).total_seconds()
    print(
        f"\nkill -9: all 6 jobs reclaimed {reclaim_s:.2f}s after the kill "
        f"(threshold {settings.worker.reclaim_after_s:g}s), all completed by another worker "
        f"after {completed_after:.2f}s"
    )
    assert reclaim_s >= settings.worker.reclaim_after_s - 0.5
    assert workers.terminate_all() == {"w-victim": -signal.SIGKILL, "w-rescue": 0}

    assert await finishes_per_job(conn) == {1: 6}  # none lost, none completed twice
    for job in made:
        events = await events_of(conn, job.job["id"])
        assert ("reclaim", "supervisor", "sup") in events
        assert events[-1] == ("finish", "worker", "w-rescue")
    cursor = await conn.execute("SELECT worker_id, attempt, count(*) AS n FROM test_executions GROUP BY 1, 2")
    runs = {(r["worker_id"], r["attempt"]): r["n"] for r in await cursor.fetchall()}
    assert runs == {("w-victim", 1): 4, ("w-rescue", 2): 6}
    assert await audit.verify(conn) == []


async def test_kill_9_with_a_job_started_but_waiting_for_a_slot_loses_nothing_and_runs_it_once(
    fresh_database: str, conn: db.AsyncConn, settings: Settings, workers: Workers
) -> None:
    await create_tables(conn)
    victim = workers.start("w-victim", "--concurrency", "2")
    # Quick handlers first: the worker then claims ahead of its free slots.
    await enqueue_many(conn, [NewJob("noop") for _ in range(10)], TEST_ACTOR)
    await until(fresh_database, count_in("completed", 10), channels=("cp_job_completed",))
    # Three jobs in one statement, slow on their first attempt: two run, one waits for a slot.
    made = await enqueue_many(
        conn, [NewJob("record", payload={"seconds": 120, "slow_attempts": 1}) for _ in range(3)], TEST_ACTOR
    )
    await until(fresh_database, running_by("w-victim", 3), channels=("cp_job_running",))
    await poll_until(fresh_database, executions(2))
    victim.kill()  # SIGKILL, with one job started in the database whose handler never began
    victim.wait()
    async with supervising(fresh_database, settings):
        workers.start("w-rescue", "--concurrency", "8")
        await until(fresh_database, count_in("completed", 13), timeout=30)
    assert workers.terminate_all() == {"w-victim": -signal.SIGKILL, "w-rescue": 0}
    assert await finishes_per_job(conn) == {1: 13}
    cursor = await conn.execute("SELECT worker_id, count(*) AS n FROM test_executions GROUP BY 1")
    assert {r["worker_id"]: r["n"] for r in await cursor.fetchall()} == {"w-victim": 2, "w-rescue": 3}
    for job in made:
        events = await events_of(conn, job.job["id"])
        assert [e for e, _, _ in events] == [
            "enqueue",
            "claim",
            "start",
            "reclaim",
            "claim",
            "start",
            "finish",
        ]
        assert events[-1] == ("finish", "worker", "w-rescue")
    assert await audit.verify(conn) == []


async def test_workers_survive_a_postgresql_restart(
    fresh_database: str, settings: Settings, workers: Workers, test_server: TestServer
) -> None:
    if test_server.embedded is None:
        pytest.skip("the test server is external: it cannot be restarted here")
    server = test_server.embedded.server
    log_start = server.logfile.stat().st_size if server.logfile.exists() else 0
    total = 300
    conn = await db.connect(fresh_database)
    async with conn:
        await create_tables(conn)
        await enqueue_many(
            conn, [NewJob("record", payload={"seconds": 0.05}) for _ in range(total)], TEST_ACTOR
        )
    async with supervising(fresh_database, settings):
        for name in ("w-r1", "w-r2"):
            workers.start(name, "--concurrency", "4", "--poll-interval", "0.2")
        await until(fresh_database, count_in("completed", total // 4, at_least=True), timeout=60)
        began = time.monotonic()
        await asyncio.to_thread(server.restart)
        print(f"\nPostgreSQL restarted in {time.monotonic() - began:.2f}s while 2 workers ran")
        await until(fresh_database, count_in("completed", total), timeout=90)
        print(f"all {total} jobs completed {time.monotonic() - began:.2f}s after the restart began")
        await poll_until(fresh_database, listeners(2))  # both workers listen again
    assert all(proc.poll() is None for proc in workers.procs.values()), "a worker died with the server"
    assert workers.terminate_all() == {"w-r1": 0, "w-r2": 0}
    conn = await db.connect(fresh_database)
    async with conn:
        assert await finishes_per_job(conn) == {1: total}
        assert await audit.verify(conn) == []
        retried = await scalar(conn, "SELECT count(*) FROM job_events WHERE event IN ('reclaim', 'error')")
        print(f"jobs reclaimed or failed by the restart (then retried): {retried}")
    text = workers.log_text().lower()
    assert "illegal transition" not in text and "invariant violation" not in text
    with server.logfile.open("rb") as handle:
        handle.seek(log_start)
        assert b"illegal transition" not in handle.read()


async def test_four_workers_drain_2000_jobs_each_exactly_once(
    fresh_database: str, conn: db.AsyncConn, workers: Workers
) -> None:
    total = 2000
    await create_tables(conn)
    for i in range(4):
        workers.start(f"w-d{i}", "--concurrency", "16", "--log-level", "WARNING")
    await poll_until(fresh_database, listeners(4))
    made = await enqueue_many(conn, [NewJob("record") for _ in range(total)], TEST_ACTOR)
    await until(fresh_database, count_in("completed", total), channels=("cp_job_completed",), timeout=120)
    seconds = await scalar(
        conn,
        "SELECT extract(epoch FROM max(at) FILTER (WHERE event = 'finish') - min(at))::float8"
        " FROM job_events",
    )
    print(f"\ndrain: {total} jobs by 4 worker processes in {seconds:.2f}s = {total / seconds:.0f} jobs/s")
    assert workers.terminate_all() == {f"w-d{i}": 0 for i in range(4)}

    assert len(made) == total
    assert await finishes_per_job(conn) == {1: total}
    cursor = await conn.execute(
        "SELECT job_id, array_agg(event ORDER BY id) AS events FROM job_events GROUP BY job_id"
    )
    sequences = {tuple(r["events"]) for r in await cursor.fetchall() if "reclaim" not in r["events"]}
    assert sequences == {("enqueue", "claim", "start", "finish")}
    executions = await scalar(conn, "SELECT count(DISTINCT job_id) = count(*) FROM test_executions")
    assert executions is True
    per_worker = await conn.execute("SELECT worker_id, count(*) AS n FROM test_executions GROUP BY 1")
    print("per worker:", {r["worker_id"]: r["n"] for r in await per_worker.fetchall()})
    assert await audit.verify(conn) == []


async def poll_until(url: str, condition: Any, timeout: float = 30) -> None:
    """For conditions no notification announces, that another process must bring about: poll."""
    deadline = time.monotonic() + timeout
    conn = await db.connect(url)
    async with conn:
        while not await condition(conn):
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met within {timeout}s")
            await asyncio.sleep(0.05)
