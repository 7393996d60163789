from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from controlplane.core.step_errors import StaleFence, TemporaryError
from controlplane.runtime.postgres import port_in_use
from provisioners.base import ConnectionInfo, DataLost, InstanceSpec, RestorePoint
from provisioners.local import LocalProvisioner, owner_role
from tests.provisioning_support import connect, real_instances

DEV = InstanceSpec("dev", 1)


@pytest.fixture
def local(pg_root: Path) -> Iterator[LocalProvisioner]:
    with real_instances(pg_root) as settings:
        yield LocalProvisioner(settings)


async def provision(
    p: LocalProvisioner, instance_id: uuid.UUID, fence: int, spec: InstanceSpec = DEV
) -> ConnectionInfo:
    await p.allocate_storage(instance_id, spec, fence)
    await p.configure_network(instance_id, spec, fence)
    return await p.initialize_database(instance_id, spec, fence)


def cannot_write(conn: psycopg.Connection[object]) -> None:
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        conn.execute("INSERT INTO notes VALUES ('while suspended')")


async def test_one_instance_through_its_whole_life(local: LocalProvisioner) -> None:
    iid = uuid.uuid4()
    info = await provision(local, iid, fence=10)
    assert info.port in range(
        local.settings.provisioner.local_port_min, local.settings.provisioner.local_port_max + 1
    )
    assert info.user == owner_role(iid) and len(info.password) >= 24

    # Every step run again creates nothing twice and adopts the same credentials.
    again = await provision(local, iid, fence=10)
    assert again == info and again.password == info.password
    assert [r.kind for r in await local.inventory()] == ["data_directory", "server", "port"]
    assert sorted(p.name for p in local.instance_dir(iid).iterdir()) == ["pgdata", "pgdata.log", "state.json"]
    assert local.roles(iid) == [info.user]

    owner = connect(info)
    owner.execute("CREATE TABLE notes (body text)")
    owner.execute("INSERT INTO notes VALUES ('hello')")
    is_super = owner.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
    assert is_super == (False,)
    observed = await local.observe(iid)
    assert observed.healthy and observed.read_only is False and observed.endpoint == (info.host, info.port)

    # Suspended: the open session is ended, a new one reads but cannot write, whatever it tries.
    assert await local.suspend(iid, DEV, fence=11) is True
    assert await local.suspend(iid, DEV, fence=11) is False
    with pytest.raises(psycopg.OperationalError):
        owner.execute("INSERT INTO notes VALUES ('same session')")
    reader = connect(info)
    assert reader.execute("SELECT count(*) FROM notes").fetchone() == (1,)
    cannot_write(reader)
    reader.execute("SET default_transaction_read_only = off")
    cannot_write(reader)
    reader.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE")
    cannot_write(reader)
    with pytest.raises(psycopg.errors.FeatureNotSupported), reader.transaction():
        reader.execute("SET TRANSACTION READ WRITE")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        reader.execute("SELECT pg_promote()")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        reader.execute("ALTER SYSTEM SET default_transaction_read_only = off")
    assert (await local.observe(iid)).read_only is True

    # Resumed: writes work again, in new sessions.
    assert await local.resume(iid, DEV, fence=12) is True
    assert await local.resume(iid, DEV, fence=12) is False
    writer = connect(info)
    writer.execute("INSERT INTO notes VALUES ('after resume')")
    assert (await local.observe(iid)).read_only is False

    # A plan change restarts with the plan's settings; applying it again changes nothing.
    small = InstanceSpec("small", 2)
    assert await local.apply_plan(iid, small, fence=13) is True
    assert await local.apply_plan(iid, small, fence=13) is False
    resized = connect(info)
    assert resized.execute("SHOW max_connections").fetchone() == ("50",)
    assert resized.execute("SHOW shared_buffers").fetchone() == ("128MB",)
    observed = await local.observe(iid)
    assert (observed.plan_applied, observed.generation) == ("small", 2)
    for session in (owner, reader, writer, resized):
        session.close()

    # A lower fence than one already seen is refused, by every step.
    with pytest.raises(StaleFence):
        await local.apply_plan(iid, DEV, fence=12)
    with pytest.raises(StaleFence):
        await local.deprovision(iid, DEV, fence=3)

    # Deprovision: a final pgBackRest backup (kept with the archive for the plan's retention), server
    # stopped, directory and port gone; again is a no-op that adopts the same final backup.
    result = await local.deprovision(iid, small, fence=14)
    kept = await local.list_backups(iid)
    assert [(b.location, b.kind) for b in kept] == [(result.backup, "final")]
    window = await local.recovery_window(iid)
    assert window is not None and window.retained_until is not None and window.earliest is not None
    assert not local.instance_dir(iid).exists()
    assert local.ports.port_of(iid) is None and not port_in_use(info.port)
    assert await local.inventory() == []
    assert (await local.observe(iid)).exists is False
    again_result = await local.deprovision(iid, small, fence=14)
    assert again_result.removed is False and again_result.backup == result.backup
    assert await local.list_backups(iid) == kept


