"""GET /v1/instances/{id}/watch: a snapshot, one event per transition, the end after a terminal state."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
from fastapi import FastAPI

from controlplane.api import watch
from controlplane.api.state import AppState
from controlplane.db import AsyncConn
from tests.api_support import Tenant, create, drive

pytest_plugins = ("tests.api_fixtures",)


def parse_sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if "event" in fields:
            events.append((fields["event"], json.loads(fields["data"])))
    return events


async def wait_for_listener(conn: AsyncConn) -> None:
    for _ in range(200):
        cursor = await conn.execute(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = %s"
            " AND state = 'idle' AND query <> '' AND datname = current_database()",
            (watch.APPLICATION_NAME,),
        )
        row = await cursor.fetchone()
        if row is not None and row["n"] > 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the watch never started listening")


async def test_watch_yields_one_event_per_transition_and_ends_when_terminal(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    made = await create(client, tenant, "orders")
    stream = asyncio.create_task(client.get(f"/v1/instances/{made['id']}/watch", headers=tenant.headers))
    await wait_for_listener(conn)
    await drive(conn, made["id"], "start_provisioning")
    await drive(conn, made["id"], "provisioned")
    await drive(conn, made["id"], "deprovision")
    await drive(conn, made["id"], "deprovisioned")
    response = await asyncio.wait_for(stream, timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[0][0] == "instance" and events[0][1]["state"] == "pending"
    transitions = [(data["state"], data["state_version"]) for kind, data in events[1:]]
    assert transitions == [("provisioning", 1), ("ready", 2), ("deprovisioning", 3), ("deleted", 4)]
    assert all(kind == "transition" and data["id"] == made["id"] for kind, data in events[1:])


async def test_watch_of_a_terminal_instance_is_just_the_snapshot(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    made = await create(client, tenant, "orders")
    await drive(conn, made["id"], "fail")
    response = await client.get(f"/v1/instances/{made['id']}/watch", headers=tenant.headers)
    events = parse_sse(response.text)
    assert [(k, d["state"]) for k, d in events] == [("instance", "failed")]


async def test_watch_ignores_other_instances_and_stops_when_the_client_leaves(
    app: FastAPI, client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    mine = await create(client, tenant, "mine")
    other = await create(client, tenant, "other")

    class GoneAfterFirstCheck:
        async def is_disconnected(self) -> bool:
            return True

    state: AppState = app.state.controlplane
    stream = watch.instance_stream(
        state,
        GoneAfterFirstCheck(),  # type: ignore[arg-type]
        uuid.UUID(mine["id"]),
        tenant.org_id,
        keepalive_s=0.3,
    )
    chunks = [await anext(stream)]

    async def rest() -> None:
        chunks.extend([chunk async for chunk in stream])

    reader = asyncio.create_task(rest())
    await wait_for_listener(conn)
    await drive(conn, other["id"], "fail")
    await asyncio.wait_for(reader, timeout=5)
    events = parse_sse(b"".join(chunks).decode())
    assert [k for k, _ in events] == ["instance"]  # the other instance's transition is not ours
    for _ in range(100):  # its connection is closed (the server process may take a moment to go)
        cursor = await conn.execute(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = %s"
            " AND datname = current_database()",
            (watch.APPLICATION_NAME,),
        )
        if await cursor.fetchone() == {"n": 0}:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the watch's connection is still open")
