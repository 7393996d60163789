from __future__ import annotations

import base64
import re
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import kubernetes
import kubernetes_validate
import pytest

from controlplane import plans
from controlplane.errors import PermanentError, StaleFence, TemporaryError
from controlplane.settings import Settings
from provisioners import build
from provisioners.base import InstanceSpec
from provisioners.kubernetes import (
    FIELD_MANAGER,
    INSTANCE_LABEL,
    MANAGED_BY,
    KubernetesApi,
    KubernetesProvisioner,
    all_manifests,
    resource_name,
)
from tests.kubernetes_fake import FakeCluster, fake_api

NAMESPACE = "instances"
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@pytest.mark.parametrize("plan", plans.plan_names())
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(plan: str, version: str) -> None:
    iid = uuid.uuid4()
    manifests = all_manifests(iid, NAMESPACE, InstanceSpec(plan, 3, storage_gb=5), fence=7)
    assert {m["kind"] for m in manifests} == {
        "Secret",
        "ConfigMap",
        "Service",
        "StatefulSet",
        "PersistentVolumeClaim",
        "Job",
    }
    for manifest in manifests:
        kubernetes_validate.validate(manifest, version, strict=True)
        meta = manifest["metadata"]
        assert DNS_LABEL.match(meta["name"]) and len(meta["name"]) <= 52
        assert meta["labels"][MANAGED_BY] == FIELD_MANAGER
        assert all(len(value) <= 63 for value in meta["labels"].values())
        if manifest["kind"] != "PersistentVolumeClaim":  # the final backup outlives the instance
            assert meta["labels"][INSTANCE_LABEL] == str(iid)
    statefulset = next(m for m in manifests if m["kind"] == "StatefulSet")
    claim = statefulset["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    env = {e["name"]: e for e in statefulset["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PG_MAX_CONNECTIONS"]["value"] == str(plans.get_plan(plan)["max_connections"])
    assert "value" not in env["OWNER_PASSWORD"]  # passwords come from the Secret only


@pytest.fixture
def cluster() -> Iterator[tuple[KubernetesProvisioner, FakeCluster]]:
    with fake_api() as (url, state):
        settings = Settings(provisioner="kubernetes", kubernetes_namespace=NAMESPACE, kubernetes_host=url)
        provisioner = build(settings)
        assert isinstance(provisioner, KubernetesProvisioner)
        provisioner.poll_s = 0.01
        provisioner.ready_wait_s = 0.2
        provisioner.backup_wait_s = 0.2
        yield provisioner, state


def env_of(state: FakeCluster) -> dict[str, Any]:
    (statefulset,) = state.of_kind("statefulsets")
    containers = statefulset["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in containers[0]["env"]}


async def test_steps_apply_declaratively_and_adopt_on_rerun(
    cluster: tuple[KubernetesProvisioner, FakeCluster],
) -> None:
    k8s, state = cluster
    iid, spec = uuid.uuid4(), InstanceSpec("dev", 1)

    await k8s.allocate_storage(iid, spec, 10)
    (statefulset,) = state.of_kind("statefulsets")
    assert statefulset["spec"]["replicas"] == 0 and statefulset["spec"]["volumeClaimTemplates"]
    await k8s.configure_network(iid, spec, 10)
    info = await k8s.initialize_database(iid, spec, 10)
    assert info.host == f"{resource_name(iid)}.{NAMESPACE}.svc.cluster.local" and info.port == 5432
    (secret,) = state.of_kind("secrets")
    assert base64.b64decode(secret["data"]["password"]).decode() == info.password

    # Re-running every step adopts what exists: same credentials, nothing created twice.
    await k8s.allocate_storage(iid, spec, 10)
    await k8s.configure_network(iid, spec, 10)
    assert await k8s.initialize_database(iid, spec, 10) == info
    assert sorted(p for p, _, _ in state.objects) == ["configmaps", "secrets", "services", "statefulsets"]
    patches = [r for r in state.requests if r.method == "PATCH"]
    assert patches and all(r.content_type == "application/apply-patch+yaml" for r in patches)
    assert all(r.query["fieldManager"] == [FIELD_MANAGER] and r.query["force"] == ["true"] for r in patches)

    observed = await k8s.observe(iid)
    assert observed.healthy and observed.read_only is False and observed.plan_applied == "dev"

    assert await k8s.suspend(iid, spec, 11) is True
    assert await k8s.suspend(iid, spec, 11) is False
    assert env_of(state)["CONTROLPLANE_READ_ONLY"] == "true"
    assert (await k8s.observe(iid)).read_only is True
    assert await k8s.resume(iid, spec, 12) is True
    assert env_of(state)["CONTROLPLANE_READ_ONLY"] == "false"

    small = InstanceSpec("small", 2)
    assert await k8s.apply_plan(iid, small, 13) is True
    assert await k8s.apply_plan(iid, small, 13) is False
    assert env_of(state)["PG_MAX_CONNECTIONS"] == "50" and env_of(state)["CONTROLPLANE_READ_ONLY"] == "false"
    observed = await k8s.observe(iid)
    assert (observed.plan_applied, observed.generation) == ("small", 2)

    with pytest.raises(StaleFence):
        await k8s.apply_plan(iid, spec, 12)

    inventory = await k8s.inventory()
    assert {(r.kind, r.instance_id) for r in inventory} == {
        ("StatefulSet", iid),
        ("Service", iid),
        ("ConfigMap", iid),
        ("Secret", iid),
    }

    result = await k8s.deprovision(iid, small, 14)
    assert result.removed and result.backup == f"pvc/{resource_name(iid)}-final-backup/{iid}.dump"
    # Only the final backup's claim is left; deleting again treats 404 as done.
    assert [p for p, _, _ in state.objects] == ["persistentvolumeclaims"]
    assert (await k8s.observe(iid)).exists is False
    again = await k8s.deprovision(iid, small, 15)
    assert again.removed is False and again.backup is None


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (409, TemporaryError),
        (429, TemporaryError),
        (500, TemporaryError),
        (503, TemporaryError),
        (400, PermanentError),
        (403, PermanentError),
        (422, PermanentError),
    ],
)
async def test_api_errors_are_translated(
    cluster: tuple[KubernetesProvisioner, FakeCluster], status: int, error: type[Exception]
) -> None:
    k8s, state = cluster
    state.fail_next.append(("PATCH", status))
    with pytest.raises(error, match=str(status)):
        await k8s.allocate_storage(uuid.uuid4(), InstanceSpec(), 1)


