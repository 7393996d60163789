"""Fencing tokens at a downstream resource: remember the highest fence per key, refuse a lower one."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

from controlplane.core.step_errors import StaleFence

_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def admit(resource: str, highest_seen: int | None, fence: int) -> int:
    """The pure rule: a fence at least as high as any seen is admitted and becomes the highest.

    Returns the new highest; raises StaleFence when a higher fence was already seen. An equal
    fence is admitted: the same claim may call the resource many times.
    """
    if highest_seen is not None and fence < highest_seen:
        raise StaleFence(resource, fence, highest_seen)
    return fence if highest_seen is None else max(highest_seen, fence)


class FileFences:
    """Highest fences in files (one per key) under `directory`, updated under an exclusive flock.

    `hold(key, fence)` keeps the lock while the caller touches the resource, so a worker with a
    lower fence cannot act between the check and the write; `check(key, fence)` is the short form.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, key: str) -> Path:
        if not _SAFE_KEY.match(key):
            raise ValueError(f"fence key {key!r} must be letters, digits, '.', '_' or '-'")
        return self.directory / f"{key}.fence"

    @contextlib.contextmanager
    def hold(self, key: str, fence: int) -> Iterator[int]:
        """Admit `fence` for `key` and keep the key locked for the body; yields the new highest."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path(key), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 64, 0).decode().strip()
            highest_seen = int(raw) if raw else None
            highest = admit(key, highest_seen, fence)
            if highest != highest_seen:
                data = f"{highest}\n".encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
                os.fsync(fd)
            yield highest
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def check(self, key: str, fence: int) -> int:
        with self.hold(key, fence) as highest:
            return highest

    async def check_async(self, key: str, fence: int) -> int:
        return await asyncio.to_thread(self.check, key, fence)

    def highest(self, key: str) -> int | None:
        try:
            raw = self.path(key).read_text().strip()
        except FileNotFoundError:
            return None
        return int(raw) if raw else None
