"""Files the control plane keeps on disk, written so that a crash never leaves half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, data: str | bytes, mode: int = 0o600) -> None:
    """Write a sibling temporary file, fsync it, rename it over `path`, fsync the directory."""
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(raw)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
