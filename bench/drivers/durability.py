"""Durability of a local instance, through the real worker and reconciler: the archive's lag under a
write load, what a lost data directory loses (RPO) once it is restored by itself, and the restore
time of a large database against `pgbackrest restore` alone on the same data.

Run: python -m bench.drivers.durability --url URL --data-dir DIR [--archive-timeout-s 60]
     [--lag-rows-per-s 1000 --lag-seconds 60] [--rpo-rows-per-s 100 --rpo-seconds 150] [--size-mb 1024]
Prints one JSON object (bench.drivers.common.emit).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from bench.drivers.common import emit, quiet_logs
from bench.drivers.local_plane import ACTOR, LocalControlPlane, state_is, until
from controlplane.core.kinds import BACKUP
from controlplane.db import connection as db
from controlplane.db import job_rows as jobs
from controlplane.runtime.postgres import free_port, make_owned_dir
from controlplane.runtime.settings import Settings
from controlplane.services import backups
from provisioners.base import ConnectionInfo
from provisioners.local.repository import PgTarget


def control_plane(url: str, data_dir: Path, archive_timeout_s: float) -> LocalControlPlane:
    """The worker and reconciler, polling often (the figures are of the archive, not of the queue)."""
    low = 30000 + free_port() % 2000
    settings = Settings(
        database_url=url,
        data_dir=data_dir,
        local_port_min=low,
        local_port_max=low + 20,
        poll_interval_s=0.05,
        heartbeat_interval_s=1.0,
        local_archive_timeout_s=archive_timeout_s,
    )
    return LocalControlPlane(settings, url, "bench-durability")


async def backed_up_instance(plane: LocalControlPlane, conn: db.AsyncConn) -> uuid.UUID:
    org = await (
        await conn.execute("INSERT INTO organisations (name) VALUES ('bench') RETURNING id")
    ).fetchone()
    assert org is not None
    iid = await plane.ready_instance(conn, org["id"], "durable", "dev")
    await until(lambda: has_backup(conn, iid), "the first backup", 300)
    return iid


async def has_backup(conn: db.AsyncConn, iid: uuid.UUID) -> bool:
    window = await backups.window(conn, iid)
    return window is not None and window.earliest_at is not None


def connect(info: ConnectionInfo) -> psycopg.Connection[Any]:
    return psycopg.connect(**info.libpq(), sslmode="require", autocommit=True, connect_timeout=5)


class Writer(threading.Thread):
    """Single-row commits at a steady rate; each acknowledged id with the time it was acknowledged."""

    def __init__(self, info: ConnectionInfo, table: str, rows_per_s: float, start_id: int = 1) -> None:
        super().__init__(daemon=True)
        self.info, self.table, self.rows_per_s = info, table, rows_per_s
        self.acked: list[tuple[int, float]] = []
        self.stop = threading.Event()
        self.next_id = start_id

    def run(self) -> None:
        try:
            with connect(self.info) as conn:
                conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {self.table} (id bigint PRIMARY KEY, at timestamptz)"
                )
                started = time.monotonic()
                sent = 0
                while not self.stop.is_set():
                    conn.execute(f"INSERT INTO {self.table} VALUES (%s, clock_timestamp())", (self.next_id,))
                    self.acked.append((self.next_id, time.time()))
                    self.next_id += 1
                    sent += 1
                    ahead = sent / self.rows_per_s - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
        except psycopg.Error:
            pass  # the server went with its data directory: what was acknowledged is recorded


async def archive_lag(
    plane: LocalControlPlane, conn: db.AsyncConn, iid: uuid.UUID, rate: float, seconds: float
) -> dict[str, float]:
    """The archive's lag (latest restorable moment behind the observation) under a steady write load."""
    writer = Writer(await plane.credentials(conn, iid), "lag", rate)
    writer.start()
    lags: list[float] = []
    lag_bytes: list[float] = []
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        seen = await plane.local.observe(iid)
        if seen.recovery is not None and seen.recovery.lag_s is not None:
            lags.append(seen.recovery.lag_s)
            lag_bytes.append(float(seen.recovery.lag_bytes or 0))
        await asyncio.sleep(1.0)
    writer.stop.set()
    writer.join(timeout=30)
    achieved = len(writer.acked) / seconds
    return {
        "lag_rows_per_s": achieved,
        "lag_p50_s": statistics.median(lags) if lags else float("nan"),
        "lag_max_s": max(lags) if lags else float("nan"),
        "lag_max_bytes": max(lag_bytes) if lag_bytes else float("nan"),
    }


