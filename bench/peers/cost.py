"""What a drain costs, measured by each driver (ours and the peers') around its timed phase.

Write transactions (each takes a transaction id, and its commit an fsync), WAL bytes
(pg_current_wal_lsn before and after) and CPU seconds: the driver process's own and the database
server's (the postmaster and its children, from /proc: the server runs on this machine).
Importable from the project's environment and from the peers' (psycopg only).
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE = (
    "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xid,"
    " pg_current_wal_lsn() - '0/0'::pg_lsn AS wal, pg_backend_pid() AS pid"
)


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as handle:
        text = handle.read()
    return text[text.rindex(")") + 2 :].split()  # fields from the state on (field 3)


def _server_cpu_s(postmaster: int) -> float:
    """CPU of the postmaster, its reaped children and its live children, in seconds."""
    fields = _stat(postmaster)
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime, stime, cutime, cstime
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            child = _stat(int(entry))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if int(child[1]) == postmaster:  # ppid
            ticks += int(child[11]) + int(child[12])
    return ticks / TICKS


def postmaster_of(conn: psycopg.Connection[Any]) -> int:
    """The pid of the postmaster serving `conn` (its backend's parent)."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(_stat(int(row[0]))[1])


class ServerCpu:
    """CPU seconds of the whole database server (every backend and background process) between
    begin() and end(): the server runs only the bench's measured work meanwhile."""

    def __init__(self, dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            self.postmaster = postmaster_of(conn)
        self.started = 0.0

    def begin(self) -> None:
        self.started = _server_cpu_s(self.postmaster)

    def end(self) -> float:
        return _server_cpu_s(self.postmaster) - self.started


class Meter:
    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        row = self.conn.execute(SAMPLE).fetchone()
        assert row is not None
        self.postmaster = int(_stat(int(row[2]))[1])
        self.start: tuple[int, int, float, float] | None = None

    def _sample(self) -> tuple[int, int, float, float]:
        row = self.conn.execute(SAMPLE).fetchone()
        assert row is not None
        return int(row[0]), int(row[1]), time.process_time(), _server_cpu_s(self.postmaster)

    def begin(self) -> None:
        self.start = self._sample()

    def end(self, jobs: int) -> dict[str, Any]:
        assert self.start is not None
        xid, wal, client, server = (b - a for a, b in zip(self.start, self._sample(), strict=True))
        self.conn.close()
        jobs = max(jobs, 1)
        return {
            "commits_per_job": xid / jobs,
            "wal_bytes_per_job": wal / jobs,
            "client_cpu_s": client,
            "server_cpu_s": server,
            "jobs_per_cpu_s": jobs / max(client + server, 1e-9),
            "client_cpu_us_per_job": 1e6 * client / jobs,
            "server_cpu_us_per_job": 1e6 * server / jobs,
        }
