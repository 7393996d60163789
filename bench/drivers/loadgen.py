"""Driver: an HTTP load generator (asyncio + httpx), run as its own process.

  rate    open loop: one request every 1/rate s for `seconds`, latency from the scheduled send time
  closed  N concurrent clients back to back for `seconds` (the fallback when wrk is not installed)

Every request is a POST of a fresh instance body (a unique name each time).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
from collections import Counter

import httpx

from bench.drivers.common import emit, quiet_logs


def body(tag: str, n: int) -> dict[str, str]:
    return {"name": f"b{tag}-{n}", "plan": "dev"}


async def rate(args: argparse.Namespace, client: httpx.AsyncClient, tag: str) -> dict[str, object]:
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    interval = 1.0 / args.rate
    total = int(args.rate * args.seconds)

    async def send(n: int, scheduled: float) -> None:
        try:
            response = await client.post(args.path, json=body(tag, n))
            statuses[response.status_code] += 1
        except httpx.HTTPError:
            statuses[0] += 1
        latencies.append((time.perf_counter() - scheduled) * 1000)

    start = time.perf_counter() + 0.2
    tasks = []
    for n in range(total):
        scheduled = start + n * interval
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(n, scheduled)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    return {"requests": total, "seconds": elapsed, "statuses": dict(statuses), "latencies_ms": latencies}


async def closed(args: argparse.Namespace, client: httpx.AsyncClient, tag: str) -> dict[str, object]:
    statuses: Counter[int] = Counter()
    counter = iter(range(10**9))
    stop_at = time.perf_counter() + args.seconds

    async def loop() -> None:
        while time.perf_counter() < stop_at:
            try:
                response = await client.post(args.path, json=body(tag, next(counter)))
                statuses[response.status_code] += 1
            except httpx.HTTPError:
                statuses[0] += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(args.connections)))
    elapsed = time.perf_counter() - start
    done = sum(statuses.values())
    return {"requests": done, "seconds": elapsed, "statuses": dict(statuses), "rps": done / elapsed}


async def main(args: argparse.Namespace) -> None:
    tag = secrets.token_hex(4)
    limits = httpx.Limits(max_connections=args.connections, max_keepalive_connections=args.connections)
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    async with httpx.AsyncClient(base_url=args.base, headers=headers, limits=limits, timeout=30) as client:
        result = await (rate if args.mode == "rate" else closed)(args, client, tag)
    emit(result)


if __name__ == "__main__":
    quiet_logs()
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["rate", "closed"])
    parser.add_argument("--base", required=True)
    parser.add_argument("--path", required=True)
    parser.add_argument("--key", default="")
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=32)
    asyncio.run(main(parser.parse_args()))
