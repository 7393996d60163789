from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.audit import verify as audit
from controlplane.core.faultspec import parse_faults
from controlplane.core.kinds import PROVISION
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from provisioners.faults import FaultyProvisioner
from provisioners.local import LocalProvisioner
from tests.factories import make_instance
from tests.operations_support import enqueue, instance, instance_in, job, registry_for, run_until
from tests.provisioning_support import (
    QUICK_RETRIES,
    WORKER_SCRIPT,
    connect,
    credentials,
    real_instances,
    worker_env,
)


@pytest.fixture
def fault_settings(pg_root: Path, fresh_database: str) -> Iterator[Settings]:
    with real_instances(pg_root, fresh_database, **QUICK_RETRIES, shutdown_grace_s=0.3) as settings:
        yield settings


async def assert_one_of_everything(
    conn: AsyncConn, settings: Settings, local: LocalProvisioner, iid: object
) -> None:
    row = await instance(conn, iid)  # type: ignore[arg-type]
    assert row["state"] == "ready"
    dirs = [p for p in local.root.iterdir() if p.is_dir()]
    assert dirs == [local.instance_dir(row["id"])]
    assert sorted(p.name for p in dirs[0].iterdir()) == ["pgdata", "pgdata.log", "state.json"]
    assert local.ports.table() == {str(row["id"]): row["connection"]["port"]}
    info = credentials(settings, row)
    assert local.roles(row["id"]) == [info.user]
    with connect(info) as customer:
        customer.execute("CREATE TABLE survived (x int)")
    assert [r.kind for r in await local.inventory()] == ["data_directory", "server", "port"]


@pytest.mark.parametrize(
    "fault",
    [
        "allocate_storage:kill:1:0.3",  # inside initdb
        "allocate_storage:kill:1:after",
        "configure_network:kill:1:after",
        "initialize_database:kill:1:0.1",  # while the server starts
        "initialize_database:kill:1:after",  # role created, credentials never recorded
    ],
)
async def test_a_worker_killed_inside_a_step_leaves_nothing_twice(
    conn: AsyncConn, fault_settings: Settings, fault: str
) -> None:
    iid = (await make_instance(conn))["id"]
    provision_job = await enqueue(conn, PROVISION, iid)
    doomed = subprocess.run(
        [sys.executable, "-c", WORKER_SCRIPT],
        env=worker_env(fault_settings, fault, "doomed-worker"),
        timeout=120,
        check=False,
        capture_output=True,
        text=True,
    )
    assert doomed.returncode == -9, doomed.stderr[-2000:]
    stuck = await job(conn, provision_job["id"])
    assert (stuck["state"], stuck["attempt"], stuck["claimed_by"]) == ("running", 1, "doomed-worker")
    assert (await instance(conn, iid))["state"] == "provisioning"

    local = LocalProvisioner(fault_settings)
    await run_until(fault_settings, registry_for(local), instance_in(iid, "ready"))
    done = await job(conn, provision_job["id"])
    assert (done["state"], done["attempt"]) == ("completed", 2)
    await assert_one_of_everything(conn, fault_settings, local, iid)
    assert await audit.verify(conn) == []


async def test_a_hung_step_is_cancelled_at_shutdown_and_finished_by_the_next_worker(
    conn: AsyncConn, fault_settings: Settings
) -> None:
    local = LocalProvisioner(fault_settings)
    faulty = FaultyProvisioner(local, parse_faults("configure_network:hang:1"))
    registry = registry_for(faulty)
    iid = (await make_instance(conn))["id"]
    provision_job = await enqueue(conn, PROVISION, iid)

    async def hanging(c: AsyncConn) -> bool:
        return (await instance(c, iid))["progress"] == "configure_network" and bool(faulty.fired)

    await run_until(fault_settings, registry, hanging)  # the worker stops: the hung step is cancelled
    handed_back = await job(conn, provision_job["id"])
    assert handed_back["state"] == "queued" and faulty.fired == [("configure_network", 1)]
    await run_until(fault_settings, registry, instance_in(iid, "ready"))
    assert (await job(conn, provision_job["id"]))["attempt"] == 2
    await assert_one_of_everything(conn, fault_settings, local, iid)
