"""A consumer process for the kill -9 test: runs the notifier's pass, says when a batch's effects
have committed, and then waits (for its SIGKILL) before it would store the position."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from controlplane.db import connection as db
from controlplane.queue.consumers import ConsumerRunner, LogEvent
from controlplane.services import notices


async def run(url: str) -> None:
    pool = db.pool(url, min_size=1, max_size=2, name="consumer-process")
    await pool.open(wait=True)

    async def stop_here(name: str, events: Sequence[LogEvent]) -> None:
        print(f"EFFECTS {name} {len(events)}", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # killed while waiting here

    runner = ConsumerRunner(pool, [notices.consumer()], after_effects=stop_here)
    await runner.run_once()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database-url", required=True)
    asyncio.run(run(parser.parse_args().database_url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
