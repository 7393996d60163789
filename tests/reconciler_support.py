"""Helpers of the reconciler tests: a Reconciler on its own pool, passes beside a real worker,
instances walked along their lifecycle, a scripted provisioner, and reconciler processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue as thread_queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import DictRow

from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.queue import moves as queue
from controlplane.queue.registry import JobRegistry
from controlplane.queue.worker import Worker
from controlplane.runtime.settings import Settings
from provisioners.base import ConnectionInfo, Observation, Provisioner
from provisioners.noop import NoopProvisioner
from reconciler.maintenance import Maintenance
from reconciler.reconciler import Reconciler
from tests.factories import GONE_WORKER, walk
from tests.operations_support import Condition, registry_for, scalar
from tests.provisioning_support import connect

ROOT = Path(__file__).resolve().parent.parent
RECONCILER_ID = "reconciler-test"


@contextlib.asynccontextmanager
async def reconciling(
    settings: Settings,
    provisioner: Provisioner,
    *,
    reconciler_id: str = RECONCILER_ID,
    registry: JobRegistry | None = None,
    **options: Any,
) -> AsyncIterator[Reconciler]:
    """A Reconciler over `provisioner` on a pool of its own, with the leader's maintenance (`options`
    are the maintenance's), as the reconcile role builds it."""
    assert settings.database.url_value is not None
    pool = db.pool(
        settings.database.url_value,
        min_size=1,
        max_size=max(2, settings.reconciler.concurrency + 1),
        name=reconciler_id,
    )
    await pool.open(wait=True)
    maintenance = Maintenance(
        settings,
        pool,
        provisioner,
        registry or registry_for(provisioner),
        maintainer_id=reconciler_id,
        **options,
    )
    try:
        yield Reconciler(settings, pool, provisioner, reconciler_id=reconciler_id, maintenance=maintenance)
    finally:
        await maintenance.close()
        await pool.close()


def duties(reconciler: Reconciler) -> Maintenance:
    """The leader's maintenance of a Reconciler from `reconciling`."""
    assert reconciler.maintenance is not None
    return reconciler.maintenance


@contextlib.asynccontextmanager
async def working(
    settings: Settings, registry: JobRegistry, worker_id: str = "worker-test"
) -> AsyncIterator[Worker]:
    """A real worker running in this process until the block ends (then a graceful stop)."""
    assert settings.database.url_value is not None
    pool = db.pool(
        settings.database.url_value, min_size=1, max_size=settings.worker.concurrency + 3, name=worker_id
    )
    await pool.open(wait=True)
    worker = Worker(worker_id, settings, pool, registry)
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.request_stop()
        await task
        await pool.close()


@contextlib.asynccontextmanager
async def looping(reconciler: Reconciler) -> AsyncIterator[asyncio.Task[None]]:
    """The reconciler's own loop (`Reconciler.run`, real clock) until the block ends."""
    stop = asyncio.Event()
    task = asyncio.create_task(reconciler.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await task


async def passes_until(
    reconciler: Reconciler, done: Condition, *, timeout_s: float = 60, interval_s: float = 0.05
) -> int:
    """Run the leader's passes (real clock: its maintenance, then the instances) until `done`
    holds, as the loop would at a short interval.

    For conditions another actor (a worker) must bring about; returns the number of passes.
    """
    deadline = time.monotonic() + timeout_s
    passes = 0
    while True:
        await duties(reconciler).run_once()
        await reconciler.run_once()
        passes += 1
        async with reconciler.pool.connection() as conn:
            if await done(conn):
                return passes
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s}s ({passes} passes)")
        await asyncio.sleep(interval_s)


async def to_ready(conn: AsyncConn, instance_id: uuid.UUID) -> DictRow:
    return await walk(
        conn, instance_id, "start_provisioning", "provisioned", patch={"observed_generation": 1}
    )


async def finish_job(conn: AsyncConn, job_id: uuid.UUID, verdict: Mapping[str, Any]) -> DictRow:
    """A worker runs the queued job `job_id` and records `verdict` without moving its instance."""
    kind = await scalar(conn, "SELECT kind FROM jobs WHERE id = %s", (job_id,))
    claimed = await queue.claim(conn, GONE_WORKER.id, [kind], 1)
    assert [r["id"] for r in claimed] == [job_id], "the job was not the one claimable"
    (running,) = (await queue.start_many(conn, claimed, GONE_WORKER)).moved
    (done,) = (await queue.finish_many(conn, [(running, verdict)], GONE_WORKER)).moved
    return done


