"""Webhook receivers that misbehave, on loopback: one that drips its answer, one that answers far
too much, one whose name resolves elsewhere the second time, and many of one organisation that hold
their deliveries while another organisation's database is created."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from controlplane.core.kinds import PROVISION
from controlplane.db import connection as db
from controlplane.db.connection import AsyncConn
from controlplane.handlers import delivery, operations
from controlplane.queue.consumers import ConsumerRunner
from controlplane.queue.registry import JobContext
from controlplane.runtime.secretbox import load_box
from controlplane.runtime.settings import Settings
from controlplane.services import notices, tenants
from controlplane.services import notifications as service
from provisioners.noop import NoopProvisioner
from tests.factories import make_instance, walk
from tests.notify_support import loopback_server, read_request, webhook_receiver
from tests.operations_support import enqueue, run_until

# Only for a test that fails: how long the old code is given before it counts as stuck.
STUCK_S = 60.0


@pytest.fixture
def notify_settings(settings: Settings) -> Settings:
    return settings.replace(notify_allow_http=True, notify_allow_private=True, provisioner="noop")


@dataclass
class Holding:
    """A receiver that begins each answer (its status line) and then drips a header, a byte at a
    time, until released: it holds every delivery sent to it."""

    url: str
    began: list[str] = field(default_factory=list)
    holding: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def until(self, holding: int) -> None:
        while self.holding < holding:
            self.changed.clear()
            await self.changed.wait()


@asynccontextmanager
async def holding_receiver(drip_s: float = 0.05) -> AsyncIterator[Holding]:
    box: list[Holding] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        receiver = box[0]
        target, _, _ = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Drip: ")
        await writer.drain()
        receiver.began.append(target)
        receiver.holding += 1
        receiver.changed.set()
        try:
            while not receiver.release.is_set():
                writer.write(b"z")
                await writer.drain()
                try:
                    async with asyncio.timeout(drip_s):
                        await receiver.release.wait()
                except TimeoutError:
                    pass
            writer.write(b"\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
        finally:
            receiver.holding -= 1
            receiver.changed.set()

    async with loopback_server(answer) as base:
        box.append(Holding(base))
        yield box[0]


async def _org_with_endpoints(conn: AsyncConn, settings: Settings, *urls: str) -> uuid.UUID:
    org, _ = await tenants.create_org(conn, f"org-{uuid.uuid4().hex[:6]}", None)
    for url in urls:
        target = service.NewTarget(org["id"], "webhook", url, ["*"])
        await service.register(conn, target, load_box(settings), settings.notifications)
    org_id: uuid.UUID = org["id"]
    return org_id


async def _notify_ready(conn: AsyncConn, settings: Settings, org_id: uuid.UUID) -> None:
    """An instance of the organisation becomes ready, and the notifier queues its deliveries."""
    instance = await make_instance(conn, org_id)
    await walk(conn, instance["id"], "start_provisioning", "provisioned")
    pool = db.pool(settings.database.url_value or "", min_size=1, max_size=2, name="notifier")
    await pool.open(wait=True)
    try:
        await ConsumerRunner(pool, [notices.consumer()]).run_once()
    finally:
        await pool.close()


async def _rows(conn: AsyncConn, query: str, *args: Any) -> list[dict[str, Any]]:
    cursor = await conn.execute(query, args)
    return [dict(row) for row in await cursor.fetchall()]


async def test_one_organisations_held_deliveries_do_not_delay_anothers_create(
    conn: AsyncConn, notify_settings: Settings
) -> None:
    """Eight endpoints of organisation A hold their deliveries (an attempt may take long: the
    timeout is far away); organisation B's database, created while they hold, becomes ready before
    any of A's deliveries has ended, and no more of A's are sent at once than the deliveries' slots."""
    settings = notify_settings.replace(worker_concurrency=2, notify_timeout_s=3600)
    async with holding_receiver() as receiver:
        org_a = await _org_with_endpoints(conn, settings, *(f"{receiver.url}/a/{n}" for n in range(8)))
        await _notify_ready(conn, settings, org_a)
        org_b, _ = await tenants.create_org(conn, f"b-{uuid.uuid4().hex[:6]}", None)
        b_instance: list[uuid.UUID] = []
        seen: dict[str, Any] = {}

        async def b_ready(c: AsyncConn) -> bool:
            if not b_instance:
                # As many of A's deliveries as the worker has shared slots hold: then B creates.
                async with asyncio.timeout(STUCK_S):
                    await receiver.until(settings.worker.concurrency)
                b_instance.append((await make_instance(conn, org_b["id"]))["id"])
                await enqueue(conn, PROVISION, b_instance[0])
            cursor = await c.execute("SELECT state FROM instances WHERE id = %s", (b_instance[0],))
            row = await cursor.fetchone()
            if row is None or row["state"] != "ready":
                return False
            seen["holding"], seen["sent"] = receiver.holding, len(receiver.began)
            seen["ended"] = await _rows(
                c, "SELECT state FROM notification_deliveries WHERE org_id = %s AND attempts > 0", org_a
            )
            receiver.release.set()  # the held deliveries end now, delivered
            return True

        try:
            await run_until(settings, operations.registry(NoopProvisioner()), b_ready, timeout_s=STUCK_S)
        finally:
            receiver.release.set()
    assert seen["ended"] == []  # B's database was ready while all of A's deliveries were unanswered
    slots = settings.notifications.concurrency
    assert settings.worker.concurrency <= seen["holding"] <= seen["sent"] <= slots


