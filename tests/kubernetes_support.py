"""Shared helpers of the kubernetes provisioner tests: a provisioner on the fake API server, the
Role of deploy/kubernetes/rbac.yaml, and the whole lifecycle of instances as one scripted run."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from controlplane.runtime.settings import Settings
from provisioners import build
from provisioners.base import BackupInfo, InstanceSpec, RestoreSource
from provisioners.kubernetes import KubernetesProvisioner
from tests.kubernetes_fake import FakeCluster, Role, fake_api
from tests.support import ROOT

RBAC = ROOT / "deploy" / "kubernetes" / "rbac.yaml"
NAMESPACE = "controlplane-instances"
OBJECT_STORE = "backups"


def role_from(path: Path = RBAC) -> Role:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "Role"]
    return Role.from_manifest(doc)


@contextmanager
def provisioner_on_fake(
    role: Role | None = None, **settings: Any
) -> Iterator[tuple[KubernetesProvisioner, FakeCluster]]:
    """A kubernetes provisioner, built from settings as the worker builds it, on a fake API server."""
    with fake_api(role) as (url, state):
        values: dict[str, Any] = {
            "provisioner": "kubernetes",
            "kubernetes_namespace": NAMESPACE,
            "kubernetes_host": url,
            **settings,
        }
        provisioner = build(Settings(**values))
        assert isinstance(provisioner, KubernetesProvisioner)
        provisioner.poll_s = 0.001
        provisioner.ready_wait_s = 2
        provisioner.backup_wait_s = 2
        yield provisioner, state


@dataclass
class Lifecycle:
    """What one scripted run saw, for the tests to check."""

    first: uuid.UUID
    org: uuid.UUID
    restored: uuid.UUID
    pitr: uuid.UUID
    backups: list[BackupInfo] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)


async def run_lifecycle(k8s: KubernetesProvisioner, state: FakeCluster) -> Lifecycle:
    """create, observe, resize (up and down), suspend, resume, fail over, switch over, back up (a failed try
    first), restore from a backup and from a point in time, delete with a final backup, sweep."""
    org = uuid.uuid4()
    run = Lifecycle(uuid.uuid4(), org, uuid.uuid4(), uuid.uuid4())
    iid, fence = run.first, 10
    dev = InstanceSpec("dev", 1, org_id=org)
    await k8s.allocate_storage(iid, dev, fence)
    await k8s.configure_network(iid, dev, fence)
    run.notes["info"] = await k8s.initialize_database(iid, dev, fence)
    run.notes["rerun"] = await k8s.initialize_database(iid, dev, fence)
    run.notes["ready"] = await k8s.observe(iid)

    small = InstanceSpec("small", 2, org_id=org)
    run.notes["resized"] = await k8s.apply_plan(iid, small, 11)
    run.notes["resized_again"] = await k8s.apply_plan(iid, small, 11)
    run.notes["downsized"] = await k8s.apply_plan(iid, InstanceSpec("dev", 3, org_id=org), 12)
    run.notes["back_up_sized"] = await k8s.apply_plan(iid, small, 12)

    run.notes["suspended"] = await k8s.suspend(iid, small, 13)
    run.notes["suspended_again"] = await k8s.suspend(iid, small, 13)
    run.notes["while_suspended"] = await k8s.observe(iid)
    run.notes["resumed"] = await k8s.resume(iid, small, 14)
    run.notes["resumed_again"] = await k8s.resume(iid, small, 14)
    run.notes["after_resume"] = await k8s.observe(iid)

    state.fail_primary(NAMESPACE, f"pg-{iid}")
    run.notes["failing_over"] = await k8s.observe(iid)
    await k8s.apply_plan(iid, small, 15)  # waits for the operator to settle again
    run.notes["failed_over"] = await k8s.observe(iid)
    run.notes["operator_events"] = await k8s.operator_events(iid)
    run.notes["switched"] = await k8s.switchover(iid, small, 15)  # the operator's promote
    run.notes["switched_to"] = await k8s.observe(iid)

    state.fail_backups = 1
    try:
        await k8s.take_backup(iid, small, 16)
    except Exception as exc:
        run.notes["backup_error"] = exc
    run.backups.append(await k8s.take_backup(iid, small, 17))

    source = RestoreSource(iid, backup=run.backups[0].name)
    restored = InstanceSpec("small", 1, org_id=org, restore_from=source)
    await k8s.allocate_storage(run.restored, restored, 20)
    await k8s.configure_network(run.restored, restored, 20)
    await k8s.initialize_database(run.restored, restored, 20)
    pitr = InstanceSpec(
        "dev", 1, org_id=org, restore_from=RestoreSource(iid, point_in_time="2026-01-01T00:00:00+00:00")
    )
    await k8s.allocate_storage(run.pitr, pitr, 21)

    run.notes["inventory"] = await k8s.inventory()
    run.notes["deleted"] = await k8s.deprovision(iid, small, 30)
    run.notes["deleted_again"] = await k8s.deprovision(iid, small, 31)
    # The orphan sweep: whatever the inventory shows for an instance the control plane does not know.
    for resource in await k8s.inventory():
        if resource.instance_id == run.pitr:
            run.notes["swept"] = await k8s.deprovision(run.pitr, InstanceSpec(), 40, skip_backup=False)
            break
    await k8s.deprovision(run.restored, restored, 41, skip_backup=True)
    return run
