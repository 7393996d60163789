"""What the running application holds: settings, the database pool, the credential box."""

from __future__ import annotations

from dataclasses import dataclass, field

from psycopg_pool import AsyncConnectionPool
from starlette.requests import HTTPConnection

from controlplane.db import AsyncConn
from controlplane.handlers import JobRegistry
from controlplane.secretbox import SecretBox
from controlplane.settings import Settings


@dataclass
class AppState:
    settings: Settings
    database_url: str
    pool: AsyncConnectionPool[AsyncConn]
    box: SecretBox
    head_revision: str | None = None
    job_registry: JobRegistry | None = None
    extra: dict[str, object] = field(default_factory=dict)


def app_state(request: HTTPConnection) -> AppState:
    state = getattr(request.app.state, "controlplane", None)
    if not isinstance(state, AppState):
        raise RuntimeError("the application is not started (its lifespan has not run)")
    return state