async def test_a_dripping_answer_ends_the_attempt_at_its_timeout(notify_settings: Settings) -> None:
    """A receiver that keeps sending one byte of a header, each well within the time one read may
    take: the attempt ends, failed, at `notify_timeout_s` in all."""
    policy = notify_settings.replace(notify_timeout_s=1.0).notifications
    async with holding_receiver(drip_s=0.01) as receiver:
        async with asyncio.timeout(STUCK_S):
            attempt = await delivery.post_webhook(f"{receiver.url}/hook", "whsec_x", b"{}", {}, policy)
        assert receiver.began == ["/hook"]
    assert not attempt.ok and attempt.status is None


async def test_only_the_status_of_an_answer_is_read(notify_settings: Settings) -> None:
    """A receiver answering 200 with a 256 MiB body: the delivery is recorded from the status and
    the connection closed; the receiver manages to send no more than the sockets' buffers hold."""
    size, chunk = 256 * 2**20, b"\0" * 2**20
    sent: list[int] = [0]
    done = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode())
        try:
            while sent[0] < size:
                writer.write(chunk)
                await writer.drain()
                sent[0] += len(chunk)
        finally:
            done.set()

    async with loopback_server(answer) as base:
        attempt = await delivery.post_webhook(
            f"{base}/hook", "whsec_x", b"{}", {}, notify_settings.notifications
        )
        async with asyncio.timeout(STUCK_S):
            await done.wait()
    assert attempt.ok and attempt.status == 200
    assert sent[0] < size // 4, f"the receiver sent {sent[0]} bytes"


async def test_a_delivery_connects_to_the_address_it_checked(
    notify_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name that resolves to an allowed address at the check and elsewhere afterwards (DNS
    rebinding): the delivery goes to the address checked, under the name (its Host header); the
    name is looked up once."""
    real = socket.getaddrinfo
    looked_up: list[str] = []

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "hooks.rebind.test":
            return real(host, port, *args, **kwargs)
        looked_up.append(host)
        if len(looked_up) > 1:  # the second answer: anywhere but the address checked
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    # Loopback stands for a public address here.
    monkeypatch.setattr(notices, "address_allowed", lambda address: address == "127.0.0.1")
    policy = notify_settings.replace(notify_allow_private=False).notifications
    with webhook_receiver() as (url, received):
        port = url.split(":")[2].split("/")[0]
        attempt = await delivery.post_webhook(
            f"http://hooks.rebind.test:{port}/hook", "whsec_x", b"{}", {}, policy
        )
    assert attempt.ok, attempt.error
    ((headers, _),) = received.requests
    assert headers["Host"] == f"hooks.rebind.test:{port}"
    assert looked_up == ["hooks.rebind.test"]


async def test_one_endpoint_gets_one_delivery_at_a_time(conn: AsyncConn, notify_settings: Settings) -> None:
    """While an endpoint holds a delivery, the next one for it is queued again, unsent, and its
    job ends at once; the first is delivered once the endpoint answers."""
    settings = notify_settings.replace(notify_timeout_s=3600)
    async with holding_receiver() as receiver:
        org = await _org_with_endpoints(conn, settings, f"{receiver.url}/only")
        await _notify_ready(conn, settings, org)
        await _notify_ready(conn, settings, org)
        first, second = await _rows(
            conn, "SELECT id FROM notification_deliveries WHERE org_id = %s ORDER BY created_at, id", org
        )
        pool = db.pool(settings.database.url_value or "", min_size=1, max_size=4, name="deliver")
        await pool.open(wait=True)
        try:

            def context(delivery_id: uuid.UUID) -> JobContext:
                job = {"id": uuid.uuid4(), "payload": {"delivery_id": str(delivery_id)}}
                return JobContext(job=job, worker_id="test", pool=pool, settings=settings)

            sending = asyncio.create_task(delivery.deliver(context(first["id"])))
            async with asyncio.timeout(STUCK_S):
                await receiver.until(1)
                verdict = await delivery.deliver(context(second["id"]))
            assert verdict["result"] == "endpoint busy" and receiver.began == ["/only"]
            receiver.release.set()
            async with asyncio.timeout(STUCK_S):
                assert (await sending)["result"] == "delivered"
        finally:
            receiver.release.set()
            await pool.close()
    rows = await _rows(
        conn,
        "SELECT d.state, d.attempts, (SELECT count(*) FROM jobs j WHERE j.kind = 'deliver_notification'"
        " AND j.state = 'queued' AND j.run_at > now() AND j.payload->>'delivery_id' = d.id::text) AS later"
        " FROM notification_deliveries d WHERE d.org_id = %s ORDER BY d.created_at, d.id",
        org,
    )
    assert rows == [
        {"state": "delivered", "attempts": 1, "later": 0},
        {"state": "pending", "attempts": 0, "later": 1},
    ]