def occupy(port: int) -> socket.socket:
    """Another process's listener on `port` (of the loopback address the instances use)."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


async def test_a_port_taken_before_the_first_start_is_left_for_a_free_one(local: LocalProvisioner) -> None:
    # Taken before configure_network, and again between it and the server's first start (a retry of
    # initialize_database does not run configure_network again): the server starts on a free port.
    iid = uuid.uuid4()
    await local.allocate_storage(iid, DEV, fence=1)
    first = local.ports.allocate(iid)
    with occupy(first):
        await local.configure_network(iid, DEV, fence=1)
        second = local.ports.port_of(iid)
        assert second is not None and second != first
        with occupy(second):
            info = await local.initialize_database(iid, DEV, fence=1)
    assert info.port not in (first, second) and local.ports.port_of(iid) == info.port
    with connect(info) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    # Running, the server keeps its port: it is the one holding it.
    assert (await local.initialize_database(iid, DEV, fence=1)).port == info.port


def kill(local: LocalProvisioner, instance_id: uuid.UUID) -> None:
    server = local._server(instance_id)
    pid = server.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    server.wait_until_down()


async def test_a_plan_lowered_while_the_server_was_down_does_not_stop_its_standby_start(
    local: LocalProvisioner,
) -> None:
    # small (50 connections) killed; the plan goes down to dev (20) while it is down; then a billing
    # hold starts it in standby mode, below what pg_control recorded: PostgreSQL alone refuses that.
    iid = uuid.uuid4()
    small, dev = InstanceSpec("small", 1), InstanceSpec("dev", 2)
    info = await provision(local, iid, fence=1, spec=small)
    with connect(info) as owner:
        owner.execute("CREATE TABLE notes (body text)")
        owner.execute("INSERT INTO notes VALUES ('kept')")
    kill(local, iid)
    assert await local.apply_plan(iid, dev, fence=2) is True
    assert await local.suspend(iid, dev, fence=3) is True
    with connect(info) as reader:
        assert reader.execute("SHOW max_connections").fetchone() == ("20",)
        assert reader.execute("SELECT body FROM notes").fetchall() == [("kept",)]
        cannot_write(reader)
    assert local._server(iid).control_data()["max_connections setting"] == "20"

    # Killed again while suspended, then deleted: the final dump starts it (read-only) and is taken.
    kill(local, iid)
    backup = await local.final_backup(iid, dev, fence=4)
    assert backup is not None
    assert (await local.deprovision(iid, dev, fence=5)).removed


async def test_a_signal_set_aside_by_a_cut_short_start_is_put_back_or_dropped(
    local: LocalProvisioner,
) -> None:
    # A crash while the server ran privately leaves the standby signal set aside: the next start puts
    # it back (still suspended), and a resume of the stopped server drops it (writable).
    iid = uuid.uuid4()
    info = await provision(local, iid, fence=1)
    with connect(info) as owner:
        owner.execute("CREATE TABLE notes (body text)")
    assert await local.suspend(iid, DEV, fence=2) is True
    datadir = local.datadir(iid)
    kill(local, iid)
    os.replace(datadir / "standby.signal", datadir / "standby.signal.set-aside")
    assert await local.suspend(iid, DEV, fence=3) is True
    with connect(info) as reader:
        cannot_write(reader)
    assert not (datadir / "standby.signal.set-aside").exists()

    kill(local, iid)
    os.replace(datadir / "standby.signal", datadir / "standby.signal.set-aside")
    assert await local.resume(iid, DEV, fence=4) is True
    with connect(info) as writer:
        writer.execute("INSERT INTO notes VALUES ('after resume')")
    assert sorted(p.name for p in datadir.glob("standby.signal*")) == []


async def test_observe_sees_a_killed_server_and_a_removed_directory(local: LocalProvisioner) -> None:
    iid, other = uuid.uuid4(), uuid.uuid4()
    info = await provision(local, iid, fence=1)
    other_port = local.ports.allocate(other)
    assert other_port != info.port

    kill(local, iid)
    observed = await local.observe(iid)
    assert observed.exists and not observed.running and not observed.healthy
    assert observed.detail == "server not running"

    # Re-running the steps repairs: same port, same role, same password.
    assert await provision(local, iid, fence=2) == info
    assert (await local.observe(iid)).healthy

    shutil.rmtree(local.datadir(iid))
    observed = await local.observe(iid)
    assert not observed.exists and observed.detail == "data directory missing"
    assert observed.data_lost
    with pytest.raises(TemporaryError):
        await local.initialize_database(iid, DEV, fence=3)

    # Lost data is never re-created empty by re-running the steps: only an explicit restore does.
    with pytest.raises(DataLost):
        await provision(local, iid, fence=3)
    await local.restore(iid, DEV, fence=3, point=RestorePoint(empty=True))
    repaired = await provision(local, iid, fence=3)
    assert repaired.port == info.port and repaired.user == info.user
    with connect(repaired) as conn:
        conn.execute("CREATE TABLE t (x int)")
    table = json.loads((local.root / "ports.json").read_text())
    assert table == {str(iid): info.port, str(other): other_port}
    assert local.ports.release(other) is True


async def test_a_lost_data_directory_restores_after_its_plan_was_lowered(local: LocalProvisioner) -> None:
    # Found by the chaos soak: backed up on `small` (50 connections), then resized to `dev` (20) and
    # lost. The replay runs with the instance's plan, below what its WAL's primary had: a hot standby
    # would refuse to start ("insufficient parameter settings"), so the replay runs without one.
    iid = uuid.uuid4()
    small, dev = InstanceSpec("small", 1), InstanceSpec("dev", 2)
    info = await provision(local, iid, fence=1, spec=small)
    await local.configure_archive(iid, small, fence=1)
    with connect(info) as owner:
        owner.execute("CREATE TABLE notes (body text)")
        owner.execute("INSERT INTO notes VALUES ('on small')")
    await local.take_backup(iid, small, fence=2)
    assert await local.apply_plan(iid, dev, fence=3) is True
    with connect(info) as owner:
        owner.execute("INSERT INTO notes VALUES ('on dev')")
    shutil.rmtree(local.datadir(iid))
    await local.restore(iid, dev, fence=4, point=RestorePoint())
    await local.configure_network(iid, dev, fence=4)
    back = await local.initialize_database(iid, dev, fence=4, password=info.password)
    with connect(back) as owner:
        assert owner.execute("SHOW max_connections").fetchone() == ("20",)
        assert owner.execute("SELECT count(*) FROM notes WHERE body = 'on small'").fetchone() == (1,)
