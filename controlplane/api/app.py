"""The application factory: routes, error handling and middleware from settings; run by uvicorn."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi

from controlplane.api import console, docs, openapi, ratelimit
from controlplane.api import problems as errors
from controlplane.api.hub import Hub
from controlplane.api.observe import Observe
from controlplane.api.routes import admin as routes_admin
from controlplane.api.routes import backups as routes_backups
from controlplane.api.routes import instances as routes_instances
from controlplane.api.routes import metrics as routes_metrics
from controlplane.api.routes import notifications as routes_notifications
from controlplane.api.routes import orgs as routes_orgs
from controlplane.api.routes import public as routes_public
from controlplane.api.routes import stripe_webhooks as webhooks
from controlplane.api.routes import tls as routes_tls
from controlplane.api.state import AppState, KeyCache
from controlplane.db import connection as db
from controlplane.queue.registry import JobRegistry
from controlplane.runtime.secretbox import load_box
from controlplane.runtime.settings import Settings
from controlplane.services.policy import Policy
from provisioners.base import Provisioner

log = logging.getLogger(__name__)

API_VERSION = "1"


def create_app(
    settings: Settings,
    *,
    database_url: str | None = None,
    job_registry: JobRegistry | None = None,
    provisioner: Provisioner | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """A new application; its database pool opens and closes with the lifespan.

    `database_url` overrides the settings' (e.g. the embedded server's URL resolved by the caller);
    `job_registry` gives the job kinds whose abandonment hooks an operator's abandon runs (the
    process's one registry, built where it starts; without it, abandon is refused); `provisioner`
    is the one whose CA the API publishes (else one is built from the settings when first asked,
    and closed with the application); `clock` is the rate limits' (monotonic seconds; tests pass
    their own).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = database_url or db.resolve_database_url(settings)
        pool = db.pool(url, name="controlplane-api", timeouts=db.Timeouts.api(settings))
        await pool.open()
        app.state.controlplane = AppState(
            settings=settings,
            database_url=url,
            pool=pool,
            box=load_box(settings),
            policy=Policy.from_settings(settings),
            job_registry=job_registry,
            keys=KeyCache(settings.api.key_cache_s),
            provisioner=provisioner,
            watchers=Hub(url),
            sign_in=ratelimit.window(settings.api.sign_in_limit, settings.api.rate_window_s, clock),
        )
        try:
            yield
        finally:
            await end_streams(app)
            built = app.state.controlplane.provisioner
            if built is not None and built is not provisioner:
                await built.close()
            await pool.close()
            app.state.controlplane = None

    app = FastAPI(
        title="Managed PostgreSQL control plane",
        version=API_VERSION,
        description="Create, resize and delete PostgreSQL databases; SRE views of their lifecycle.",
        lifespan=lifespan,
        dependencies=[Depends(errors.refuse_unknown_query)],
        # Served from the project's own assets (controlplane.api.docs), not a CDN.
        docs_url=None,
        redoc_url=None,
    )
    errors.install(app)
    for router in (
        routes_instances.router,
        routes_backups.router,
        routes_metrics.router,
        routes_orgs.router,
        routes_admin.router,
        webhooks.router,
        routes_public.router,
        routes_tls.router,
        routes_notifications.router,
    ):
        app.include_router(router)
    docs.install(app)
    console.install(app)
    app.add_middleware(errors.BodySizeLimit, max_bytes=settings.api.max_body_bytes)
    keys, webhook = ratelimit.limiters(
        settings.api.rate_limit, settings.api.rate_window_s, settings.api.webhook_rate_limit, clock
    )
    app.add_middleware(ratelimit.RateLimit, keys=keys, webhook=webhook)
    app.add_middleware(errors.CatchAll)
    app.add_middleware(Observe)
    app.add_middleware(errors.RequestId)
    app.openapi = lambda: _openapi(app, settings.api.public_url)  # type: ignore[method-assign]
    return app


async def end_streams(app: FastAPI) -> None:
    """End the application's watch streams now (their clients reconnect, with Last-Event-ID): a
    server shutting down does not wait for them, which would otherwise last as long as they do."""
    state = getattr(app.state, "controlplane", None)
    if isinstance(state, AppState) and state.watchers is not None:
        await state.watchers.close()


def _openapi(app: FastAPI, public_url: str | None) -> dict[str, Any]:
    """The generated schema, completed for client generators (controlplane.api.openapi)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
            servers=openapi.servers(public_url),
            license_info=openapi.LICENSE,
        )
        app.openapi_schema = openapi.finish(schema)
    return app.openapi_schema
