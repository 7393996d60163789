"""procrastinate driver (runs in bench/.venv): apply its schema, drain no-op jobs at concurrency 10.

Prints one JSON object on the last line of stdout. The app module starts no work at import time.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import cost  # bench/peers/cost.py, beside this script
import psycopg
import uvloop
from procrastinate import App, PsycopgConnector


def emit(result: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def make_app(dsn: str) -> tuple[App, dict[str, int]]:
    app = App(connector=PsycopgConnector(conninfo=dsn, min_size=1, max_size=12))
    counter = {"done": 0}

    @app.task(name="noop")
    async def noop() -> None:
        counter["done"] += 1

    return app, counter


async def install(dsn: str) -> None:
    app, _ = make_app(dsn)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
    emit({"installed": True})


async def drain(dsn: str, jobs: int, concurrency: int) -> None:
    app, counter = make_app(dsn)
    async with app.open_async():
        task = app.tasks["noop"]
        chunk = 1000
        for start in range(0, jobs, chunk):
            await task.batch_defer_async(*([{}] * min(chunk, jobs - start)))
        meter = cost.Meter(dsn)
        meter.begin()
        started = time.perf_counter()
        await app.run_worker_async(concurrency=concurrency, wait=False, install_signal_handlers=False)
        elapsed = time.perf_counter() - started
        spent = meter.end(counter["done"])
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cursor = await conn.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")
        row = await cursor.fetchone()
    succeeded = int(row[0]) if row else 0
    emit(
        {
            "jobs": jobs,
            "executed": counter["done"],
            "succeeded": succeeded,
            "cost": spent,
            "seconds": elapsed,
            "jobs_per_s": counter["done"] / elapsed,
        }
    )


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["install", "drain"])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=10)
    args = parser.parse_args()
    if args.command == "install":
        uvloop.run(install(args.dsn))
    else:
        uvloop.run(drain(args.dsn, args.jobs, args.concurrency))


if __name__ == "__main__":
    main()
