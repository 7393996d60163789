"""deploy/kubernetes/rbac.yaml is derived from the calls: exactly what the provisioner issues, no more."""

from __future__ import annotations

import uuid

import pytest

from controlplane.core.step_errors import PermanentError
from provisioners.base import InstanceSpec
from tests.kubernetes_support import provisioner_on_fake, role_from, run_lifecycle


async def test_the_role_grants_exactly_what_the_whole_lifecycle_issues() -> None:
    role = role_from()
    # As deploy/kubernetes configures it: with backups and a PodMonitor per instance.
    settings = {"kubernetes_backup_object_store": "backups", "kubernetes_pod_monitor": True}
    with provisioner_on_fake(role, **settings) as (k8s, state):
        await run_lifecycle(k8s, state)
    # Nothing was refused (a missing verb fails the lifecycle with a 403 first) ...
    assert state.denied == []
    # ... and nothing granted goes unused.
    assert state.calls == role.grants(), (
        f"issued but not granted: {sorted(state.calls - role.grants())}; "
        f"granted but never issued: {sorted(role.grants() - state.calls)}"
    )


async def test_a_verb_missing_from_the_role_is_refused_with_403() -> None:
    role = role_from()
    role.rules = [rule for rule in role.rules if "networkpolicies" not in rule["resources"]]
    with provisioner_on_fake(role) as (k8s, state):
        iid = uuid.uuid4()
        await k8s.allocate_storage(iid, InstanceSpec(), 1)
        with pytest.raises(
            PermanentError, match=r"403 Forbidden: networkpolicies is forbidden: .* cannot patch"
        ):
            await k8s.configure_network(iid, InstanceSpec(), 1)
    assert state.denied and state.denied[0][0] == ("networking.k8s.io", "networkpolicies", "patch")
