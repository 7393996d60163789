"""Reconciler processes share the instances by shard: each instance is acted on once, by the holder
of its shard, and a killed process's shards are taken over by the others."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.db.connection import AsyncConn
from tests.factories import make_instance, make_org, walk
from tests.reconciler_support import ROOT, to_ready

SHARDS = 8
PER_BATCH = 24


def start_reconciler(runtime_url: str, data_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "CONTROLPLANE_PROVISIONER": "noop",
        "CONTROLPLANE_RECONCILE_INTERVAL_S": "0.2",
        "CONTROLPLANE_RECONCILE_SHARDS": str(SHARDS),
        "CONTROLPLANE_RECONCILE_BATCH_SIZE": "10",
    }
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", "reconcile", "--database-url", runtime_url,
             "--data-dir", str(data_dir), "--log-format", "json"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def degraded_instances(conn: AsyncConn, org: uuid.UUID, count: int) -> list[uuid.UUID]:
    """Instances the noop provisioner observes healthy: each needs one action, `recover`."""
    ids = []
    for _ in range(count):
        iid = (await make_instance(conn, org))["id"]
        await to_ready(conn, iid)
        await walk(conn, iid, "degrade")
        ids.append(iid)
    return ids


async def recoveries(conn: AsyncConn, ids: list[uuid.UUID]) -> dict[uuid.UUID, list[str]]:
    cursor = await conn.execute(
        "SELECT instance_id, actor_id FROM instance_events WHERE event = 'recover'"
        " AND instance_id = ANY(%s) ORDER BY id",
        (ids,),
    )
    seen: dict[uuid.UUID, list[str]] = {}
    for row in await cursor.fetchall():
        seen.setdefault(row["instance_id"], []).append(row["actor_id"])
    return seen


async def until_recovered(
    conn: AsyncConn, ids: list[uuid.UUID], timeout: float = 60
) -> dict[uuid.UUID, list[str]]:
    deadline = time.monotonic() + timeout
    while True:
        seen = await recoveries(conn, ids)
        if len(seen) == len(ids):
            return seen
        assert time.monotonic() < deadline, f"{len(seen)} of {len(ids)} instances recovered"
        await conn.execute("SELECT pg_sleep(0.1)")  # waits on the database, not on the test's clock


async def shard_holders(conn: AsyncConn) -> dict[int, int]:
    cursor = await conn.execute(
        "SELECT objid::int AS shard, pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND classid = %s::oid AND objsubid = 2",
        (0x63707273,),
    )
    return {row["shard"]: row["pid"] for row in await cursor.fetchall()}


async def until_shared(conn: AsyncConn, processes: int, timeout: float = 60) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        holders = await shard_holders(conn)
        if len(holders) == SHARDS and len(set(holders.values())) == processes:
            return holders
        assert time.monotonic() < deadline, f"shards not shared by {processes} processes: {holders}"
        await conn.execute("SELECT pg_sleep(0.1)")


async def test_two_processes_act_once_per_instance_and_a_killed_ones_shards_are_taken_over(
    conn: AsyncConn, runtime_url: str, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    org = await make_org(conn)
    for n in range(2):
        processes.append(start_reconciler(runtime_url, tmp_path / f"r{n}", tmp_path / f"r{n}.log"))
    await until_shared(conn, 2)

    first = await degraded_instances(conn, org, PER_BATCH)
    seen = await until_recovered(conn, first)
    assert all(len(actors) == 1 for actors in seen.values()), seen  # acted on once each
    actors = {actors[0] for actors in seen.values()}
    assert len(actors) == 2, actors  # both processes took part

    victim = processes[0]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    await until_shared(conn, 1)

    second = await degraded_instances(conn, org, PER_BATCH)
    seen = await until_recovered(conn, second)
    assert all(len(actors) == 1 for actors in seen.values()), seen
    assert len({actors[0] for actors in seen.values()}) == 1  # the survivor, for every shard
    assert all(a.endswith(f"-{processes[1].pid}") for actors in seen.values() for a in actors), seen
    for n in range(2):
        assert b"lost a race" not in (tmp_path / f"r{n}.log").read_bytes()
