"""The reconciler loop: leader election by advisory lock (objects, loops, processes) and bounded passes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from provisioners.base import Observation
from reconciler.leader import LeaderElection
from reconciler.maintenance import Maintenance
from reconciler.reconciler import PassSummary, Reconciler
from tests.factories import make_instance, make_org
from tests.operations_support import registry_for, scalar
from tests.reconciler_support import ScriptedProvisioner, reconciler_processes, reconciling, to_ready


async def backend_gone(conn: AsyncConn, pid: int) -> None:
    """Terminate a backend and wait (server side) until it has exited and released its locks."""
    assert await scalar(conn, "SELECT pg_terminate_backend(%s, 10000)", (pid,)) is True


async def backend_exited(conn: AsyncConn, pid: int, timeout_s: float = 10) -> None:
    """Wait until the server has ended backend `pid` (its client hung up; the server must act)."""
    deadline = time.monotonic() + timeout_s
    while await scalar(conn, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)):
        assert time.monotonic() < deadline, f"backend {pid} still there after {timeout_s}s"
        await asyncio.sleep(0.01)


async def test_one_election_leads_and_the_standby_takes_over_when_its_connection_dies(
    conn: AsyncConn, fresh_database: str
) -> None:
    first, second = LeaderElection(fresh_database), LeaderElection(fresh_database)
    try:
        assert await first.ensure() is True
        assert await second.ensure() is False
        assert await first.ensure() is True and await second.ensure() is False  # stable
        assert first.is_leader and not second.is_leader

        # The leader's connection closes: the standby takes over at its next ensure().
        assert first._conn is not None
        pid = first._conn.info.backend_pid
        await first._conn.close()
        await backend_exited(conn, pid)
        assert await second.ensure() is True
        assert await first.ensure() is False and not first.is_leader

        # The new leader's backend is terminated from the server side: the same, the other way.
        assert second._conn is not None
        await backend_gone(conn, second._conn.info.backend_pid)
        assert await first.ensure() is True
        assert await second.ensure() is False and not second.is_leader
        holders = await scalar(
            conn,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        assert holders == 1
    finally:
        await first.release()
        await second.release()


async def test_a_leader_whose_connection_broke_stands_down_for_one_round(
    conn: AsyncConn, fresh_database: str
) -> None:
    alone = LeaderElection(fresh_database)
    try:
        assert await alone.ensure() is True
        assert alone._conn is not None
        await backend_gone(conn, alone._conn.info.backend_pid)
        # The lock is free, but the replica whose session was cut leaves it to a standby this round.
        assert await alone.ensure() is False and not alone.is_leader
        assert await alone.ensure() is True and alone.is_leader
    finally:
        await alone.release()


class Recording(LeaderElection):
    """A LeaderElection that records when each ensure() began and what it answered."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.tries: list[tuple[float, bool]] = []

    async def ensure(self) -> bool:
        began = time.monotonic()
        leads = await super().ensure()
        self.tries.append((began, leads))
        return leads


class Counting(Reconciler):
    """A Reconciler that counts its passes and wakes the test after each."""

    passes = 0
    woke: asyncio.Event

    async def run_once(self, now: datetime | None = None, **kwargs: Any) -> PassSummary:
        summary = await super().run_once(now, **kwargs)
        self.passes += 1
        self.woke.set()
        return summary


async def until_passes(recs: list[Counting], enough: int, timeout_s: float = 10) -> None:
    """Wait (woken by each pass) until the reconcilers together ran `enough` passes."""
    deadline = time.monotonic() + timeout_s
    while sum(r.passes for r in recs) < enough:
        for rec in recs:
            rec.woke.clear()
        waiters = [asyncio.create_task(rec.woke.wait()) for rec in recs]
        _, pending = await asyncio.wait(
            waiters, timeout=deadline - time.monotonic(), return_when="FIRST_COMPLETED"
        )
        for waiter in pending:
            waiter.cancel()
        if time.monotonic() > deadline:
            raise AssertionError(f"only {[r.passes for r in recs]} passes within {timeout_s}s")


