"""High availability on the local provisioner, with real servers: an HA plan's standbys streaming
synchronously, its pooled endpoint, and the failover (fenced) after a kill -9 of the primary."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from controlplane.audit import verify as audit
from controlplane.core.kinds import PROVISION
from controlplane.core.step_errors import StaleFence
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor
from controlplane.runtime.settings import Settings
from controlplane.services import instances
from provisioners.base import ConnectionInfo, InstanceSpec
from provisioners.local import LocalProvisioner
from tests.factories import make_instance
from tests.operations_support import (
    Condition,
    enqueue,
    instance,
    instance_in,
    registry_for,
    run_until,
    scalar,
)
from tests.provisioning_support import credentials, real_instances
from tests.reconciler_support import instance_events, live_jobs, passes_until, reconciling, working
from tests.support import eventually, eventually_sync

SMALL = InstanceSpec("small", 1)  # the smallest HA plan: a primary and one standby
SRE = Actor("admin", "sre-1")


@pytest.fixture
def local(pg_root: Path) -> Iterator[LocalProvisioner]:
    with real_instances(pg_root) as settings:
        yield LocalProvisioner(settings)


async def provision_ha(p: LocalProvisioner, instance_id: uuid.UUID, fence: int) -> ConnectionInfo:
    await p.allocate_storage(instance_id, SMALL, fence)
    await p.configure_network(instance_id, SMALL, fence)
    info = await p.initialize_database(instance_id, SMALL, fence)
    await p.configure_archive(instance_id, SMALL, fence)
    await p.start_standbys(instance_id, SMALL, fence)
    return info


def pooled(info: ConnectionInfo, **kwargs: Any) -> psycopg.Connection[Any]:
    """A customer's session through the pooler: TLS, the certificate checked against the CA (the
    pooler pools by transaction: no prepared statements kept across them)."""
    return psycopg.connect(
        **info.libpq(),
        autocommit=True,
        connect_timeout=5,
        sslmode="verify-full",
        sslrootcert=str(kwargs.pop("ca")),
        prepare_threshold=None,
        **kwargs,
    )


def direct(info: ConnectionInfo, ca: Path) -> psycopg.Connection[Any]:
    """A customer's session on the primary's own address (the `direct` of the details)."""
    assert info.direct is not None
    where = {**info.libpq(), "host": info.direct[0], "port": info.direct[1]}
    return psycopg.connect(
        **where, autocommit=True, connect_timeout=5, sslmode="verify-full", sslrootcert=str(ca)
    )


def reading(info: ConnectionInfo, ca: Path) -> psycopg.Connection[Any]:
    """A customer's session on the read-only endpoint (the `read_only` of the details): the same
    user, password and TLS, at the pooler, under the read-only database name."""
    assert info.read_only is not None
    host, port, dbname = info.read_only
    where = {**info.libpq(), "host": host, "port": port, "dbname": dbname}
    return psycopg.connect(
        **where,
        autocommit=True,
        connect_timeout=5,
        sslmode="verify-full",
        sslrootcert=str(ca),
        prepare_threshold=None,
    )


def reads_from_a_standby(info: ConnectionInfo, ca: Path, rows: int) -> int:
    """Through the read-only endpoint: the `rows` committed on the primary are read (once the
    standby replayed them), the server is a standby, and a write is refused (by PostgreSQL, also
    when the session asks for writes). Returns the server's port."""
    with reading(info, ca) as conn:
        eventually_sync(
            lambda: conn.execute("SELECT count(*) FROM rows").fetchone() == (rows,),
            f"{rows} rows through the read-only endpoint",
        )
        assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("INSERT INTO rows VALUES (-1)")
        conn.execute("SET default_transaction_read_only = off")
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("INSERT INTO rows VALUES (-1)")
        row = conn.execute("SELECT inet_server_port()").fetchone()
    assert row is not None
    return int(row[0])


def standby_port(p: LocalProvisioner, instance_id: uuid.UUID, member: int) -> int:
    return p.servers.server(instance_id, member=member).port


def pooler_targets(p: LocalProvisioner, instance_id: uuid.UUID) -> dict[str, int]:
    """The server port the pooler leads each of its databases to, as its admin console shows."""
    port = p.pooler.port(instance_id)
    assert port is not None
    with psycopg.connect(
        host=p.network.connect_host,
        port=port,
        user="cp_admin",
        password=p.storage.unseal(p.storage.load_state(instance_id)["admin_password"]),
        dbname="pgbouncer",
        autocommit=True,
        connect_timeout=5,
        sslmode="verify-full",
        sslrootcert=str(p.ca_store.cert_path),
        prepare_threshold=None,
    ) as console:
        cursor = console.execute("SHOW DATABASES")
        names = [column.name for column in cursor.description or ()]
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    return {str(row["name"]): int(row["port"]) for row in rows if row["name"] != "pgbouncer"}