async def instance_events(conn: AsyncConn, instance_id: uuid.UUID) -> list[tuple[str | None, str, str, str]]:
    """(from, to, event, actor kind:id) of one instance, in order."""
    cursor = await conn.execute(
        "SELECT from_state, to_state, event, actor_kind, actor_id FROM instance_events"
        " WHERE instance_id = %s ORDER BY id",
        (instance_id,),
    )
    return [
        (r["from_state"], r["to_state"], r["event"], f"{r['actor_kind']}:{r['actor_id']}")
        for r in await cursor.fetchall()
    ]


async def live_jobs(conn: AsyncConn, instance_id: uuid.UUID) -> list[DictRow]:
    cursor = await conn.execute(
        "SELECT * FROM jobs WHERE instance_id = %s AND state NOT IN ('completed', 'abandoned')"
        " ORDER BY created_at",
        (instance_id,),
    )
    return await cursor.fetchall()


async def enqueued_by(conn: AsyncConn, job_id: uuid.UUID) -> str:
    cursor = await conn.execute(
        "SELECT actor_kind, actor_id FROM job_events WHERE job_id = %s AND event = 'enqueue'", (job_id,)
    )
    row = await cursor.fetchone()
    assert row is not None
    return f"{row['actor_kind']}:{row['actor_id']}"


async def next_fence(conn: AsyncConn) -> int:
    """A fence above every claim so far: what acting behind the control plane's back needs."""
    return int(await scalar(conn, "SELECT nextval('job_fence_seq')"))


class ScriptedProvisioner(NoopProvisioner):
    """The noop provisioner, except that `observe` shows what the test scripted for an instance."""

    name = "scripted"

    def __init__(self) -> None:
        self.seen: dict[uuid.UUID, Observation] = {}

    async def observe(self, instance_id: uuid.UUID) -> Observation:
        return self.seen.get(instance_id) or await super().observe(instance_id)


def read_only(info: ConnectionInfo) -> bool:
    """Whether a customer's write is refused even after asking for a read-write session."""
    with connect(info) as customer:
        customer.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE")
        try:
            customer.execute("CREATE TABLE probe (x int)")
        except psycopg.errors.ReadOnlySqlTransaction:
            return True
        customer.execute("DROP TABLE probe")
        return False


# ---- reconciler processes -----------------------------------------------------------------------


@dataclass
class ReconcilerProcess:
    """`controlplane reconcile` as a subprocess; its JSON log lines read by a thread, time-stamped."""

    name: str
    proc: subprocess.Popen[str]
    lines: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    _arrivals: thread_queue.Queue[tuple[float, dict[str, Any]]] = field(default_factory=thread_queue.Queue)
    _reader: threading.Thread | None = None

    @classmethod
    def start(cls, name: str, url: str, data_dir: Path, interval_s: float, **env: str) -> ReconcilerProcess:
        command = [
            sys.executable,
            "-m",
            "controlplane.cli",
            "reconcile",
            "--database-url",
            url,
            "--data-dir",
            str(data_dir),
            "--reconcile-interval-s",
            str(interval_s),
            "--log-format",
            "json",
            "--log-level",
            "DEBUG",
        ]
        environ = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        started = cls(name, proc)
        started._reader = threading.Thread(target=started._read, name=f"read-{name}", daemon=True)
        started._reader.start()
        return started

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                entry = {"msg": line.rstrip()}
            self._arrivals.put((time.monotonic(), entry))

    def _drain(self) -> None:
        while True:
            try:
                self.lines.append(self._arrivals.get_nowait())
            except thread_queue.Empty:
                return

    def wait_for(self, wanted: Callable[[dict[str, Any]], bool], timeout_s: float) -> float:
        """Read this process's output until a line matches; when that line arrived (monotonic)."""
        self._drain()
        for at, entry in self.lines:
            if wanted(entry):
                return at
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.proc.poll() is not None and self._arrivals.empty()):
                raise AssertionError(
                    f"{self.name}: no matching log line within {timeout_s}s; last lines: "
                    f"{[e.get('msg') for _, e in self.lines[-8:]]}"
                )
            try:
                at, entry = self._arrivals.get(timeout=min(remaining, 0.5))
            except thread_queue.Empty:
                continue
            self.lines.append((at, entry))
            if wanted(entry):
                return at

    def messages(self, msg: str) -> list[float]:
        """Arrival times of the lines read so far whose message is `msg`."""
        self._drain()
        return [at for at, entry in self.lines if entry.get("msg") == msg]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@contextlib.contextmanager
def reconciler_processes(
    url: str, data_dir: Path, names: tuple[str, ...], interval_s: float
) -> Iterator[dict[str, ReconcilerProcess]]:
    started = {name: ReconcilerProcess.start(name, url, data_dir, interval_s) for name in names}
    try:
        yield started
    finally:
        for process in started.values():
            process.stop()
