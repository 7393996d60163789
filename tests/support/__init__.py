"""Helpers the tests share: the repository's root, and waiting for a condition (`eventually`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

# The checkout the tests run from (the product itself knows no repository: it may run from a wheel).
ROOT = Path(__file__).resolve().parents[2]


# How often a condition that no notification announces is checked again.
POLL_S = 0.05


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 30) -> None:
    """Wait until `await check()` holds, or fail naming `what` after `timeout_s` (a bound on a hung
    test, not a timing the test asserts: a slower machine only waits longer)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(POLL_S)


def eventually_sync(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    """`eventually` for a plain function, from a test that runs no event loop."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(POLL_S)