async def rpo(
    plane: LocalControlPlane,
    conn: db.AsyncConn,
    iid: uuid.UUID,
    rate: float,
    seconds: float,
    archive_timeout_s: float,
) -> dict[str, float]:
    """Rows acknowledged before the data directory is removed, against rows present once the
    instance restored itself; the seconds of acknowledged writes lost, and the rows committed more
    than archive_timeout before the loss that were lost (must be 0)."""
    info = await plane.credentials(conn, iid)
    writer = Writer(info, "rpo", rate)
    writer.start()
    await asyncio.sleep(seconds)
    lost_at = time.time()
    shutil.rmtree(plane.local.datadir(iid))
    writer.stop.set()
    writer.join(timeout=30)
    await until(lambda: state_is(conn, iid, "degraded"), "the loss seen", 120)
    await until(lambda: state_is(conn, iid, "ready"), "restored by itself", 3600)
    ready_at = time.time()
    with connect(await plane.credentials(conn, iid)) as customer:
        present = {row[0] for row in customer.execute("SELECT id FROM rpo").fetchall()}
    acked = [(i, at) for i, at in writer.acked if at <= lost_at]
    lost = [(i, at) for i, at in acked if i not in present]
    oldest_lost = min((at for _, at in lost), default=lost_at)
    row = await (
        await conn.execute(
            "SELECT detail FROM instance_events WHERE instance_id = %s AND event = 'recover'"
            " ORDER BY id DESC LIMIT 1",
            (iid,),
        )
    ).fetchone()
    reported = (row or {}).get("detail", {}).get("seconds_lost") if row else None
    return {
        "rpo_rows_acked": float(len(acked)),
        "rpo_rows_lost": float(len(lost)),
        "rpo_seconds_lost": lost_at - oldest_lost,
        "rpo_seconds_lost_reported": float(reported) if reported is not None else float("nan"),
        "rpo_lost_older_than_archive_timeout": float(
            sum(1 for _, at in lost if at < lost_at - archive_timeout_s)
        ),
        "rpo_loss_to_ready_s": ready_at - lost_at,
    }


async def restore_time(
    plane: LocalControlPlane, conn: db.AsyncConn, iid: uuid.UUID, size_mb: int
) -> dict[str, float]:
    """A database of `size_mb`, backed up: its lost data directory restored by the control plane
    (the loss seen, the restore job, the server ready) against `pgbackrest restore` alone."""
    rows = size_mb * 1024 * 1024 // 250
    with connect(await plane.credentials(conn, iid)) as customer:
        customer.execute(
            f"CREATE TABLE big AS SELECT g AS id, repeat('x', 200) AS pad FROM generate_series(1, {rows}) g"
        )
        (size,) = customer.execute("SELECT pg_database_size(current_database())").fetchone() or (0,)
    job = await jobs.enqueue(conn, jobs.NewJob(BACKUP, iid, payload={"backup_kind": "on_demand"}), ACTOR)
    await until(lambda: job_done(conn, job.job["id"]), "the backup", 3600)
    # pgBackRest alone: the same stanza restored into an empty directory.
    scratch = Path(tempfile.mkdtemp(prefix="restore-alone-", dir=plane.local.storage.data_dir))
    os.chmod(scratch, 0o755)
    target = scratch / "pgdata"
    try:
        make_owned_dir(target, plane.local.storage.run_as)
        started = time.monotonic()
        result = plane.local.repository.run(iid, "restore", [], target=PgTarget(target))
        alone = time.monotonic() - started
        plane.local.repository.must(result, "pgbackrest restore alone")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lost_at = time.monotonic()
    shutil.rmtree(plane.local.datadir(iid))
    await until(lambda: state_is(conn, iid, "degraded"), "the loss seen", 120)
    await until(lambda: state_is(conn, iid, "ready"), "restored by itself", 3600)
    ours = time.monotonic() - lost_at
    return {
        "restore_db_bytes": float(size),
        "restore_pgbackrest_s": alone,
        "restore_ours_s": ours,
    }


async def job_done(conn: db.AsyncConn, job_id: uuid.UUID) -> bool:
    row = await (await conn.execute("SELECT state FROM jobs WHERE id = %s", (job_id,))).fetchone()
    if row is not None and row["state"] == "abandoned":
        raise RuntimeError(f"job {job_id} was abandoned")
    return row is not None and row["state"] == "completed"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    plane = control_plane(args.url, Path(args.data_dir), args.archive_timeout_s)
    result: dict[str, Any] = {
        "archive_timeout_s": args.archive_timeout_s,
        "at": dt.datetime.now(dt.UTC).isoformat(),
    }
    async with plane.running() as conn:
        iid = await backed_up_instance(plane, conn)
        if args.lag_seconds > 0:
            result |= await archive_lag(plane, conn, iid, args.lag_rows_per_s, args.lag_seconds)
        if args.rpo_seconds > 0:
            result |= await rpo(
                plane, conn, iid, args.rpo_rows_per_s, args.rpo_seconds, args.archive_timeout_s
            )
        if args.size_mb > 0:
            result |= await restore_time(plane, conn, iid, args.size_mb)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--archive-timeout-s", type=float, default=60.0)
    parser.add_argument("--lag-rows-per-s", type=float, default=1000.0)
    parser.add_argument("--lag-seconds", type=float, default=60.0)
    parser.add_argument("--rpo-rows-per-s", type=float, default=100.0)
    parser.add_argument("--rpo-seconds", type=float, default=150.0)
    parser.add_argument("--size-mb", type=int, default=1024)
    args = parser.parse_args()
    quiet_logs()
    Path(args.data_dir).mkdir(parents=True, exist_ok=True)
    os.chmod(args.data_dir, 0o755)
    emit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
