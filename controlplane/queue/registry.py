"""The contract between the job queue and the work it runs: context, verdicts, job kinds, the registry."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from psycopg.rows import DictRow
from psycopg_pool import AsyncConnectionPool

from controlplane.core.kinds import P
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor
from controlplane.runtime.settings import Settings

# What a completion records on the result axis, e.g. {"result": "ready"} or {"result": "nothing to do"}.
Verdict = Mapping[str, Any]


@dataclass(frozen=True)
class JobContext:
    """What a handler receives: its claimed job, its fence, a pool, the settings."""

    job: DictRow
    worker_id: str
    pool: AsyncConnectionPool[AsyncConn]
    settings: Settings
    services: Mapping[str, Any] = field(default_factory=dict)

    @property
    def job_id(self) -> uuid.UUID:
        value: uuid.UUID = self.job["id"]
        return value

    @property
    def instance_id(self) -> uuid.UUID | None:
        value: uuid.UUID | None = self.job["instance_id"]
        return value

    @property
    def fence(self) -> int:
        return int(self.job["fence"])

    @property
    def attempt(self) -> int:
        return int(self.job["attempt"])

    @property
    def payload(self) -> Mapping[str, Any]:
        value: Mapping[str, Any] = self.job["payload"]
        return value

    def typed_payload(self, cls: type[P]) -> P:
        """The payload as its kind's dataclass (a payload of the wrong shape is a PermanentError)."""
        return cls.from_json(self.payload)

    @property
    def actor(self) -> Actor:
        return Actor("worker", self.worker_id)


Handler = Callable[[JobContext], Awaitable[Verdict]]
# Called in the same transaction that abandons a job (by the supervisor or an operator).
AbandonHook = Callable[[AsyncConn, DictRow, Actor], Awaitable[None]]


@dataclass(frozen=True)
class JobKind:
    """One kind of job: how a worker runs it (none where no worker runs here, e.g. in the API) and
    what its abandonment must also do."""

    name: str
    handler: Handler | None = None
    on_abandoned: AbandonHook | None = None
    max_attempts: int = 5
    # Slots of its own in each worker (how many, from the settings), beside the `concurrency` the
    # other kinds share: its jobs never take those slots, nor wait for them. None: a shared kind.
    own_slots: Callable[[Settings], int] | None = None


class JobRegistry:
    """Job kinds by name: what a worker can run and what an abandonment must also do."""

    def __init__(self, kinds: list[JobKind] | None = None) -> None:
        self._kinds: dict[str, JobKind] = {}
        for kind in kinds or []:
            self.register(kind)

    def register(self, kind: JobKind) -> None:
        if kind.name in self._kinds:
            raise ValueError(f"job kind {kind.name!r} is registered twice")
        self._kinds[kind.name] = kind

    def get(self, name: str) -> JobKind | None:
        return self._kinds.get(name)

    def names(self) -> list[str]:
        return sorted(self._kinds)

    def own_slots(self, settings: Settings) -> dict[str, int]:
        """The runnable kinds that have slots of their own in a worker, with how many."""
        found: dict[str, int] = {}
        for name in self.runnable():
            slots = self._kinds[name].own_slots
            if slots is not None:
                found[name] = slots(settings)
        return found

    def runnable(self) -> list[str]:
        """The kinds that have a handler here: what a worker claims."""
        return sorted(name for name, kind in self._kinds.items() if kind.handler is not None)