def admin_on(
    p: LocalProvisioner, instance_id: uuid.UUID, member: int, dbname: str = "app"
) -> psycopg.Connection[Any]:
    server = p.servers.server(instance_id, member=member)
    return p.admin.connect(instance_id, server.port, dbname=dbname)


async def test_an_ha_plan_runs_a_primary_and_a_synchronous_standby_behind_a_pooler(
    local: LocalProvisioner,
) -> None:
    iid = uuid.uuid4()
    info = await provision_ha(local, iid, fence=1)
    ca = local.ca_store.cert_path
    # The customer's endpoint is the pooler's (transaction pooling), the primary's own port beside it.
    assert info.pool_mode == "transaction" and info.direct is not None
    assert info.port == local.pooler.port(iid) and info.direct[1] == local.network.require_port(iid)
    assert info.public()["direct"] == {"host": info.direct[0], "port": info.direct[1]}
    # The read-only endpoint: the pooler's address, under the database name `app_readonly`.
    assert info.read_only == (info.host, info.port, "app_readonly")
    assert info.public()["read_only"] == {"host": info.host, "port": info.port, "dbname": "app_readonly"}
    with pooled(info, ca=ca) as conn:
        conn.execute("CREATE TABLE rows (n int PRIMARY KEY)")
        conn.execute("INSERT INTO rows VALUES (1)")
        assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone() == (True,)
    # It leads to the standby: the row committed on the primary is read there, a write refused.
    assert reads_from_a_standby(info, ca, rows=1) == standby_port(local, iid, 1)
    with pytest.raises(psycopg.OperationalError):  # plain TCP to the pooler is refused
        psycopg.connect(**info.libpq(), sslmode="disable", connect_timeout=5)

    # Two servers: the primary, and a standby streaming from it, which confirms every commit.
    with admin_on(local, iid, 0) as primary:
        replication = primary.execute(
            "SELECT application_name, state, sync_state FROM pg_stat_replication"
        ).fetchall()
        assert replication == [("member1", "streaming", "quorum")]
        assert primary.execute("SHOW synchronous_standby_names").fetchone() == ('ANY 1 ("member1")',)
    with admin_on(local, iid, 1) as standby:
        assert standby.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
    seen = await local.observe(iid)
    assert seen.healthy and seen.servers == 2 and seen.standbys_streaming == 1
    assert not seen.replication_degraded and seen.failover_to is None
    kinds = sorted(r.kind for r in await local.inventory())
    assert kinds == [
        "data_directory", "pooler", "pooler_port", "port", "server", "standby_port", "standby_server"
    ]  # fmt: skip

    # The only standby stopped: commits wait (none is acknowledged on one server), the instance
    # shows it; the standby started again by the same step, the waiting commit is acknowledged.
    local.servers.server(iid, member=1).stop("immediate")
    seen = await local.observe(iid)
    assert seen.replication_degraded and seen.standbys_streaming == 0
    assert "0 of 1 standbys streaming" in seen.replication_detail
    # The read-only endpoint still leads to the standby, never to the primary (reads there wait
    # at the pooler for it; only a standby refuses every write).
    assert pooler_targets(local, iid) == {"app": info.direct[1], "app_readonly": standby_port(local, iid, 1)}
    done = threading.Event()

    def write() -> None:
        with pooled(info, ca=ca) as conn:
            conn.execute("INSERT INTO rows VALUES (2)")
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    with admin_on(local, iid, 0) as primary:

        def waits_for_a_standby() -> bool:
            row = primary.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
            ).fetchone()
            return row == (1,)

        eventually_sync(waits_for_a_standby, "the commit waiting for a standby")
    assert not done.is_set()
    assert await local.start_standbys(iid, SMALL, fence=2) is True
    writer.join(timeout=60)
    assert done.is_set()
    with admin_on(local, iid, 1) as standby:
        eventually_sync(
            lambda: standby.execute("SELECT count(*) FROM rows").fetchone() == (2,), "row 2 on the standby"
        )
    assert not (await local.observe(iid)).replication_degraded
    assert reads_from_a_standby(info, ca, rows=2) == standby_port(local, iid, 1)

    await local.deprovision(iid, SMALL, fence=3, skip_backup=True)
    assert not local.instance_dir(iid).exists() and await local.inventory() == []


