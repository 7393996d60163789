"""pgqueuer driver (runs in bench/.venv): install its schema, drain no-op jobs, measure pickup latency.

Prints one JSON object on the last line of stdout. The asyncpg driver, batch size 10, durable tables
(pgqueuer's default). pgqueuer buffers its acknowledgements (status log rows are written in batches).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from datetime import timedelta

import asyncpg
import cost  # bench/peers/cost.py, beside this script
import openloop  # bench/peers/openloop.py, beside this script
import uvloop
from pgqueuer import AsyncpgDriver, Job, QueueManager
from pgqueuer.domain.types import QueueExecutionMode
from pgqueuer.queries import Queries

ENTRYPOINT = "noop"
# The producer is open-loop: each enqueue takes a free connection (as the project's driver does).
PRODUCER_CONNECTIONS = 4


def emit(result: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


async def install(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    finally:
        await conn.close()
    emit({"installed": True})


async def pending(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM pgqueuer"))
    finally:
        await conn.close()


async def drain(dsn: str, jobs: int, batch_size: int) -> None:
    conn = await asyncpg.connect(dsn)
    queries = Queries(AsyncpgDriver(conn))
    chunk = 1000
    for start in range(0, jobs, chunk):
        n = min(chunk, jobs - start)
        await queries.enqueue([ENTRYPOINT] * n, [None] * n, [0] * n)
    await conn.close()

    worker_conn = await asyncpg.connect(dsn)
    qm = QueueManager(Queries(AsyncpgDriver(worker_conn)))
    done = 0

    @qm.entrypoint(ENTRYPOINT)
    async def noop(job: Job) -> None:
        nonlocal done
        done += 1

    meter = cost.Meter(dsn)
    meter.begin()
    started = time.perf_counter()
    await qm.run(batch_size=batch_size, mode=QueueExecutionMode.drain, dequeue_timeout=timedelta(seconds=1))
    elapsed = time.perf_counter() - started
    spent = meter.end(done)
    await worker_conn.close()
    left = await pending(dsn)
    emit(
        {
            "jobs": jobs,
            "executed": done,
            "left": left,
            "seconds": elapsed,
            "jobs_per_s": done / elapsed,
            "cost": spent,
        }
    )


async def pickup(dsn: str, rate: float, seconds: float, batch_size: int) -> None:
    worker_conn = await asyncpg.connect(dsn)
    qm = QueueManager(Queries(AsyncpgDriver(worker_conn)))
    latencies: list[float] = []

    @qm.entrypoint(ENTRYPOINT)
    async def noop(job: Job) -> None:
        assert job.payload is not None
        latencies.append(time.time() - float(job.payload.decode()))

    worker = asyncio.create_task(qm.run(batch_size=batch_size, dequeue_timeout=timedelta(seconds=5)))
    producers: asyncio.Queue[Queries] = asyncio.Queue()
    connections = [await asyncpg.connect(dsn) for _ in range(PRODUCER_CONNECTIONS)]
    for conn in connections:
        producers.put_nowait(Queries(AsyncpgDriver(conn)))

    async def produce() -> None:
        producer = await producers.get()
        try:
            await producer.enqueue(ENTRYPOINT, str(time.time()).encode())
        finally:
            producers.put_nowait(producer)

    await asyncio.sleep(1.0)  # the worker is listening before the first job
    total = int(rate * seconds)
    produced_s, behind = await openloop.open_loop(produce, rate, seconds)
    deadline = time.perf_counter() + 10
    while len(latencies) < total and time.perf_counter() < deadline:  # noqa: ASYNC110 (polls a counter)
        await asyncio.sleep(0.05)
    qm.shutdown.set()
    await asyncio.wait_for(worker, timeout=30)
    for conn in connections:
        await conn.close()
    await worker_conn.close()
    emit(
        {
            "enqueued": total,
            "started": len(latencies),
            "produce_seconds": produced_s,
            "producer_fell_behind": behind,
            "latencies_ms": [round(x * 1000, 3) for x in latencies],
        }
    )


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("pgqueuer").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["install", "drain", "pickup"])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    if args.command == "install":
        uvloop.run(install(args.dsn))
    elif args.command == "drain":
        uvloop.run(drain(args.dsn, args.jobs, args.batch_size))
    else:
        uvloop.run(pickup(args.dsn, args.rate, args.seconds, args.batch_size))


if __name__ == "__main__":
    main()
