"""The async/sync seam, written once: every step's body is synchronous, and runs in a thread.

`step` makes a body the fenced async step the interface declares; `in_thread` does the same for a
read that takes no fence. Nothing else in the package awaits, and no step has an async twin.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import inspect
import subprocess
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import psycopg

from controlplane.core.failures import CAPACITY_EXHAUSTED, QUOTA_EXCEEDED
from controlplane.core.step_errors import PermanentError, TemporaryError
from controlplane.runtime.fencing import FileFences
from controlplane.runtime.postgres import PostgresError
from provisioners.base import fenced


class Fenced(Protocol):
    """What runs steps: where the highest fence seen per instance is kept."""

    fences: FileFences


F = TypeVar("F", bound=Fenced)
S = TypeVar("S")
P = ParamSpec("P")
T = TypeVar("T")


def step(body: Callable[Concatenate[F, P], T]) -> Callable[Concatenate[F, P], Coroutine[Any, Any, T]]:
    """The step whose synchronous `body` takes `instance_id` and `fence` (by those names), as the
    async step of the interface: run in a thread while holding the instance's fence, its errors
    translated at this edge.

    A cancelled step lets the thread finish before the fence lock is released, so a second
    step never overlaps a half-done one.
    """
    signature = inspect.signature(body)
    if not {"instance_id", "fence"} <= signature.parameters.keys():
        raise TypeError(f"step {body.__qualname__} takes no instance_id and fence")

    @functools.wraps(body)
    async def run(self: F, /, *args: P.args, **kwargs: P.kwargs) -> T:
        called = signature.bind(self, *args, **kwargs).arguments
        async with fenced(self.fences, called["instance_id"], called["fence"]):
            work = functools.partial(body, self, *args, **kwargs)
            task = asyncio.ensure_future(asyncio.to_thread(translated, work))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                await asyncio.wait({task})
                raise

    return run


def in_thread(body: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """A read (or a start or stop of every server) that takes no fence: its synchronous `body` in a
    thread, as an async method; its errors are not translated."""

    @functools.wraps(body)
    async def run(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await asyncio.to_thread(body, self, *args, **kwargs)

    return run


def translated(work: Callable[[], T]) -> T:
    """Third-party failures become the engine's two kinds of error (a full or over-quota disk
    with the code customers are told)."""
    try:
        return work()
    except (TemporaryError, PermanentError):
        raise
    except OSError as exc:
        message = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
        if exc.errno == errno.EDQUOT:
            raise PermanentError(message, code=QUOTA_EXCEEDED) from exc
        if exc.errno == errno.ENOSPC:
            raise TemporaryError(message, code=CAPACITY_EXHAUSTED) from exc
        raise TemporaryError(message) from exc
    except (PostgresError, psycopg.OperationalError, subprocess.TimeoutExpired) as exc:
        raise TemporaryError(f"{type(exc).__name__}: {str(exc).strip()[:500]}") from exc
    except psycopg.Error as exc:
        raise TemporaryError(f"{type(exc).__name__}: {str(exc).strip()[:500]}") from exc