async def test_a_racing_writer_gets_a_conflict_and_a_slow_rollout_is_temporary(
    cluster: tuple[KubernetesProvisioner, FakeCluster],
) -> None:
    k8s, state = cluster
    iid = uuid.uuid4()
    await k8s.allocate_storage(iid, InstanceSpec(), 5)
    # Someone applies between our read and our write: the resourceVersion precondition refuses.
    original_get = k8s.api.get

    def get_then_race(*args: Any) -> Any:
        seen = original_get(*args)
        if seen is not None and args[0].plural == "statefulsets":
            key = ("statefulsets", NAMESPACE, resource_name(iid))
            state.objects[key]["metadata"]["resourceVersion"] = "999999"
        return seen

    k8s.api.get = get_then_race  # type: ignore[method-assign,assignment]
    with pytest.raises(TemporaryError, match="409"):
        await k8s.configure_network(iid, InstanceSpec(), 6)
    k8s.api.get = original_get  # type: ignore[method-assign]

    state.controller_ready = False
    with pytest.raises(TemporaryError, match="not ready"):
        await k8s.initialize_database(iid, InstanceSpec(), 6)
    assert (await k8s.observe(iid)).healthy is False


def direct(url: str, timeout_s: float) -> KubernetesProvisioner:
    configuration = kubernetes.client.Configuration()
    configuration.host = url
    configuration.retries = 0
    api = KubernetesApi(
        kubernetes.client.ApiClient(configuration), timeout_s=timeout_s, connect_timeout_s=0.3
    )
    return KubernetesProvisioner(api, NAMESPACE)


async def test_an_unreachable_or_silent_api_is_temporary() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # accepts connections in the kernel, never answers
        port = silent.getsockname()[1]
        with pytest.raises(TemporaryError, match="unreachable"):
            await direct(f"http://127.0.0.1:{port}", timeout_s=0.3).observe(uuid.uuid4())
    with pytest.raises(TemporaryError, match="unreachable"):
        await direct(f"http://127.0.0.1:{port}", timeout_s=0.3).inventory()