async def test_of_two_reconciler_loops_only_the_leader_runs_passes(
    conn: AsyncConn, settings: Settings, fresh_database: str
) -> None:
    settings = settings.replace(reconcile_interval_s=0.1)
    recs: list[Counting] = []
    elections = [Recording(fresh_database), Recording(fresh_database)]
    pools = [db.pool(fresh_database, max_size=3, name=f"rec-{i}") for i in range(2)]
    stop = asyncio.Event()
    for i, pool in enumerate(pools):
        await pool.open(wait=True)
        provisioner = ScriptedProvisioner()
        maintenance = Maintenance(
            settings, pool, provisioner, registry_for(provisioner), maintainer_id=f"rec-{i}"
        )
        rec = Counting(settings, pool, provisioner, reconciler_id=f"rec-{i}", maintenance=maintenance)
        rec.woke = asyncio.Event()
        recs.append(rec)
    loops = [
        asyncio.create_task(rec.run(stop, election)) for rec, election in zip(recs, elections, strict=True)
    ]
    try:
        await until_passes(recs, 5)
        (leader,) = [i for i in (0, 1) if recs[i].passes]
        standby = 1 - leader
        assert recs[standby].passes == 0
        assert elections[leader].is_leader and not elections[standby].is_leader

        conn_of_leader = elections[leader]._conn
        assert conn_of_leader is not None
        # The leader is cut off: its session is terminated and it can no longer reach the server
        # (a network partition), so only the standby can take the lock.
        elections[leader].url = "postgresql://nobody@127.0.0.1:1/unreachable?connect_timeout=1"
        cut = time.monotonic()
        await backend_gone(conn, conn_of_leader.info.backend_pid)
        freed = time.monotonic()  # the backend has exited: its advisory lock is released
        await until_passes([recs[standby]], 1)
        takeover = time.monotonic() - cut
        print(f"\nin-process takeover after the leader's connection died: {takeover:.3f}s")
        await until_passes([recs[standby]], 3)
        after_takeover = recs[leader].passes  # at most one pass was already under way
        await until_passes([recs[standby]], 6)
        assert recs[leader].passes == after_takeover
        # Within one interval: every try of the standby that began once the lock was free won it.
        tries_after = [leads for began, leads in elections[standby].tries if began > freed]
        assert tries_after and all(tries_after), tries_after
        assert elections[standby].is_leader and not elections[leader].is_leader
    finally:
        stop.set()
        await asyncio.gather(*loops)
        for election in elections:
            await election.release()
        for pool in pools:
            await pool.close()


def is_pass(entry: dict[str, object]) -> bool:
    return entry.get("msg") == "reconciler pass"


def test_two_reconciler_processes_one_leads_and_kill_9_hands_over(
    fresh_database: str, tmp_path: Path
) -> None:
    interval = 0.2
    data_dir = tmp_path / "data"
    with reconciler_processes(fresh_database, data_dir, ("a", "b"), interval) as procs:
        # Each process either leads (and passes) or stands by; wait until both have said which.
        for proc in procs.values():
            proc.wait_for(
                lambda e: (
                    e.get("msg")
                    in (
                        "reconciler became leader",
                        "reconciler standing by: another replica holds the leader lock",
                    )
                ),
                timeout_s=30,
            )
        leaders = [name for name, proc in procs.items() if proc.messages("reconciler became leader")]
        assert len(leaders) == 1, leaders
        leader, standby = procs[leaders[0]], procs[({"a", "b"} - set(leaders)).pop()]
        # Several passes by the leader; the other reconciles its shards of the instances only
        # (tests/integration/test_reconciler_shards.py), and never leads while the leader lives.
        leader.wait_for(lambda e: is_pass(e) and len(leader.messages("reconciler pass")) >= 4, timeout_s=10)
        assert standby.messages("reconciler became leader") == []

        killed = time.monotonic()
        os.kill(leader.proc.pid, signal.SIGKILL)
        took_over = standby.wait_for(lambda e: e.get("msg") == "reconciler became leader", timeout_s=10)
        first_pass = standby.wait_for(is_pass, timeout_s=10)
        print(
            f"\nreconciler process takeover after kill -9: leader after {took_over - killed:.3f}s,"
            f" first pass after {first_pass - killed:.3f}s (interval {interval}s)"
        )
        assert leader.proc.wait(timeout=10) == -signal.SIGKILL
        standby.wait_for(lambda e: is_pass(e) and len(standby.messages("reconciler pass")) >= 3, timeout_s=10)


