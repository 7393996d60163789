"""The pickup workloads' producer, shared by every driver: an open loop, one send every 1/rate s.

A send that has finished is not kept. A driver that kept every one of them (the task, its
coroutine and its frame) made its process's full garbage collections slower as the run went on,
each one a pause of its event loop, where the worker also runs: 56 ms in the first minute and
358 ms in the sixth, measured, and the jobs sent during one waited for it.
Importable from the project's environment and from the peers' (the standard library only).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any


async def open_loop(
    send: Callable[[], Coroutine[Any, Any, None]], rate: float, seconds: float
) -> tuple[float, int]:
    """Start `send()` every 1/rate s for `seconds`, then wait for every send to end. Returns the
    seconds that took and how many sends started more than an interval late; raises the first
    send's error."""
    pending: set[asyncio.Task[None]] = set()
    failures: list[BaseException] = []

    def finished(task: asyncio.Task[None]) -> None:
        pending.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            failures.append(error)

    interval = 1.0 / rate
    start = time.perf_counter()
    behind = 0
    for n in range(int(rate * seconds)):
        delay = start + n * interval - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        elif delay < -interval:
            behind += 1
        task = asyncio.create_task(send())
        pending.add(task)
        task.add_done_callback(finished)
    while pending:
        await asyncio.wait(set(pending))
    if failures:
        raise failures[0]
    return time.perf_counter() - start, behind