def recovered(instance_id: uuid.UUID) -> Condition:
    """Ready again with no job left: whatever repaired it has finished."""

    async def check(conn: AsyncConn) -> bool:
        return await instance_in(instance_id, "ready")(conn) and not await live_jobs(conn, instance_id)

    return check


class Writer:
    """Sequential rows committed through the pooled endpoint, one at a time, until stopped: those
    acknowledged are recorded; a failed one is tried again (new session) with the same number."""

    def __init__(self, info: ConnectionInfo, ca: Path) -> None:
        self.info, self.ca = info, ca
        self.acknowledged: list[int] = []
        self.failures = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 1
        while not self.stop.is_set():
            try:
                with pooled(self.info, ca=self.ca) as conn:
                    while not self.stop.is_set():
                        conn.execute("INSERT INTO rows VALUES (%s) ON CONFLICT DO NOTHING", (n,))
                        self.acknowledged.append(n)
                        n += 1
            except psycopg.Error:
                self.failures += 1
                self.stop.wait(0.1)

    def __enter__(self) -> Writer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


async def test_a_killed_primary_fails_over_fenced_once_through_the_lifecycle(
    conn: AsyncConn, local_settings: Settings
) -> None:
    local = LocalProvisioner(local_settings)
    registry = registry_for(local)
    iid: uuid.UUID = (await make_instance(conn, plan="small"))["id"]
    await enqueue(conn, PROVISION, iid)
    await run_until(local_settings, registry, instance_in(iid, "ready"))
    before = await instance(conn, iid)
    info = credentials(local_settings, before)
    ca = local.ca_store.cert_path
    with pooled(info, ca=ca) as customer:
        customer.execute("CREATE TABLE rows (n int PRIMARY KEY)")
    provisioned_fence = await scalar(
        conn, "SELECT fence FROM jobs WHERE instance_id = %s AND kind = 'provision'", (iid,)
    )

    async with (
        reconciling(local_settings, local, reconciler_id="rec-a") as one,
        reconciling(local_settings, local, reconciler_id="rec-b") as other,
    ):
        with Writer(info, ca) as writer:
            eventually_sync(lambda: len(writer.acknowledged) >= 20, "rows written before the kill")
            # kill -9 of the primary's postmaster, under the write loop.
            primary = local.servers.server(iid, member=0)
            pid = primary.pid()
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            primary.wait_until_down()
            acknowledged_at_kill = len(writer.acknowledged)

            # Two reconcilers find it at once: one degrades it and enqueues the heal, once.
            first, second = await asyncio.gather(one.run_once(), other.run_once())
            degrades = first.actions.get("degrade", 0) + second.actions.get("degrade", 0)
            heals = first.actions.get("enqueue_heal", 0) + second.actions.get("enqueue_heal", 0)
            assert (degrades, heals) == (1, 1)
            row = await instance(conn, iid)
            assert (row["state"], row["failure_code"]) == ("degraded", "failover")
            assert (
                "primary lost" in row["failure_reason"] and "member1 can take over" in row["failure_reason"]
            )

            async with working(local_settings, registry):
                await passes_until(one, recovered(iid), timeout_s=120)
                eventually_sync(
                    lambda: len(writer.acknowledged) > acknowledged_at_kill + 20, "writes after the failover"
                )
        acknowledged = list(writer.acknowledged)

    # Every acknowledged row is there, on the promoted server, through the same endpoint.
    after = await instance(conn, iid)
    assert (after["connection"]["host"], after["connection"]["port"]) == (info.host, info.port)
    # The read-only endpoint is the same, and leads to the rebuilt old primary, a standby now.
    assert after["connection"]["read_only"] == before["connection"]["read_only"]
    assert credentials(local_settings, after).read_only == (info.host, info.port, "app_readonly")
    assert after["connection"]["direct"]["port"] == local.servers.server(iid, member=1).port
    with pooled(credentials(local_settings, after), ca=ca) as customer:
        present = {r[0] for r in customer.execute("SELECT n FROM rows").fetchall()}
    # (Through the pooler most writes never fail: they wait there until it points at the new primary.)
    assert set(acknowledged) <= present and max(acknowledged) > acknowledged_at_kill
    served_by = reads_from_a_standby(credentials(local_settings, after), ca, rows=len(present))
    assert served_by == standby_port(local, iid, 0)
    assert pooler_targets(local, iid) == {"app": standby_port(local, iid, 1), "app_readonly": served_by}

    # The audit log: ready -> degraded (failover) -> ready with the promotion, by the worker.
    events = [(f, t, e) for f, t, e, _ in await instance_events(conn, iid)]
    assert events[-2:] == [("ready", "degraded", "degrade"), ("degraded", "ready", "recover")]
    cursor = await conn.execute(
        "SELECT reason, detail FROM instance_events WHERE instance_id = %s ORDER BY id DESC LIMIT 1", (iid,)
    )
    recover = await cursor.fetchone()
    assert recover is not None
    failover = recover["detail"]["failover"]
    assert (failover["promoted"], failover["fenced"]) == ("member1", "member0")
    assert failover["lsn"] and failover["writes_refused_s"] >= 0
    assert recover["reason"].startswith("failover: member1 promoted at WAL")
    # The fenced steps ran once each (one heal job: one promotion).
    cursor = await conn.execute(
        "SELECT step, count(*) AS n FROM job_steps WHERE instance_id = %s AND event = 'finished'"
        " AND step IN ('fence_primary', 'promote_standby') GROUP BY step ORDER BY step",
        (iid,),
    )
    assert [(r["step"], r["n"]) for r in await cursor.fetchall()] == [
        ("fence_primary", 1),
        ("promote_standby", 1),
    ]
    assert await audit.verify(conn) == []

    # The old primary was rebuilt as a standby of the new one, by itself.
    with admin_on(local, iid, 0, "postgres") as old:
        assert old.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
    seen = await local.observe(iid)
    assert seen.healthy and seen.standbys_streaming == 1

    # A stale worker's step (the provisioning job's fence) is refused by the fence.
    spec = InstanceSpec("small", 1)
    with pytest.raises(StaleFence):
        await local.promote_standby(iid, spec, provisioned_fence)
    with pytest.raises(StaleFence):
        await local.fence_primary(iid, spec, provisioned_fence)

    # An SRE's switchover moves the primary back, through the lifecycle, audited with who and why.
    async with conn.transaction():
        job_id = await instances.request_switchover(conn, after["name"], SRE, "host maintenance")
    async with working(local_settings, registry):
        await eventually(lambda: recovered(iid)(conn), "the switchover done", timeout_s=120)
    assert local.storage.primary_member(iid) == 0
    cursor = await conn.execute(
        "SELECT from_state, to_state, actor_kind, actor_id, reason, detail FROM instance_events"
        " WHERE instance_id = %s ORDER BY id DESC LIMIT 2",
        (iid,),
    )
    updated, update = await cursor.fetchall()
    assert (update["from_state"], update["to_state"]) == ("ready", "updating")
    assert update["reason"] == "switchover asked by admin:sre-1: host maintenance"
    assert update["detail"]["job_id"] == str(job_id)
    assert (updated["from_state"], updated["to_state"]) == ("updating", "ready")
    assert updated["detail"]["switchover"]["promoted"] == "member0"
    assert updated["reason"].startswith("switchover: member0 is the primary")
    final = await instance(conn, iid)
    assert (final["connection"]["host"], final["connection"]["port"]) == (info.host, info.port)
    with pooled(credentials(local_settings, final), ca=ca) as customer:
        assert {r[0] for r in customer.execute("SELECT n FROM rows").fetchall()} >= set(acknowledged)


