"""The orphan sweep over the local provisioner's inventory: listed in dry-run mode, else removed with a
final backup, counted and logged."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from controlplane.core.kinds import DEPROVISION
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from provisioners.base import InstanceSpec, Resource
from provisioners.local import LocalProvisioner
from reconciler.leader import LeaderElection
from tests.factories import make_instance, walk
from tests.operations_support import enqueue
from tests.provisioning_support import real_instances
from tests.reconciler_support import ROOT, duties, next_fence, reconciling, to_ready


@pytest.fixture
def local_settings(pg_root: Path, fresh_database: str) -> Iterator[Settings]:
    with real_instances(pg_root, fresh_database) as settings:
        yield settings


def removed_total() -> float:
    return REGISTRY.get_sample_value("controlplane_orphans_removed_total") or 0.0


def owners(resources: list[Resource]) -> set[uuid.UUID | None]:
    return {r.instance_id for r in resources}


def reconcile_once_dry_run(settings: Settings) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "controlplane.cli",
            "reconcile",
            "--once",
            "--dry-run-orphans",
            "--database-url",
            str(settings.database.url_value),
            "--data-dir",
            str(settings.data_dir),
            "--log-format",
            "json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_orphans_are_listed_in_dry_run_and_removed_with_a_final_backup_otherwise(
    conn: AsyncConn, local_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    local = LocalProvisioner(local_settings)
    spec = InstanceSpec()
    # A real server whose instance id has no row at all.
    unknown = uuid.uuid4()
    fence = await next_fence(conn)
    await local.allocate_storage(unknown, spec, fence)
    await local.configure_network(unknown, spec, fence)
    await local.initialize_database(unknown, spec, fence)
    # A failed instance that still holds a port, with no job cleaning up: an orphan too.
    failed = (await make_instance(conn))["id"]
    await walk(conn, failed, "fail")
    local.ports.allocate(failed)
    # A failed instance whose cleanup job is still to run, and a ready one: not orphans.
    cleaning = (await make_instance(conn))["id"]
    await walk(conn, cleaning, "fail")
    await enqueue(conn, DEPROVISION, cleaning, cleanup=True, skip_backup=True)
    local.ports.allocate(cleaning)
    alive = (await make_instance(conn))["id"]
    await to_ready(conn, alive)
    local.ports.allocate(alive)
    everything = await local.inventory()
    assert owners(everything) == {unknown, failed, cleaning, alive}

    # The CLI's dry run lists them and leaves everything in place, even while another
    # reconciler leads (listing needs no lock; a pass would).
    assert local_settings.database.url_value is not None
    leader = LeaderElection(local_settings.database.url_value)
    assert await leader.ensure()
    try:
        listed = await asyncio.to_thread(reconcile_once_dry_run, local_settings)
    finally:
        await leader.release()
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "listing orphans only, no pass run" in listed.stderr
    lines = sorted(line for line in listed.stdout.splitlines() if line.startswith("orphan: "))
    assert len(lines) == 2 and {line.split()[1].rstrip(":") for line in lines} == {str(unknown), str(failed)}
    assert any(f"orphan: {unknown}: unknown instance: data_directory/" in line for line in lines)

    caplog.set_level(logging.WARNING, logger="reconciler.maintenance")
    before = removed_total()
    async with reconciling(local_settings, local, dry_run_orphans=True) as rec:
        summary = await duties(rec).run_once()
    assert sorted(o.split(":")[0] for o in summary.orphans) == sorted([str(unknown), str(failed)])
    assert summary.orphans_removed == 0 and removed_total() == before
    assert await local.inventory() == everything and (await local.observe(unknown)).healthy
    assert (
        len([r for r in caplog.records if r.getMessage().startswith("orphan (dry run, left in place)")]) == 2
    )

    caplog.clear()
    async with reconciling(local_settings, local) as rec:
        summary = await duties(rec).run_once()
        assert summary.orphans_removed == 2 and removed_total() == before + 2
        assert (await duties(rec).run_once()).orphans == []  # gone: nothing found the next time
    assert owners(await local.inventory()) == {cleaning, alive}
    assert not local.instance_dir(unknown).exists() and not (await local.observe(unknown)).exists
    # The final backup is kept in the unknown instance's stanza (the plan's retention).
    (backup,) = [b for b in await local.list_backups(unknown) if b.kind == "final"]
    assert backup.size_bytes
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("orphan removed: ")]
    assert len(logged) == 2
    assert any(str(unknown) in m and f"final backup: {backup.location}" in m for m in logged)
