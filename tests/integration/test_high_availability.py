"""High availability on the local provisioner, with real servers: an HA plan's standbys streaming
synchronously, its pooled endpoint, and the failover (fenced) after a kill -9 of the primary."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from provisioners.base import ConnectionInfo, InstanceSpec
from provisioners.local import LocalProvisioner
from tests.provisioning_support import real_instances
from tests.support import eventually_sync

SMALL = InstanceSpec("small", 1)  # the smallest HA plan: a primary and one standby


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
    with pooled(info, ca=ca) as conn:
        conn.execute("CREATE TABLE rows (n int PRIMARY KEY)")
        conn.execute("INSERT INTO rows VALUES (1)")
        assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone() == (True,)
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

    await local.deprovision(iid, SMALL, fence=3, skip_backup=True)
    assert not local.instance_dir(iid).exists() and await local.inventory() == []
