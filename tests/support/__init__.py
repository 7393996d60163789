"""Helpers the tests share: the repository's root, and waiting for a condition (`eventually`)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

# The checkout the tests run from (the product itself knows no repository: it may run from a wheel).
ROOT = Path(__file__).resolve().parents[2]


# How often a condition that no notification announces is checked again.
POLL_S = 0.05


def _said(what: str | Callable[[], object]) -> object:
    return what if isinstance(what, str) else what()


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], what: str | Callable[[], object], timeout_s: float = 30
) -> None:
    """Wait until `check()` (a plain or async function) holds, or fail naming `what` (a text, or a
    function giving it at the failure) after `timeout_s`: a bound on a hung test, not a timing the
    test asserts (a slower machine only waits longer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = check()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {_said(what)}"
        await asyncio.sleep(POLL_S)


def eventually_sync(
    check: Callable[[], bool], what: str | Callable[[], object], timeout_s: float = 30
) -> None:
    """`eventually` for a plain function, from a test that runs no event loop."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {_said(what)}"
        time.sleep(POLL_S)
