"""Notifications to customers: one signed delivery per event and endpoint, an email, retries and
then the endpoint disabled, the delivery log, server-side request forgery refused, and a consumer
killed between its effects and its position that delivers nothing twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx
import pytest
import standardwebhooks

from controlplane.api.app import create_app
from controlplane.core import webhook_signatures as signatures
from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.handlers import operations
from controlplane.queue.consumers import ConsumerRunner
from controlplane.runtime.secretbox import load_box
from controlplane.runtime.settings import Settings
from controlplane.services import notifications as service
from controlplane.services import tenants
from controlplane.services.notices import NOTIFIER, consumer
from provisioners.noop import NoopProvisioner
from tests.factories import make_instance, walk
from tests.notify_support import smtp_server, webhook_receiver
from tests.operations_support import run_until
from tests.support import ROOT

pytest_plugins = ("tests.api_fixtures",)


@pytest.fixture
def notify_settings(settings: Settings) -> Settings:
    return settings.replace(notify_allow_http=True, notify_allow_private=True, provisioner="noop")


@pytest.fixture
def api_settings(notify_settings: Settings) -> Settings:
    """The API of tests.api_fixtures (the `client` fixture), with loopback endpoints allowed."""
    return notify_settings


@pytest.fixture
def http(client: httpx.AsyncClient) -> httpx.AsyncClient:
    return client


async def _key(conn: AsyncConn) -> tuple[uuid.UUID, dict[str, str]]:
    org, key = await tenants.create_org(conn, f"acme-{uuid.uuid4().hex[:6]}", None)
    return org["id"], {"Authorization": f"Bearer {key.plaintext}"}


async def _count(conn: AsyncConn, query: str, *args: Any) -> int:
    cursor = await conn.execute(query, args)
    row = await cursor.fetchone()
    assert row is not None
    return int(row["count"])


async def test_a_provisioned_instance_sends_one_signed_ready_delivery_and_an_email(
    conn: AsyncConn, http: httpx.AsyncClient, notify_settings: Settings
) -> None:
    _, headers = await _key(conn)
    with webhook_receiver() as (url, received), smtp_server() as (port, mailbox):
        settings = notify_settings.replace(smtp_host="127.0.0.1", smtp_port=port)
        answer = await http.post(
            "/v1/webhook-endpoints",
            json={"url": url, "event_types": ["instance.ready", "instance.failed"]},
            headers={**headers, "Idempotency-Key": "hook-1"},
        )
        assert answer.status_code == 201, answer.text
        endpoint = answer.json()
        secret = endpoint["secret"]
        assert secret.startswith("whsec_") and endpoint["enabled"] is True
        again = await http.post(
            "/v1/webhook-endpoints",
            json={"url": url, "event_types": ["instance.ready", "instance.failed"]},
            headers={**headers, "Idempotency-Key": "hook-1"},
        )
        assert again.json()["id"] == endpoint["id"] and again.json()["secret"] is None  # shown once
        listed = (await http.get("/v1/webhook-endpoints", headers=headers)).json()
        assert [e["id"] for e in listed["items"]] == [endpoint["id"]] and listed["items"][0]["secret"] is None
        email = await http.post(
            "/v1/notification-emails",
            json={"address": "ops@example.com", "event_types": ["*"]},
            headers=headers,
        )
        assert email.status_code == 201, email.text

        created = await http.post("/v1/instances", json={"name": "orders", "plan": "dev"}, headers=headers)
        assert created.status_code == 202, created.text
        pool = db.pool(settings.database.url_value or "", min_size=1, max_size=2, name="notifier")
        await pool.open(wait=True)
        runner = ConsumerRunner(pool, [consumer()])

        async def delivered(c: AsyncConn) -> bool:
            await runner.run_once()
            return len(received.requests) >= 1 and len(mailbox.messages) >= 1

        try:
            await run_until(settings, operations.registry(NoopProvisioner()), delivered, timeout_s=120)
            # Replaying the whole log delivers nothing twice.
            await conn.execute(
                "UPDATE event_consumers SET last_xid = '0', last_id = 0 WHERE name = %s", (NOTIFIER,)
            )
            assert (await runner.run_once())[NOTIFIER] > 0
        finally:
            await pool.close()
        ((sent_headers, raw),) = received.requests
        body = json.loads(raw)
        assert body["type"] == "instance.ready" and body["data"]["instance"]["name"] == "orders"
        assert sent_headers[signatures.EVENT_ID_HEADER] == body["id"]
        stamp = signatures.verify(secret, sent_headers[signatures.SIGNATURE_HEADER], raw, now=time.time())
        # A Standard Webhooks library verifies the same delivery, its event id signed with it.
        assert standardwebhooks.Webhook(secret).verify(raw, dict(sent_headers))["id"] == body["id"]
        assert sent_headers[signatures.STANDARD_ID_HEADER] == body["id"]
        assert abs(stamp - time.time()) < 60
        with pytest.raises(signatures.SignatureError):
            signatures.verify("whsec_other", sent_headers[signatures.SIGNATURE_HEADER], raw, now=time.time())
        with pytest.raises(signatures.SignatureError):
            signatures.verify(secret, sent_headers[signatures.SIGNATURE_HEADER], raw, now=time.time() + 600)
        (message,) = mailbox.messages
        assert message["To"] == "ops@example.com" and message["Subject"] == "instance.ready: orders is ready"
        assert message["X-Controlplane-Event-Id"] == body["id"]
        log = (await http.get(f"/v1/webhook-endpoints/{endpoint['id']}/deliveries", headers=headers)).json()
        assert [(d["event_id"], d["state"], d["last_status"]) for d in log["items"]] == [
            (body["id"], "delivered", 200)
        ]
        print("\n--- delivered notification ---")
        for name, value in sent_headers.items():
            print(f"{name}: {value}")
        print()
        print(json.dumps(body, indent=2))


async def test_a_failing_endpoint_is_retried_then_disabled(
    conn: AsyncConn, http: httpx.AsyncClient, notify_settings: Settings
) -> None:
    org, headers = await _key(conn)
    settings = notify_settings.replace(notify_retry_window_s=1.0)
    with webhook_receiver(status=503) as (url, received):
        answer = await http.post(
            "/v1/webhook-endpoints", json={"url": url, "event_types": ["*"]}, headers=headers
        )
        endpoint = answer.json()
        instance = await make_instance(conn, org)
        await walk(conn, instance["id"], "start_provisioning", "provisioned")
        pool = db.pool(settings.database.url_value or "", min_size=1, max_size=2, name="notifier")
        await pool.open(wait=True)
        runner = ConsumerRunner(pool, [consumer()])

        async def disabled(c: AsyncConn) -> bool:
            await runner.run_once()
            return (
                await _count(c, "SELECT count(*) FROM notification_targets WHERE disabled_at IS NOT NULL")
                == 1
            )

        try:
            await run_until(settings, operations.registry(NoopProvisioner()), disabled, timeout_s=120)
        finally:
            await pool.close()
        assert len(received.requests) >= 2
        assert (
            len({h[signatures.EVENT_ID_HEADER] for h, _ in received.requests}) == 1
        )  # the same event, again
    shown = (await http.get(f"/v1/webhook-endpoints/{endpoint['id']}", headers=headers)).json()
    assert shown["enabled"] is False and "answered 503" in shown["disabled_reason"]
    log = (await http.get(f"/v1/webhook-endpoints/{endpoint['id']}/deliveries", headers=headers)).json()
    ((delivery),) = log["items"]
    assert delivery["state"] == "failed" and delivery["attempts"] >= 2 and delivery["last_status"] == 503


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/hook",
        "https://127.0.0.1/hook",
        "https://10.1.2.3/x",
        "https://169.254.169.254/latest",
        "https://[::1]/hook",
        "https://[::ffff:127.0.0.1]/x",
        "ftp://example.com/x",
        "https://user:pw@example.com/x",
    ],
)
async def test_endpoint_urls_customers_may_not_use_are_refused(
    conn: AsyncConn, settings: Settings, url: str
) -> None:
    application = create_app(settings)
    async with application.router.lifespan_context(application):
        transport = httpx.ASGITransport(app=application, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            _, headers = await _key(conn)
            answer = await client.post(
                "/v1/webhook-endpoints", json={"url": url, "event_types": ["*"]}, headers=headers
            )
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert await _count(conn, "SELECT count(*) FROM notification_targets") == 0


async def test_an_endpoint_that_resolves_privately_at_delivery_is_not_called(
    conn: AsyncConn, notify_settings: Settings
) -> None:
    org, _ = await _key(conn)
    with webhook_receiver() as (url, received):
        await service.register(
            conn,
            service.NewTarget(org, "webhook", url, ["*"]),
            load_box(notify_settings),
            notify_settings.notifications,
        )
        instance = await make_instance(conn, org)
        await walk(conn, instance["id"], "start_provisioning", "provisioned")
        strict = notify_settings.replace(notify_allow_private=False, notify_retry_window_s=0)
        pool = db.pool(strict.database.url_value or "", min_size=1, max_size=2, name="notifier")
        await pool.open(wait=True)
        runner = ConsumerRunner(pool, [consumer()])

        async def given_up(c: AsyncConn) -> bool:
            await runner.run_once()
            return await _count(c, "SELECT count(*) FROM notification_deliveries WHERE state = 'failed'") == 1

        try:
            await run_until(strict, operations.registry(NoopProvisioner()), given_up, timeout_s=120)
        finally:
            await pool.close()
        assert received.requests == []
    cursor = await conn.execute("SELECT last_error FROM notification_deliveries")
    row = await cursor.fetchone()
    assert row is not None and "must resolve to public addresses only" in row["last_error"]


async def test_a_consumer_killed_between_its_effects_and_its_position_delivers_nothing_twice(
    conn: AsyncConn, notify_settings: Settings, runtime_url: str
) -> None:
    org, _ = await _key(conn)
    box = load_box(notify_settings)
    await service.register(
        conn,
        service.NewTarget(org, "webhook", "http://127.0.0.1:9/x", ["*"]),
        box,
        notify_settings.notifications,
    )
    await service.register(
        conn,
        service.NewTarget(org, "email", "ops@example.com", ["instance.ready"]),
        box,
        notify_settings.notifications,
    )
    for _ in range(2):
        instance = await make_instance(conn, org)
        await walk(conn, instance["id"], "start_provisioning", "provisioned")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.consumer_process", "--database-url", runtime_url],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()  # blocks until the effects committed (or it died)
        assert line.startswith(f"EFFECTS {NOTIFIER}"), line
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=10) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
    deliveries = "SELECT count(*) FROM notification_deliveries"
    delivery_jobs = "SELECT count(*) FROM jobs WHERE kind = 'deliver_notification'"
    assert await _count(conn, deliveries) == 4 and await _count(conn, delivery_jobs) == 4
    assert await _count(conn, "SELECT count(*) FROM event_consumers WHERE last_id = 0") == 1  # never stored
    pool = db.pool(runtime_url, min_size=1, max_size=2, name="notifier")
    await pool.open(wait=True)
    try:
        applied = (await ConsumerRunner(pool, [consumer()]).run_once())[NOTIFIER]
    finally:
        await pool.close()
    assert applied == 6  # the batch again: at least once
    assert await _count(conn, deliveries) == 4 and await _count(conn, delivery_jobs) == 4  # no double effect
    assert await _count(conn, "SELECT count(*) FROM event_consumers WHERE last_id > 0") == 1


async def test_another_organisation_sees_and_removes_none_of_the_endpoints(
    conn: AsyncConn, http: httpx.AsyncClient
) -> None:
    _, mine = await _key(conn)
    _, thief = await _key(conn)
    endpoint = (
        await http.post(
            "/v1/webhook-endpoints", json={"url": "http://127.0.0.1:9/h", "event_types": ["*"]}, headers=mine
        )
    ).json()
    email = (
        await http.post(
            "/v1/notification-emails", json={"address": "a@example.com", "event_types": ["*"]}, headers=mine
        )
    ).json()
    path = f"/v1/webhook-endpoints/{endpoint['id']}"
    assert (await http.get(path, headers=thief)).status_code == 404
    assert (await http.get(f"{path}/deliveries", headers=thief)).status_code == 404
    assert (await http.delete(path, headers=thief)).status_code == 404
    assert (await http.delete(f"/v1/notification-emails/{email['id']}", headers=thief)).status_code == 404
    assert (await http.get("/v1/webhook-endpoints", headers=thief)).json()["items"] == []
    assert (await http.get("/v1/notification-emails", headers=thief)).json()["items"] == []
    assert (await http.get(path, headers=mine)).json()["enabled"] is True
    assert (await http.delete(path, headers=mine)).status_code == 204
    assert (await http.get(path, headers=mine)).status_code == 404
