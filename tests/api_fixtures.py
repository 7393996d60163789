"""Fixtures of the API tests (a pytest plugin): the app in-process over a fresh database, tenants."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from controlplane.api.app import create_app
from controlplane.db.connection import AsyncConn
from controlplane.runtime.settings import Settings
from controlplane.services import tenants
from tests.api_support import WEBHOOK_SECRET, Tenant, make_tenant


@pytest.fixture
def api_settings(settings: Settings) -> Settings:
    return settings.replace(stripe_webhook_secret=WEBHOOK_SECRET, max_body_bytes=4096)


@pytest.fixture
async def app(api_settings: Settings) -> AsyncIterator[FastAPI]:
    application = create_app(api_settings)
    async with application.router.lifespan_context(application):
        yield application


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


@pytest.fixture
async def admin_headers(conn: AsyncConn) -> dict[str, str]:
    key = await tenants.create_admin_key(conn)
    return {"Authorization": f"Bearer {key.plaintext}"}


@pytest.fixture
async def tenant(conn: AsyncConn) -> Tenant:
    return await make_tenant(conn, "acme")


@pytest.fixture
async def other_tenant(conn: AsyncConn) -> Tenant:
    return await make_tenant(conn, "globex")


@pytest.fixture
async def local_app(local_settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The API over the same database, data directory and secret key as the local worker's."""
    application: FastAPI = create_app(local_settings)
    async with application.router.lifespan_context(application):
        transport = httpx.ASGITransport(app=application, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            yield http
