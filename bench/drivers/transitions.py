"""Driver: N clients, each on its own connection, moving its own instance ready <-> suspended.

Every move goes through controlplane.db.transitions.transition (guarded UPDATE, event row, pg_notify).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from bench.drivers.common import emit, quiet_logs, sleep_until
from controlplane.db import connection as db
from controlplane.db.transitions import Actor, transition
from controlplane.runtime import aio

ACTOR = Actor("system", "bench")
MOVES = {"ready": ("suspend", "suspended"), "suspended": ("resume", "ready")}


async def client(url: str, instance_id: uuid.UUID, version: int, start_at: float, stop_at: float) -> int:
    conn = await db.connect(url)
    state, moved = "ready", 0
    async with conn:
        await sleep_until(start_at)
        while time.time() < stop_at:
            event, target = MOVES[state]
            row = await transition(
                conn,
                "instance",
                instance_id,
                event,
                version,
                expected_state=state,
                actor=ACTOR,
                reason="bench",
                detail={"bench": True},
                request_id="bench",
            )
            version, state = row["state_version"], target
            if time.time() <= stop_at:
                moved += 1
    return moved


async def main(args: argparse.Namespace) -> None:
    stop_at = args.start_at + args.seconds
    await sleep_until(args.start_at - 0.5)
    cpu = time.process_time()
    counts = await asyncio.gather(
        *(client(args.url, uuid.UUID(i), args.version, args.start_at, stop_at) for i in args.ids.split(","))
    )
    cpu = time.process_time() - cpu
    emit({"transitions": sum(counts), "seconds": args.seconds, "per_client": counts, "cpu_s": cpu})


if __name__ == "__main__":
    quiet_logs()
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--ids", required=True)
    parser.add_argument("--version", type=int, required=True)
    parser.add_argument("--start-at", type=float, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    aio.run(main(parser.parse_args()))
