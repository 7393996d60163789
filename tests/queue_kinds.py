"""Job kinds for queue and worker tests: noop, sleep, failures, and one that records each execution."""

from __future__ import annotations

import asyncio
from typing import Any

from controlplane.core.step_errors import PermanentError, TemporaryError
from controlplane.db.connection import AsyncConn
from controlplane.queue.registry import JobContext, JobKind, JobRegistry, Verdict

EXECUTIONS_DDL = """
CREATE TABLE IF NOT EXISTS test_executions (
    id bigserial PRIMARY KEY,
    job_id uuid NOT NULL,
    fence bigint NOT NULL,
    attempt int NOT NULL,
    worker_id text NOT NULL,
    at timestamptz NOT NULL DEFAULT now()
)
"""


async def create_tables(conn: AsyncConn) -> None:
    await conn.execute(EXECUTIONS_DDL)


async def _slow(ctx: JobContext) -> None:
    """Sleep payload['seconds'] on attempts up to payload['slow_attempts'] (default: every one)."""
    seconds = float(ctx.payload.get("seconds", 0))
    if seconds > 0 and ctx.attempt <= int(ctx.payload.get("slow_attempts", 1_000_000)):
        await asyncio.sleep(seconds)


async def noop(ctx: JobContext) -> Verdict:
    return {"result": "nothing to do"}


async def sleep(ctx: JobContext) -> Verdict:
    await _slow(ctx)
    return {"result": "slept"}


async def always_fail(ctx: JobContext) -> Verdict:
    delay = ctx.payload.get("delay_s")
    raise TemporaryError(f"failure on attempt {ctx.attempt}", None if delay is None else float(delay))


async def permanent_fail(ctx: JobContext) -> Verdict:
    raise PermanentError("this can never work")


async def crash(ctx: JobContext) -> Verdict:
    raise RuntimeError("unexpected bug")


async def bad_verdict(ctx: JobContext) -> Verdict:
    return {"not json": object()}


async def record(ctx: JobContext) -> Verdict:
    """Insert one row per execution (duplicates can be counted), then maybe sleep."""
    async with ctx.pool.connection() as conn:
        await conn.execute(
            "INSERT INTO test_executions (job_id, fence, attempt, worker_id) VALUES (%s, %s, %s, %s)",
            (ctx.job_id, ctx.fence, ctx.attempt, ctx.worker_id),
        )
    await _slow(ctx)
    return {"result": "recorded", "fence": ctx.fence}


async def gate(ctx: JobContext) -> Verdict:
    """In-process tests: tell them the handler runs, then wait until they open the gate."""
    gates: Any = ctx.services["gates"]
    gates.started(ctx)
    await gates.wait(ctx)
    return {"result": "gate opened"}


KINDS = {
    "noop": noop,
    "sleep": sleep,
    "always_fail": always_fail,
    "permanent_fail": permanent_fail,
    "crash": crash,
    "bad_verdict": bad_verdict,
    "record": record,
}


def build_registry(max_attempts: int = 5) -> JobRegistry:
    return JobRegistry([JobKind(name, handler, max_attempts=max_attempts) for name, handler in KINDS.items()])


# ----------------------------------------------------------------- helpers shared by the queue tests

WORKER = "w-test"


async def db_now(conn: AsyncConn) -> Any:
    cursor = await conn.execute("SELECT now() AS now")
    row = await cursor.fetchone()
    assert row is not None
    return row["now"]


async def events_of(conn: AsyncConn, job_id: Any) -> list[tuple[str, str, str]]:
    """(event, actor_kind, actor_id) of one job, in order."""
    cursor = await conn.execute(
        "SELECT event, actor_kind, actor_id FROM job_events WHERE job_id = %s ORDER BY id", (job_id,)
    )
    return [(r["event"], r["actor_kind"], r["actor_id"]) for r in await cursor.fetchall()]


async def states(conn: AsyncConn) -> dict[str, int]:
    cursor = await conn.execute("SELECT state, count(*) AS n FROM jobs GROUP BY state")
    return {r["state"]: int(r["n"]) for r in await cursor.fetchall()}


async def running_job(conn: AsyncConn, kind: str = "noop", *, worker: str = WORKER, **new: Any) -> Any:
    """Enqueue one job of `kind` and move it to running as `worker`; returns the running row."""
    from controlplane.db.job_rows import NewJob, enqueue
    from controlplane.db.transitions import Actor
    from controlplane.queue import moves as queue
    from tests.factories import TEST_ACTOR

    made = await enqueue(conn, NewJob(kind, **new), TEST_ACTOR)
    claimed = [r for r in await queue.claim(conn, worker, [kind], 100) if r["id"] == made.job["id"]]
    assert claimed, "the job was not claimable"
    (row,) = (await queue.start_many(conn, claimed, Actor("worker", worker))).moved
    return row


async def until(
    url: str,
    condition: Any,
    *,
    channels: tuple[str, ...] = ("cp_job_completed", "cp_job_failed", "cp_job_abandoned", "cp_job_queued"),
    timeout: float = 20.0,
) -> None:
    """Wait until `await condition(conn)` is true, re-checking on each job notification (no sleeping)."""
    import time

    from controlplane.db import connection as db

    conn = await db.connect(url)
    async with conn:
        for channel in channels:
            await conn.execute(f"LISTEN {channel}")
        deadline = time.monotonic() + timeout
        while not await condition(conn):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"condition not met within {timeout}s")
            async for _ in conn.notifies(timeout=min(remaining, 1.0), stop_after=1):
                pass


def count_in(state: str, n: int, *, at_least: bool = False) -> Any:
    """A condition for `until`: exactly (or at least) `n` jobs are in `state`."""

    async def check(conn: AsyncConn) -> bool:
        count = (await states(conn)).get(state, 0)
        return count >= n if at_least else count == n

    return check


class Gates:
    """Services for the `gate` kind: handlers announce themselves and wait until a test opens them."""

    def __init__(self, open_all: bool = False) -> None:
        self.open_all = open_all
        self.contexts: asyncio.Queue[JobContext] = asyncio.Queue()
        self._events: dict[Any, asyncio.Event] = {}
        self.cancelled: asyncio.Queue[Any] = asyncio.Queue()

    def _event(self, job_id: Any) -> asyncio.Event:
        return self._events.setdefault(job_id, asyncio.Event())

    def started(self, ctx: JobContext) -> None:
        self.contexts.put_nowait(ctx)

    async def wait(self, ctx: JobContext) -> None:
        if self.open_all:
            return
        try:
            await self._event(ctx.job_id).wait()
        except asyncio.CancelledError:
            self.cancelled.put_nowait(ctx.job_id)
            raise

    def open(self, job_id: Any) -> None:
        self._event(job_id).set()


async def fenced_gate(ctx: JobContext) -> Verdict:
    """Like `gate`, then write '<worker>:<fence>' to the fenced resource services['resource']."""
    gates: Gates = ctx.services["gates"]
    gates.started(ctx)
    await gates.wait(ctx)
    fences = ctx.services["fences"]
    resource = ctx.services["resource"]
    with fences.hold(str(ctx.job_id), ctx.fence):
        resource.write_text(f"{ctx.worker_id}:{ctx.fence}")
    return {"result": "written", "fence": ctx.fence}


def gate_registry() -> JobRegistry:
    return JobRegistry([JobKind("gate", gate), JobKind("fenced_gate", fenced_gate)])
