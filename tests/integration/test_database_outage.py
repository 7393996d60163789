"""The API while its database is away and then read-only (F21): every request is answered, by a
503 problem with Retry-After when it cannot be served; nothing is half-written; service returns
by itself."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg

from controlplane.audit import verify as audit
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from tests.api_support import create, make_ready, make_tenant, serving
from tests.support import eventually
from tests.tcp_proxy import Proxy

PROBLEM = "application/problem+json"
POOL_MAX_SIZE = 10  # the API's pool


def _with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.netloc.rsplit(':', 1)[0]}:{port}"))


def _closed_port() -> int:
    """A loopback port nothing listens on (a stopped server's)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _refused(response: httpx.Response) -> None:
    """The answer of a request the database cannot serve now: a 503 problem the client retries."""
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.headers["content-type"] == PROBLEM
    assert response.json()["type"] == "urn:controlplane:problem:unavailable"
    assert int(response.headers["retry-after"]) >= 1


async def _as_a_client_does(send: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
    """`send()`, sent again after each 503 with Retry-After: a session the pool opened while the
    database was read-only refuses one write, and is replaced; so at most one per pooled session."""
    for _ in range(POOL_MAX_SIZE):
        response = await send()
        if response.status_code != 503:
            return response
        _refused(response)
    return await send()


async def _read_only(conn: AsyncConn, dbname: str, on: bool) -> None:
    """The database's new sessions read-only (as on a standby, or a server kept read-only), or not."""
    ident = psycopg.sql.Identifier(dbname)
    setting = "SET default_transaction_read_only = on" if on else "RESET default_transaction_read_only"
    statement = "ALTER DATABASE {} " + setting
    await conn.execute(psycopg.sql.SQL(statement).format(ident))


async def test_f21_database_unavailable_then_read_only(
    conn: AsyncConn, settings: Settings, fresh_database: str
) -> None:
    real = urlsplit(fresh_database)
    assert real.port is not None
    proxy = await Proxy(real.port).start()
    dbname = real.path.lstrip("/")
    try:
        async with serving(settings, database_url=_with_port(fresh_database, proxy.port)) as client:
            await _through_an_outage(client, conn, settings, proxy, real.port, dbname)
    finally:
        await _read_only(conn, dbname, on=False)
        await proxy.stop()
    assert await audit.verify(conn) == []


async def _through_an_outage(
    client: httpx.AsyncClient, conn: AsyncConn, settings: Settings, proxy: Proxy, port: int, dbname: str
) -> None:
    tenant = await make_tenant(conn)
    made = await create(client, tenant, "orders")
    await make_ready(conn, settings, made["id"])
    path = f"/v1/instances/{made['id']}"
    key = {"Idempotency-Key": str(uuid.uuid4()), **tenant.headers}
    new = {"name": "billing", "plan": "dev"}

    async def attempts() -> list[httpx.Response]:
        return [
            await client.patch(path, json={"plan": "small"}, headers=tenant.headers),
            await client.post("/v1/instances", json=new, headers=key),
            await client.delete(path, headers=tenant.headers),
            await client.get("/readyz"),
        ]

    # The database goes away (its server stops: sessions cut, connections refused), for longer
    # than any request waits: every request is answered at once, with 503 and Retry-After.
    proxy.repoint(_closed_port())
    for _ in range(3):
        started = time.monotonic()
        for response in [await client.get(path, headers=tenant.headers), *await attempts()]:
            _refused(response)
        assert time.monotonic() - started < 5  # no request waits out a timeout of its own

    # It comes back read-only (a standby, or a primary kept read-only): reads are served again,
    # every write is a 503 with Retry-After, and /readyz says the API cannot do its work.
    await _read_only(conn, dbname, on=True)
    proxy.repoint(port)

    async def reads_served() -> bool:
        return (await client.get(path, headers=tenant.headers)).status_code == 200

    await eventually(reads_served, "reads are served by the read-only database")
    for _ in range(3):
        for response in await attempts():
            _refused(response)
    assert "read-only" in (await client.get("/readyz")).json()["detail"]

    # Writable again: service returns by itself (no restart), and the retried requests go through.
    await _read_only(conn, dbname, on=False)

    async def ready() -> bool:
        return (await client.get("/readyz")).status_code == 200

    await eventually(ready, "/readyz answers 200 again")
    changed = await _as_a_client_does(
        lambda: client.patch(path, json={"plan": "small"}, headers=tenant.headers)
    )
    assert changed.status_code == 202, changed.text
    created = await _as_a_client_does(lambda: client.post("/v1/instances", json=new, headers=key))
    again = await client.post("/v1/instances", json=new, headers=key)
    assert created.status_code == again.status_code == 202, created.text
    assert created.json()["id"] == again.json()["id"]

    # Nothing of the refused requests was written: one spec change, one new instance with one
    # job, no deletion, and the audit log replays to the rows (checked by the caller).
    shown = (await client.get(path, headers=tenant.headers)).json()
    assert (shown["spec_generation"], shown["deletion_requested"]) == (2, False)
    rows = await conn.execute(
        "SELECT i.name, count(j.id) AS jobs FROM instances i LEFT JOIN jobs j ON j.instance_id = i.id"
        " WHERE i.org_id = %s GROUP BY i.name ORDER BY i.name",
        (tenant.org_id,),
    )
    assert await rows.fetchall() == [{"name": "billing", "jobs": 1}, {"name": "orders", "jobs": 2}]
