"""GET /v1/instances/{id}/watch: a snapshot, one event per transition, the end after a terminal state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI

from controlplane.api import watch
from controlplane.api.state import AppState
from controlplane.cli import process_roles
from controlplane.db.connection import AsyncConn
from controlplane.handlers import operations
from controlplane.runtime.postgres import free_port
from controlplane.runtime.settings import Settings
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
    assert state.watchers is not None and state.watchers.streams == 0  # it follows nothing any more


@contextlib.asynccontextmanager
async def real_server(
    settings: Settings,
) -> AsyncIterator[tuple[httpx.AsyncClient, asyncio.Event, asyncio.Task[None]]]:
    """The API served by uvicorn on a socket (streams are streamed), as `serve` and `up` run it: a
    client of it, the stop event, and the task serving it."""
    served = settings.replace(api_port=free_port())
    url = served.database.url_value
    assert url is not None
    stop, listening = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        process_roles.run_api(served, url, operations.registry(), stop, listening=listening)
    )
    await asyncio.wait_for(listening.wait(), 30)
    try:
        async with httpx.AsyncClient(base_url=served.api.url, timeout=10) as client:
            yield client, stop, task
    finally:
        stop.set()
        await task


async def _listeners(conn: AsyncConn) -> int:
    cursor = await conn.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = %s"
        " AND datname = current_database()",
        (watch.APPLICATION_NAME,),
    )
    row = await cursor.fetchone()
    return int(row["n"]) if row else 0


async def _events_until(lines: AsyncIterator[str], count: int) -> list[tuple[str, int, str]]:
    """(event, id, state) of the next `count` events of a stream's lines (fewer if it ends)."""
    found: list[tuple[str, int, str]] = []
    block: dict[str, str] = {}
    async for line in lines:
        if line:
            name, _, value = line.partition(": ")
            block[name] = value
            continue
        if "event" in block:
            found.append((block["event"], int(block["id"]), json.loads(block["data"])["state"]))
            if len(found) == count:
                return found
        block = {}
    return found


async def test_every_watcher_of_a_process_shares_its_one_listen_connection(
    api_settings: Settings, tenant: Tenant, conn: AsyncConn
) -> None:
    async with real_server(api_settings) as (client, _, _), contextlib.AsyncExitStack() as stack:
        made = [await create(client, tenant, f"db{i}") for i in range(3)]
        streams = []
        for inst in (*made, made[0]):  # four watchers, two of them on one instance
            response = await stack.enter_async_context(
                client.stream("GET", f"/v1/instances/{inst['id']}/watch", headers=tenant.headers)
            )
            lines = response.aiter_lines()
            assert await _events_until(lines, 1) == [("instance", 0, "pending")]
            streams.append(lines)
        assert await _listeners(conn) == 1
        for inst in made:
            await drive(conn, inst["id"], "fail")
        for lines in streams:
            assert await asyncio.wait_for(_events_until(lines, 1), 5) == [("transition", 1, "failed")]
        assert await _listeners(conn) == 1  # kept for the next watchers, not one per watcher


async def test_a_watcher_resumes_after_its_last_event_id_and_a_lost_listen_connection_misses_nothing(
    api_settings: Settings, tenant: Tenant, conn: AsyncConn
) -> None:
    async with real_server(api_settings) as (client, _, _):
        made = await create(client, tenant, "orders")
        path = f"/v1/instances/{made['id']}/watch"
        await drive(conn, made["id"], "start_provisioning")
        await drive(conn, made["id"], "provisioned")
        # Reconnecting after event 1: what came since, from the audit log, then the live ones.
        async with client.stream("GET", path, headers={**tenant.headers, "Last-Event-ID": "1"}) as response:
            lines = response.aiter_lines()
            assert await _events_until(lines, 1) == [("transition", 2, "ready")]
            # The process's LISTEN connection is lost; what moves meanwhile still reaches the stream.
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                (watch.APPLICATION_NAME,),
            )
            await drive(conn, made["id"], "deprovision")
            await drive(conn, made["id"], "deprovisioned")
            events = await asyncio.wait_for(_events_until(lines, 2), 10)
        assert events == [("transition", 3, "deprovisioning"), ("transition", 4, "deleted")]
        # An id that is not one of ours (or ahead of the instance) gets the snapshot.
        for stale in ("banana", "99"):
            shown = await client.get(path, headers={**tenant.headers, "Last-Event-ID": stale})
            assert [(k, d["state"]) for k, d in parse_sse(shown.text)] == [("instance", "deleted")]


async def test_streams_end_at_once_when_the_server_stops(api_settings: Settings, tenant: Tenant) -> None:
    async with real_server(api_settings) as (client, stop, serving):
        made = await create(client, tenant, "orders")
        async with client.stream(
            "GET", f"/v1/instances/{made['id']}/watch", headers=tenant.headers
        ) as response:
            lines = response.aiter_lines()
            assert await _events_until(lines, 1) == [("instance", 0, "pending")]
            stop.set()
            # The stream ends (no event), and the server stops, without waiting for the client.
            assert await asyncio.wait_for(_events_until(lines, 1), 5) == []
            await asyncio.wait_for(asyncio.shield(serving), 5)


async def test_the_stream_writes_times_as_the_rest_answers_do(
    client: httpx.AsyncClient, tenant: Tenant, conn: AsyncConn
) -> None:
    """RFC 3339 (`2026-12-02T02:29:42.1Z`), the same text as GET's: a typed client parses both alike."""
    made = await create(client, tenant, "orders")
    await drive(conn, made["id"], "fail")
    ((_, snapshot),) = parse_sse(
        (await client.get(f"/v1/instances/{made['id']}/watch", headers=tenant.headers)).text
    )
    read = (await client.get(f"/v1/instances/{made['id']}", headers=tenant.headers)).json()
    for field in ("created_at", "updated_at", "state_entered_at"):
        assert snapshot[field] == read[field], field
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", snapshot[field])
