"""High availability of a local instance, through the real worker and reconciler at product defaults:
the failover after a SIGKILL of the primary's postmaster (RTO: the longest pause between two
acknowledged writes around the kill; writes queue at the pooler meanwhile, or fail and are retried;
RPO: acknowledged rows missing afterwards), an SRE's switchover (the same pause; rows missing),
and the cost of synchronous replication (commits/s of one client through an HA plan's pooled
endpoint, and on a single server).

Run: python -m bench.drivers.failover --url URL --data-dir DIR [--rows-per-s 100] [--seconds 10]
     [--commit-seconds 10]
Prints one JSON object (bench.drivers.common.emit).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from bench.drivers.common import emit, quiet_logs
from bench.drivers.local_plane import LocalControlPlane, state_is, until
from controlplane.db import connection as db
from controlplane.db.transitions import Actor
from controlplane.runtime.postgres import free_port
from controlplane.runtime.settings import Settings
from controlplane.services import instances
from provisioners.base import ConnectionInfo

SRE = Actor("admin", "bench")


def control_plane(url: str, data_dir: Path) -> LocalControlPlane:
    """Product defaults but for the ports and the data directory."""
    low = 30000 + free_port() % 2000
    settings = Settings(database_url=url, data_dir=data_dir, local_port_min=low, local_port_max=low + 20)
    return LocalControlPlane(settings, url, "bench-failover")


def connect(info: ConnectionInfo, ca: Path) -> psycopg.Connection[Any]:
    # Through a transaction-pooling endpoint: no prepared statements kept across transactions.
    return psycopg.connect(
        **info.libpq(),
        sslmode="verify-full",
        sslrootcert=str(ca),
        autocommit=True,
        connect_timeout=3,
        prepare_threshold=None,
    )


class Writer(threading.Thread):
    """Sequential single-row commits at a steady rate; a failed one is tried again (new session)
    with the same id. Each acknowledged id with the time it was acknowledged."""

    def __init__(self, info: ConnectionInfo, ca: Path, table: str, rows_per_s: float) -> None:
        super().__init__(daemon=True)
        self.info, self.ca, self.table, self.rows_per_s = info, ca, table, rows_per_s
        self.acked: list[tuple[int, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        n, sent, started = 1, 0, time.monotonic()
        while not self.stop.is_set():
            try:
                with connect(self.info, self.ca) as conn:
                    while not self.stop.is_set():
                        conn.execute(f"INSERT INTO {self.table} VALUES (%s) ON CONFLICT DO NOTHING", (n,))
                        self.acked.append((n, time.monotonic()))
                        n, sent = n + 1, sent + 1
                        ahead = sent / self.rows_per_s - (time.monotonic() - started)
                        if ahead > 0:
                            time.sleep(ahead)
            except psycopg.Error:
                self.stop.wait(0.05)

    def longest_gap(self, since: float) -> float:
        times = [at for _, at in self.acked if at >= since]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def missing(info: ConnectionInfo, ca: Path, table: str, acked: list[tuple[int, float]]) -> int:
    with connect(info, ca) as conn:
        present = {row[0] for row in conn.execute(f"SELECT n FROM {table}").fetchall()}
    return sum(1 for n, _ in acked if n not in present)


def commit_rate(info: ConnectionInfo, ca: Path | None, seconds: float) -> float:
    """Single-row commits per second of one client for `seconds`."""
    tls: dict[str, Any] = (
        {"sslmode": "require"} if ca is None else {"sslmode": "verify-full", "sslrootcert": str(ca)}
    )
    with psycopg.connect(**info.libpq(), autocommit=True, prepare_threshold=None, **tls) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS commits (n bigint)")
        count, ends = 0, time.monotonic() + seconds
        while time.monotonic() < ends:
            conn.execute("INSERT INTO commits VALUES (%s)", (count,))
            count += 1
    return count / seconds


async def measure(args: argparse.Namespace) -> dict[str, float]:
    plane = control_plane(args.url, Path(args.data_dir))
    ca = plane.local.ca_store.cert_path
    async with plane.running() as conn:
        org_row = await (
            await conn.execute("INSERT INTO organisations (name) VALUES ('bench') RETURNING id")
        ).fetchone()
        assert org_row is not None
        ha = await plane.ready_instance(conn, org_row["id"], "ha", "small")
        single = await plane.ready_instance(conn, org_row["id"], "single", "dev")
        info = await plane.credentials(conn, ha)
        with connect(info, ca) as customer:
            customer.execute("CREATE TABLE rows (n bigint PRIMARY KEY)")

        # The cost of synchronous replication: one client's commits/s, HA (pooled) and single.
        ha_rate = await asyncio.to_thread(commit_rate, info, ca, args.commit_seconds)
        single_rate = await asyncio.to_thread(
            commit_rate, await plane.credentials(conn, single), None, args.commit_seconds
        )

        # Failover: SIGKILL of the primary's postmaster under the write loop.
        writer = Writer(info, ca, "rows", args.rows_per_s)
        writer.start()
        await asyncio.sleep(args.seconds)
        primary = plane.local.servers.server(ha)
        pid = primary.pid()
        assert pid is not None
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        await until(lambda: state_is(conn, ha, "degraded"), "degraded", 60)
        await until(lambda: state_is(conn, ha, "ready"), "ready again", 300)
        await asyncio.sleep(args.seconds)
        # Writes queue at the pooler while it has no primary (or fail and are retried): the outage is
        # the longest pause between two acknowledgements around the kill.
        rto = writer.longest_gap(killed - 1.0)
        writer.stop.set()
        writer.join(timeout=30)
        lost = missing(info, ca, "rows", writer.acked)
        failover_acked = len(writer.acked)

        # Switchover an SRE asks for, under the same write loop.
        await until(lambda: no_live_jobs(conn, ha), "the heal done", 120)
        with connect(info, ca) as customer:
            customer.execute("CREATE TABLE switched (n bigint PRIMARY KEY)")
        writer = Writer(info, ca, "switched", args.rows_per_s)
        writer.start()
        await asyncio.sleep(args.seconds)
        asked = time.monotonic()
        async with conn.transaction():
            await instances.request_switchover(conn, "ha", SRE, "bench")
        await until(lambda: state_is(conn, ha, "updating"), "switching over", 60)
        await until(lambda: state_is(conn, ha, "ready"), "switched over", 300)
        await asyncio.sleep(args.seconds)
        writer.stop.set()
        writer.join(timeout=30)
        pause = writer.longest_gap(asked)
        switch_lost = missing(info, ca, "switched", writer.acked)
    return {
        "rto_s": rto,
        "rpo_rows_lost": float(lost),
        "failover_rows_acked": float(failover_acked),
        "switchover_pause_s": pause,
        "switchover_rows_lost": float(switch_lost),
        "commits_ha_per_s": ha_rate,
        "commits_single_per_s": single_rate,
    }


async def no_live_jobs(conn: db.AsyncConn, iid: uuid.UUID) -> bool:
    row = await (
        await conn.execute(
            "SELECT count(*) AS n FROM jobs WHERE instance_id = %s"
            " AND state NOT IN ('completed', 'abandoned') AND kind <> 'backup'",
            (iid,),
        )
    ).fetchone()
    return row is not None and row["n"] == 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--rows-per-s", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--commit-seconds", type=float, default=10.0)
    quiet_logs()
    emit(asyncio.run(measure(parser.parse_args())))


if __name__ == "__main__":
    main()
