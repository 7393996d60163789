"""Driver: the project's job queue and worker (controlplane.queue.worker.Worker, the worker role) under load.

drain      enqueue N no-op jobs, then time one worker at concurrency C until all are completed
pickup     a producer at a steady rate; enqueue-to-handler-start latency per job
worker     the worker role (process_roles.run_worker_role) with a sleeping job kind until SIGTERM
           (crash-recovery workload)
supervise  the supervisor loop until SIGTERM (reclaims the jobs of a dead worker)
claim-latency  enqueue one job, then time its claim and start; N times
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from typing import Any

from bench.drivers.common import emit, quiet_logs
from bench.peers import cost
from bench.peers.openloop import open_loop
from controlplane.db import connection as db
from controlplane.db.job_rows import NewJob, enqueue_many
from controlplane.db.transitions import Actor
from controlplane.queue.registry import JobContext, JobKind, JobRegistry, Verdict
from controlplane.queue.supervisor import Supervisor
from controlplane.queue.worker import Worker
from controlplane.runtime import aio
from controlplane.runtime.settings import Settings

ACTOR = Actor("system", "bench")
NOOP = "bench_noop"
# The producer is open-loop: each enqueue takes a free connection, so a slow commit does not
# delay the next one.
PRODUCER_CONNECTIONS = 4
# A drain that completes nothing for this long has stalled: it is reported, not waited for.
STALL_S = 60.0
SLEEP = "bench_sleep"


async def noop(ctx: JobContext) -> Verdict:
    return {"result": "nothing to do"}


async def sleep(ctx: JobContext) -> Verdict:
    await asyncio.sleep(float(ctx.payload["seconds"]))
    return {"result": "slept"}


def registry(handler: Any = noop, kind: str = NOOP) -> JobRegistry:
    return JobRegistry([JobKind(kind, handler)])


def settings(url: str, concurrency: int, **extra: Any) -> Settings:
    return Settings(database_url=url, worker_concurrency=concurrency, **extra)


async def enqueue(url: str, jobs: list[NewJob], chunk: int = 1000) -> None:
    conn = await db.connect(url)
    async with conn:
        for start in range(0, len(jobs), chunk):
            async with conn.transaction():
                await enqueue_many(conn, jobs[start : start + chunk], ACTOR)


async def drain(args: argparse.Namespace) -> None:
    await enqueue(args.url, [NewJob(NOOP) for _ in range(args.jobs)])
    cfg = settings(args.url, args.concurrency)
    pool = db.pool(args.url, min_size=2, max_size=args.concurrency + 3, name="bench-drain")
    await pool.open(wait=True, timeout=30)
    worker = Worker("bench-drain", cfg, pool, registry())
    meter = cost.Meter(args.url)
    meter.begin()
    started = time.perf_counter()
    runner = asyncio.create_task(worker.run())
    progress, progressed_at = 0, started
    while worker.counts["completed"] < args.jobs and not runner.done():
        await asyncio.sleep(0.005)
        if worker.counts["completed"] != progress:
            progress, progressed_at = worker.counts["completed"], time.perf_counter()
        elif time.perf_counter() - progressed_at > STALL_S:
            break  # reported below: the worker stopped completing jobs
    elapsed = time.perf_counter() - started
    spent = meter.end(worker.counts["completed"])
    worker.request_stop()
    await runner
    await pool.close()
    conn = await db.connect(args.url)
    async with conn:
        cursor = await conn.execute(
            "SELECT (SELECT count(*) FROM jobs WHERE state = 'completed') AS completed,"
            " (SELECT count(*) FROM job_events) AS events"
        )
        row = await cursor.fetchone()
        # One statement writes one `at` (its transaction's now()): rows per distinct `at` is the batch.
        cursor = await conn.execute(
            "SELECT event, count(*)::float8 / count(DISTINCT at) AS batch FROM job_events"
            " WHERE event IN ('claim', 'start', 'finish') GROUP BY event"
        )
        batches = {r["event"]: r["batch"] for r in await cursor.fetchall()}
        cursor = await conn.execute("SELECT state, count(*) AS n FROM jobs GROUP BY state")
        states = {r["state"]: r["n"] for r in await cursor.fetchall()}
    assert row is not None
    emit(
        {
            "jobs": args.jobs,
            "completed": row["completed"],
            "events": row["events"],
            "seconds": elapsed,
            "jobs_per_s": worker.counts["completed"] / elapsed,
            "counts": dict(worker.counts),
            "batches": batches,
            "states": states,
            "cost": spent,
            "stalled": worker.counts["completed"] < args.jobs,
        }
    )


async def pickup(args: argparse.Namespace) -> None:
    latencies: list[float] = []
    sent: list[float] = []

    async def record(ctx: JobContext) -> Verdict:
        at = float(ctx.payload["t"])
        latencies.append(time.time() - at)
        sent.append(at)
        return {"result": "nothing to do"}

    cfg = settings(args.url, args.concurrency)
    pool = db.pool(args.url, min_size=2, max_size=args.concurrency + 3, name="bench-pickup")
    await pool.open(wait=True, timeout=30)
    worker = Worker("bench-pickup", cfg, pool, registry(record))
    runner = asyncio.create_task(worker.run())
    producers: asyncio.Queue[db.AsyncConn] = asyncio.Queue()
    for _ in range(PRODUCER_CONNECTIONS):
        producers.put_nowait(await db.connect(args.url))

    async def produce() -> None:
        conn = await producers.get()
        try:
            await enqueue_many(conn, [NewJob(NOOP, payload={"t": time.time()})], ACTOR)
        finally:
            producers.put_nowait(conn)

    await asyncio.sleep(1.0)  # the worker is listening before the first job
    total = int(args.rate * args.seconds)
    start_wall = time.time()
    produced_s, behind = await open_loop(produce, args.rate, args.seconds)
    deadline = time.perf_counter() + 10
    while len(latencies) < total and time.perf_counter() < deadline:  # noqa: ASYNC110 (polls a counter)
        await asyncio.sleep(0.05)
    worker.request_stop()
    await runner
    await pool.close()
    while not producers.empty():
        await producers.get_nowait().close()
    # Where the time goes, from the database clock: enqueue -> claim -> start statements.
    conn = await db.connect(args.url)
    async with conn:
        cursor = await conn.execute(
            """
            SELECT 1000 * extract(epoch FROM c.at - e.at) AS to_claim_ms,
                   1000 * extract(epoch FROM s.at - c.at) AS to_start_ms
            FROM job_events e
            JOIN job_events c ON c.job_id = e.job_id AND c.event = 'claim'
            JOIN job_events s ON s.job_id = e.job_id AND s.event = 'start'
            WHERE e.event = 'enqueue'
            """
        )
        phases = await cursor.fetchall()
    emit(
        {
            "to_claim_ms": [float(r["to_claim_ms"]) for r in phases],
            "to_start_ms": [float(r["to_start_ms"]) for r in phases],
            "enqueued": total,
            "started": len(latencies),
            "produce_seconds": produced_s,
            "producer_fell_behind": behind,
            "counts": dict(worker.counts),
            "latencies_ms": [round(x * 1000, 3) for x in latencies],
            # When each job (in the order of latencies_ms) was enqueued, in seconds from the start.
            "sent_s": [round(x - start_wall, 3) for x in sent],
        }
    )


async def claim_latency(args: argparse.Namespace) -> None:
    """One job enqueued, then claimed and started (the worker's statement), timed; `--jobs` times."""
    from controlplane.queue import moves as queue

    conn = await db.connect(args.url)
    latencies = []
    async with conn:
        for _ in range(args.jobs):
            await enqueue_many(conn, [NewJob(NOOP)], ACTOR)
            began = time.perf_counter()
            (started,) = await queue.claim_and_start(conn, "bench-claim", [NOOP], 10)
            latencies.append(time.perf_counter() - began)
            await queue.finish_many(conn, [(started, {"result": "nothing to do"})], ACTOR)
    emit({"latencies_ms": [round(x * 1000, 3) for x in latencies]})


async def worker(args: argparse.Namespace) -> None:
    from controlplane.cli import process_roles

    cfg = settings(args.url, args.concurrency, worker_id=args.worker_id)
    stop = asyncio.Event()
    process_roles.stop_on_signals(stop)
    await process_roles.run_worker_role(cfg, args.url, registry(sleep, SLEEP), stop)
    emit({"exit": 0})


async def supervise(args: argparse.Namespace) -> None:
    cfg = settings(args.url, 1)
    conn = await db.connect(args.url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with conn:
        await Supervisor(conn, cfg, registry(sleep, SLEEP)).run(stop, interval_s=args.interval)
    emit({"stopped": True})


async def enqueue_sleepers(args: argparse.Namespace) -> None:
    await enqueue(args.url, [NewJob(SLEEP, payload={"seconds": args.job_seconds}) for _ in range(args.jobs)])
    emit({"enqueued": args.jobs})


COMMANDS = {
    "drain": drain,
    "pickup": pickup,
    "worker": worker,
    "supervise": supervise,
    "enqueue-sleepers": enqueue_sleepers,
    "claim-latency": claim_latency,
}

if __name__ == "__main__":
    quiet_logs()
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--url", required=True)
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--worker-id", default="bench-worker")
    parser.add_argument("--job-seconds", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=None)
    parsed = parser.parse_args()
    aio.run(COMMANDS[parsed.command](parsed))
