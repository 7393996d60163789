"""Driver: a light HTTP/1.1 load generator (asyncio streams, keep-alive), run as its own process.

  rate    open loop: one request every 1/rate s for `seconds` over a set of connections; latency is
          measured from the scheduled send time, so a slow server is not hidden by a waiting client
  closed  N connections sending back to back for `seconds` (the fallback when wrk is not installed)

Every request is a POST of a fresh instance body (a unique name each time), or, with --paths-file,
a GET of the file's paths in turn. Plain sockets rather than an HTTP library keep the generator's own
CPU per request small next to the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from bench.drivers.common import emit, quiet_logs
from controlplane.runtime import aio


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, request: bytes) -> int:
        self.writer.write(request)
        status_line = await self.reader.readline()
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if length:
            await self.reader.readexactly(length)
        return int(status_line.split()[1])


async def connect(host: str, port: int) -> Connection:
    reader, writer = await asyncio.open_connection(host, port)
    return Connection(reader, writer)


def request_head(host: str, port: int, path: str, key: str) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}"
        "Content-Type: application/json\r\nContent-Length: "
    ).encode()


def body(tag: str, n: int) -> bytes:
    return json.dumps({"name": f"b{tag}-{n}", "plan": "dev"}).encode()


# The n-th request's bytes.
Requests = Callable[[int], bytes]


def posts(head: bytes, tag: str) -> Requests:
    def request(n: int) -> bytes:
        payload = body(tag, n)
        return head + str(len(payload)).encode() + b"\r\n\r\n" + payload

    return request


def gets(host: str, port: int, paths: list[str], key: str) -> Requests:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    heads = [f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}\r\n".encode() for path in paths]
    return lambda n: heads[n % len(heads)]


async def rate(args: argparse.Namespace, conns: list[Connection], requests: Requests) -> dict[str, object]:
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()

    async def sender(conn: Connection) -> None:
        while (item := await queue.get()) is not None:
            n, scheduled = item
            try:
                statuses[await conn.send(requests(n))] += 1
            except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
                statuses[0] += 1
            latencies.append((time.perf_counter() - scheduled) * 1000)

    senders = [asyncio.create_task(sender(c)) for c in conns]
    interval = 1.0 / args.rate
    total = int(args.rate * args.seconds)
    start = time.perf_counter() + 0.1
    for n in range(total):
        scheduled = start + n * interval
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        queue.put_nowait((n, scheduled))
    for _ in senders:
        queue.put_nowait(None)
    await asyncio.gather(*senders)
    return {
        "requests": total,
        "seconds": time.perf_counter() - start,
        "statuses": dict(statuses),
        "latencies_ms": latencies,
    }


async def closed(args: argparse.Namespace, conns: list[Connection], requests: Requests) -> dict[str, object]:
    statuses: Counter[int] = Counter()
    counter = iter(range(10**9))
    stop_at = time.perf_counter() + args.seconds

    async def loop(conn: Connection) -> None:
        while time.perf_counter() < stop_at:
            try:
                statuses[await conn.send(requests(next(counter)))] += 1
            except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
                statuses[0] += 1
                return

    start = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in conns))
    elapsed = time.perf_counter() - start
    done = sum(statuses.values())
    return {"requests": done, "seconds": elapsed, "statuses": dict(statuses), "rps": done / elapsed}


async def main(args: argparse.Namespace, paths: list[str]) -> None:
    parts = urlsplit(args.base)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    conns = [await connect(host, port) for _ in range(args.connections)]
    if paths:
        requests = gets(host, port, paths, args.key)
    else:
        requests = posts(request_head(host, port, args.path, args.key), secrets.token_hex(4))
    try:
        result = await (rate if args.mode == "rate" else closed)(args, conns, requests)
    finally:
        for conn in conns:
            conn.writer.close()
    emit(result)


if __name__ == "__main__":
    quiet_logs()
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["rate", "closed"])
    parser.add_argument("--base", required=True)
    parser.add_argument("--path", default="/v1/instances")
    parser.add_argument("--paths-file", default="", help="GET these paths (one a line) instead of POSTs")
    parser.add_argument("--key", default="")
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=32)
    arguments = parser.parse_args()
    aio.run(main(arguments, Path(arguments.paths_file).read_text().split() if arguments.paths_file else []))