class Slow(ScriptedProvisioner):
    """Observes take a little while; the most observes ever in flight at once is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.most = 0
        self.calls = 0

    async def observe(self, instance_id: uuid.UUID) -> Observation:
        self.in_flight += 1
        self.calls += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(0.01)
            return await super().observe(instance_id)
        finally:
            self.in_flight -= 1


async def test_a_pass_is_bounded_in_batch_size_and_in_concurrent_provisioner_calls(
    conn: AsyncConn, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    settings = settings.replace(reconcile_batch_size=40, reconcile_concurrency=3)
    org = await make_org(conn)
    ids = [(await make_instance(conn, org))["id"] for _ in range(100)]
    for iid in ids:
        await to_ready(conn, iid)
    slow = Slow()
    caplog.set_level(logging.DEBUG, logger="reconciler.reconciler")
    async with reconciling(settings, slow) as rec:
        scanned = [(await rec.run_once()).scanned for _ in range(3)]
    assert scanned == [40, 40, 40]
    assert slow.calls == 120 and slow.most == 3
    # Least recently reconciled first: after three passes every instance was looked at.
    assert await scalar(conn, "SELECT count(*) FROM instances WHERE last_reconciled_at IS NULL") == 0
    logged = [r for r in caplog.records if r.getMessage() == "reconciler pass"]
    assert [r.__dict__["scanned"] for r in logged] == [40, 40, 40]


class Corrupting(ScriptedProvisioner):
    """While the pass observes `victim`, its row is changed behind the transition path (the guard
    trigger skipped, as a restore or a hand-made write with triggers off would), and it looks down."""

    def __init__(self, url: str, victim: uuid.UUID) -> None:
        super().__init__()
        self.url = url
        self.victim = victim

    async def observe(self, instance_id: uuid.UUID) -> Observation:
        if instance_id != self.victim:
            return await super().observe(instance_id)
        conn = await db.connect(self.url)
        async with conn:
            await conn.execute("SET session_replication_role = replica")
            await conn.execute("UPDATE instances SET state = 'suspended' WHERE id = %s", (instance_id,))
        return Observation(True, detail="server not running")


async def test_a_pass_survives_an_invariant_violation_on_one_instance(
    conn: AsyncConn, settings: Settings, fresh_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    org = await make_org(conn)
    victim, other = (await make_instance(conn, org))["id"], (await make_instance(conn, org))["id"]
    for iid in (victim, other):
        await to_ready(conn, iid)
    await conn.execute("UPDATE instances SET spec_generation = 2 WHERE id = %s", (other,))
    before = REGISTRY.get_sample_value("controlplane_invariant_violations_total", {"entity": "instance"}) or 0
    async with reconciling(settings, Corrupting(fresh_database, victim)) as rec:
        summary = await rec.run_once()
    assert (summary.invariant_violations, summary.actions) == (1, {"enqueue_update": 1})
    after = REGISTRY.get_sample_value("controlplane_invariant_violations_total", {"entity": "instance"})
    assert after == before + 1
    assert any(
        r.levelno == logging.CRITICAL and r.getMessage().startswith(f"invariant violation: instance {victim}")
        for r in caplog.records
    )
    row = await scalar(conn, "SELECT state || ':' || state_version FROM instances WHERE id = %s", (victim,))
    assert row == "suspended:2"  # left as found, for an SRE; no event row was written for it
    assert await scalar(conn, "SELECT count(*) FROM instance_events WHERE instance_id = %s", (victim,)) == 3