async def test_a_switchover_pauses_writes_at_the_pooler_and_loses_none(local: LocalProvisioner) -> None:
    iid = uuid.uuid4()
    info = await provision_ha(local, iid, fence=1)
    ca = local.ca_store.cert_path
    with pooled(info, ca=ca) as conn:
        conn.execute("CREATE TABLE rows (n int PRIMARY KEY)")
    with Writer(info, ca) as writer:
        eventually_sync(lambda: len(writer.acknowledged) >= 20, "rows written before the switchover")
        promotion = await local.switchover(iid, SMALL, fence=2)
        assert promotion is not None and (promotion.promoted, promotion.fenced) == ("member1", "member0")
        at_switchover = len(writer.acknowledged)
        eventually_sync(lambda: len(writer.acknowledged) > at_switchover + 20, "writes after the switchover")
    assert local.storage.primary_member(iid) == 1
    with pooled(info, ca=ca) as conn:
        present = {r[0] for r in conn.execute("SELECT n FROM rows").fetchall()}
        assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (False,)
    assert set(writer.acknowledged) <= present
    # The old primary follows the new one as its synchronous standby, without a new seed.
    with admin_on(local, iid, 0, "postgres") as old:
        assert old.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
    with admin_on(local, iid, 1, "postgres") as new:
        eventually_sync(
            lambda: (
                new.execute("SELECT application_name, sync_state FROM pg_stat_replication").fetchall()
                == [("member0", "quorum")]
            ),
            "member0 streaming from member1",
        )
    assert (await local.observe(iid)).standbys_streaming == 1
    # The read-only endpoint followed: it leads to the old primary, a standby now.
    assert reads_from_a_standby(info, ca, rows=len(present)) == standby_port(local, iid, 0)
    # A stale step (a lower fence) is refused.
    with pytest.raises(StaleFence):
        await local.switchover(iid, SMALL, fence=1)


