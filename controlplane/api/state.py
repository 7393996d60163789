"""What the running application holds: settings, the database pool, the credential box, the policy."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from psycopg_pool import AsyncConnectionPool
from starlette.requests import HTTPConnection

from controlplane.api.hub import Hub
from controlplane.api.ratelimit import FixedWindow
from controlplane.db.connection import AsyncConn
from controlplane.queue.registry import JobRegistry
from controlplane.runtime.secretbox import SecretBox
from controlplane.runtime.settings import Settings
from controlplane.services.policy import Policy
from controlplane.services.sessions import Seal
from controlplane.services.tenants import Principal
from provisioners.base import Provisioner


class KeyCache:
    """Keys verified recently (by hash), so a request need not look its key up every time."""

    MAX_ENTRIES = 10_000

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: dict[bytes, tuple[Principal, float]] = {}

    def get(self, key_hash: bytes) -> Principal | None:
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        if entry[1] <= self.clock():
            del self._entries[key_hash]
            return None
        return entry[0]

    def put(self, key_hash: bytes, who: Principal) -> None:
        if self.ttl_s <= 0:
            return
        if len(self._entries) >= self.MAX_ENTRIES:
            self._entries.clear()
        self._entries[key_hash] = (who, self.clock() + self.ttl_s)

    def forget(self, key_id: uuid.UUID) -> None:
        for key_hash in [h for h, (who, _) in self._entries.items() if who.key_id == key_id]:
            del self._entries[key_hash]


@dataclass
class AppState:
    settings: Settings
    database_url: str
    pool: AsyncConnectionPool[AsyncConn]
    box: SecretBox
    policy: Policy = field(default_factory=Policy)
    head_revision: str | None = None
    job_registry: JobRegistry | None = None
    keys: KeyCache = field(default_factory=lambda: KeyCache(0))
    # The provisioner of the instances (for the CA it publishes); built on first use when not given.
    provisioner: Provisioner | None = None
    # The process's one LISTEN connection, fanned out to its watch streams.
    watchers: Hub | None = None
    # The console's cookies and form tokens (from the secret key); made with the box when not given.
    seal: Seal | None = None
    # The console's sign-in attempts, per client address and key prefix (None: not limited).
    sign_in: FixedWindow | None = None

    def __post_init__(self) -> None:
        if self.seal is None:
            self.seal = Seal(self.box, self.settings.api.console_session_s)


def provisioner_of(state: AppState) -> Provisioner:
    """The application's provisioner: the one it was given, else one built from its settings."""
    if state.provisioner is None:
        import provisioners

        state.provisioner = provisioners.build(state.settings)
    return state.provisioner


def app_state(request: HTTPConnection) -> AppState:
    state = getattr(request.app.state, "controlplane", None)
    if not isinstance(state, AppState):
        raise RuntimeError("the application is not started (its lifespan has not run)")
    return state
