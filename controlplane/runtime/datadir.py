"""The data directory's exclusive lock: one `controlplane up` holds it for its whole life."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from controlplane.runtime.settings import NotAvailable

LOCK_FILE = "up.lock"


def holder(data_dir: Path) -> int | None:
    """The pid recorded by the process that holds the lock, if one holds it now."""
    path = Path(data_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def held(data_dir: Path) -> Iterator[None]:
    """Hold `data_dir` exclusively for the block (its pid recorded), or NotAvailable naming the holder.

    A flock: the kernel releases it when the process dies, however it dies, so a crashed `up`
    never leaves the directory locked.
    """
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        who = f"pid {text}" if text.isdigit() else "another process"
        raise NotAvailable(
            f"the data directory {data_dir} is in use by another `controlplane up` ({who}); stop it "
            "first, or start this one with another --data-dir"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.ftruncate(fd, 0)
        os.close(fd)