async def test_a_suspended_ha_instance_is_read_only_on_every_server_and_resumes_whole(
    local: LocalProvisioner,
) -> None:
    iid = uuid.uuid4()
    info = await provision_ha(local, iid, fence=1)
    ca = local.ca_store.cert_path
    with pooled(info, ca=ca) as conn:
        conn.execute("CREATE TABLE rows (n int PRIMARY KEY)")
        conn.execute("INSERT INTO rows VALUES (1)")

    assert await local.suspend(iid, SMALL, fence=2) is True
    for member in (0, 1):  # every server refuses writes, whatever a session tries
        with admin_on(local, iid, member) as server:
            assert server.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
    with pooled(info, ca=ca) as conn:
        assert conn.execute("SELECT count(*) FROM rows").fetchone() == (1,)
        conn.execute("SET default_transaction_read_only = off")
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("INSERT INTO rows VALUES (2)")
    with direct(info, ca) as conn, pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        conn.execute("INSERT INTO rows VALUES (2)")
    assert (await local.observe(iid)).read_only is True

    # Resumed: the primary writable again, its standby following it onto its new timeline.
    assert await local.resume(iid, SMALL, fence=3) is True
    with admin_on(local, iid, 0, "postgres") as primary:
        eventually_sync(
            lambda: (
                primary.execute("SELECT application_name, sync_state FROM pg_stat_replication").fetchall()
                == [("member1", "quorum")]
            ),
            "member1 streaming again",
        )
    with pooled(info, ca=ca) as conn:
        conn.execute("INSERT INTO rows VALUES (2)")
    with admin_on(local, iid, 1) as standby:
        assert standby.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
        eventually_sync(
            lambda: standby.execute("SELECT count(*) FROM rows").fetchone() == (2,), "row 2 on the standby"
        )
    seen = await local.observe(iid)
    assert seen.read_only is False and seen.standbys_streaming == 1


async def test_an_ha_resize_rolls_the_standbys_then_switches_over_instead_of_restarting_the_primary(
    local: LocalProvisioner,
) -> None:
    iid = uuid.uuid4()
    info = await provision_ha(local, iid, fence=1)
    ca = local.ca_store.cert_path
    with pooled(info, ca=ca) as conn:
        conn.execute("CREATE TABLE rows (n int PRIMARY KEY)")
    medium = InstanceSpec("medium", 2)
    with Writer(info, ca) as writer:
        eventually_sync(lambda: len(writer.acknowledged) >= 20, "rows written before the resize")
        assert await local.apply_plan(iid, medium, fence=2) is True
        at_resize = len(writer.acknowledged)
        eventually_sync(lambda: len(writer.acknowledged) > at_resize + 20, "writes after the resize")
    # The primary was not restarted: the standby, restarted first with the plan, took over.
    assert local.storage.primary_member(iid) == 1
    with pooled(info, ca=ca) as conn:
        present = {r[0] for r in conn.execute("SELECT n FROM rows").fetchall()}
        assert conn.execute("SHOW max_connections").fetchone() == ("100",)
    assert set(writer.acknowledged) <= present
    # Three servers on the plan's settings: the old primary and a new one are the standbys.
    for member in (0, 2):
        with admin_on(local, iid, member, "postgres") as standby:
            assert standby.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
            assert standby.execute("SHOW max_connections").fetchone() == ("100",)
    with admin_on(local, iid, 1, "postgres") as primary:
        assert primary.execute("SHOW synchronous_standby_names").fetchone() == (
            'ANY 1 ("member0", "member2")',
        )
    seen = await local.observe(iid)
    assert (seen.servers, seen.standbys_streaming, seen.plan_applied) == (3, 2, "medium")
    assert await local.apply_plan(iid, medium, fence=2) is False
