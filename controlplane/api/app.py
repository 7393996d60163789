"""The application factory: routes, error handling and middleware from settings; run by uvicorn."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi

from controlplane import db
from controlplane.api import (
    console,
    docs,
    errors,
    routes_admin,
    routes_backups,
    routes_instances,
    routes_notifications,
    routes_orgs,
    routes_public,
    routes_tls,
    webhooks,
)
from controlplane.api.errors import Problem
from controlplane.api.state import AppState, KeyCache
from controlplane.registry import JobRegistry
from controlplane.secretbox import load_box
from controlplane.services.policy import Policy
from controlplane.settings import Settings
from provisioners.base import Provisioner

log = logging.getLogger(__name__)

API_VERSION = "1"


def create_app(
    settings: Settings,
    *,
    database_url: str | None = None,
    job_registry: JobRegistry | None = None,
    provisioner: Provisioner | None = None,
) -> FastAPI:
    """A new application; its database pool opens and closes with the lifespan.

    `database_url` overrides the settings' (e.g. the embedded server's URL resolved by the caller);
    `job_registry` gives the job kinds whose abandonment hooks an operator's abandon runs (the
    process's one registry, built where it starts; without it, abandon is refused); `provisioner`
    is the one whose CA the API publishes (else one is built from the settings when first asked,
    and closed with the application).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = database_url or db.resolve_database_url(settings)
        pool = db.pool(url, name="controlplane-api")
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
        )
        try:
            yield
        finally:
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
    app.add_middleware(errors.CatchAll)
    app.add_middleware(errors.RequestId)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The generated schema, with the Problem document that every error response refers to."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
        app.openapi_schema = schema
    return app.openapi_schema


def serve(
    settings: Settings, *, database_url: str | None = None, job_registry: JobRegistry | None = None
) -> None:
    """Run the API with uvicorn on settings.api.host:api_port until interrupted."""
    import uvicorn

    app = create_app(settings, database_url=database_url, job_registry=job_registry)
    log.info("API listening on %s", settings.api.url)
    uvicorn.run(app, host=settings.api.host, port=settings.api.port, log_config=None, proxy_headers=True)
