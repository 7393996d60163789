"""Real processes killed at injected crash points (controlplane/runtime/crashpoints.py): a worker after the
last step's commit (F3), the API between recording a webhook and enqueuing its jobs (F19), the API
in the middle of an idempotent POST (F20)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controlplane.audit import verify as audit
from controlplane.core.kinds import PROVISION
from controlplane.db.connection import AsyncConn
from controlplane.handlers.operations import NOTHING_TO_DO
from controlplane.runtime.settings import Settings
from provisioners.local import LocalProvisioner
from tests.api_support import WEBHOOK_SECRET, make_ready, make_tenant, sign, stripe_event
from tests.factories import make_instance
from tests.operations_support import enqueue, instance, job, job_finished, registry_for, run_until, scalar
from tests.provisioning_support import QUICK_RETRIES, WORKER_SCRIPT, real_instances, worker_env
from tests.up_support import Served

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def fault_settings(pg_root: Path, fresh_database: str) -> Iterator[Settings]:
    with real_instances(pg_root, fresh_database, **QUICK_RETRIES, shutdown_grace_s=0.3) as settings:
        yield settings


async def test_f3_worker_dies_after_the_last_steps_commit_before_the_finish(
    conn: AsyncConn, fault_settings: Settings
) -> None:
    iid = (await make_instance(conn))["id"]
    provision_job = await enqueue(conn, PROVISION, iid)
    env = worker_env(fault_settings, "", "doomed-worker") | {
        "CONTROLPLANE_CRASH_POINTS": "worker.after_handler"
    }
    doomed = subprocess.run(
        [sys.executable, "-c", WORKER_SCRIPT],
        env=env,
        timeout=120,
        check=False,
        capture_output=True,
        text=True,
    )
    assert doomed.returncode == -9, doomed.stderr[-2000:]
    # The last step (the move to ready, with the credentials) committed; the job's finish did not.
    assert (await instance(conn, iid))["state"] == "ready"
    stuck = await job(conn, provision_job["id"])
    assert (stuck["state"], stuck["attempt"]) == ("running", 1)
    local = LocalProvisioner(fault_settings)
    server_pid = local._server(iid, 0).pid()
    assert server_pid is not None

    # The job is reclaimed, and its next attempt sees the step done: it does nothing.
    await run_until(fault_settings, registry_for(local), job_finished(provision_job["id"]))
    done = await job(conn, provision_job["id"])
    assert (done["state"], done["attempt"], done["verdict"]) == ("completed", 2, NOTHING_TO_DO)
    assert local._server(iid, 0).pid() == server_pid  # nothing provisioned again
    provisioned = await scalar(
        conn, "SELECT count(*) FROM instance_events WHERE instance_id = %s AND event = 'provisioned'", (iid,)
    )
    assert provisioned == 1
    assert local.ports.table() == {str(iid): (await instance(conn, iid))["connection"]["port"]}
    assert await audit.verify(conn) == []


def _served(fresh_database: str, data_dir: Path, crash_point: str | None) -> Served:
    env = {"CONTROLPLANE_STRIPE_WEBHOOK_SECRET": WEBHOOK_SECRET}
    if crash_point:
        env["CONTROLPLANE_CRASH_POINTS"] = crash_point
    server = Served(fresh_database, data_dir, extra_env=env)
    server.start()
    return server


async def test_f19_crash_between_recording_a_webhook_and_enqueuing_its_jobs(
    conn: AsyncConn, fresh_database: str, settings: Settings
) -> None:
    """The event's row and its jobs are one transaction: killed between the two, neither is there;
    Stripe's retry then records it and enqueues the jobs once."""
    tenant = await make_tenant(conn, "crash-webhook")
    ready = await make_instance(conn, org_id=tenant.org_id)
    await make_ready(conn, settings, ready["id"])
    payload = stripe_event("evt_crash", tenant.stripe_customer_id, "unpaid", 100)
    headers = {"Content-Type": "application/json"}

    doomed = _served(fresh_database, settings.data_dir, "webhook.after_record")
    with pytest.raises(httpx.HTTPError):
        httpx.post(
            f"{doomed.url}/v1/webhooks/stripe",
            content=payload,
            timeout=10,
            headers=headers | {"Stripe-Signature": sign(payload)},
        )
    assert doomed.killed()
    assert await scalar(conn, "SELECT count(*) FROM stripe_events") == 0
    assert await scalar(conn, "SELECT count(*) FROM jobs WHERE kind = 'suspend'") == 0
    assert (
        await scalar(conn, "SELECT billing_hold FROM organisations WHERE id = %s", (tenant.org_id,)) is False
    )

    server = _served(fresh_database, settings.data_dir, None)
    try:
        retried = httpx.post(
            f"{server.url}/v1/webhooks/stripe",
            content=payload,
            timeout=10,
            headers=headers | {"Stripe-Signature": sign(payload)},
        )
        assert retried.status_code == 200 and retried.json()["outcome"] == "hold", retried.text
        again = httpx.post(
            f"{server.url}/v1/webhooks/stripe",
            content=payload,
            timeout=10,
            headers=headers | {"Stripe-Signature": sign(payload)},
        )
        assert again.json()["outcome"] == "duplicate"
    finally:
        server.stop()
    assert await scalar(conn, "SELECT count(*) FROM jobs WHERE kind = 'suspend'") == 1
    assert await audit.verify(conn) == []


@pytest.mark.parametrize("crash_point", ["api.create.before_commit", "api.create.after_commit"])
async def test_f20_api_killed_mid_post_then_the_client_retries_with_its_key(
    conn: AsyncConn, fresh_database: str, settings: Settings, crash_point: str
) -> None:
    tenant = await make_tenant(conn, "crash-create")
    key = str(uuid.uuid4())
    headers = tenant.headers | {"Idempotency-Key": key}
    body = {"name": "survivor", "plan": "dev"}

    doomed = _served(fresh_database, settings.data_dir, crash_point)
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"{doomed.url}/v1/instances", json=body, headers=headers, timeout=10)
    assert doomed.killed()
    committed = crash_point.endswith("after_commit")
    assert await scalar(conn, "SELECT count(*) FROM instances") == (1 if committed else 0)

    server = _served(fresh_database, settings.data_dir, None)
    try:
        retried = httpx.post(f"{server.url}/v1/instances", json=body, headers=headers, timeout=10)
        again = httpx.post(f"{server.url}/v1/instances", json=body, headers=headers, timeout=10)
    finally:
        server.stop()
    assert retried.status_code == 202, retried.text
    assert retried.headers.get("Idempotent-Replayed") == ("true" if committed else None)
    assert again.status_code == 202 and again.json()["id"] == retried.json()["id"]
    iid = retried.json()["id"]
    assert await scalar(conn, "SELECT count(*) FROM instances") == 1
    assert await scalar(conn, "SELECT count(*) FROM instance_events WHERE instance_id = %s", (iid,)) == 1
    assert await scalar(conn, "SELECT count(*) FROM jobs WHERE instance_id = %s", (iid,)) == 1
    assert await scalar(conn, "SELECT count(*) FROM idempotency_keys") == 1
    assert await audit.verify(conn) == []
