"""The contract between the job queue and the work it runs: context, verdicts, errors, job kinds."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from psycopg.rows import DictRow
from psycopg_pool import AsyncConnectionPool

from controlplane.db import AsyncConn
from controlplane.settings import Settings
from controlplane.transitions import Actor

# Job kinds of the instance operations (one live job per instance and kind).
PROVISION = "provision"
UPDATE = "update"
SUSPEND = "suspend"
RESUME = "resume"
HEAL = "heal"
DEPROVISION = "deprovision"
BACKUP = "backup"
RESTORE = "restore"
INSTANCE_JOB_KINDS = (PROVISION, UPDATE, SUSPEND, RESUME, HEAL, DEPROVISION, BACKUP, RESTORE)


class TemporaryError(Exception):
    """The step failed but may work later: the job is retried after `delay_s` (or the backoff)."""

    def __init__(self, message: str, delay_s: float | None = None) -> None:
        super().__init__(message)
        self.delay_s = delay_s


class PermanentError(Exception):
    """The step can never succeed: the job is abandoned at once."""


class StaleFence(Exception):
    """A resource has seen a higher fence: this worker no longer owns the job and must stop."""

    def __init__(self, resource: str, fence: int, highest: int) -> None:
        super().__init__(f"{resource}: fence {fence} is lower than {highest}, already seen")
        self.resource = resource
        self.fence = fence
        self.highest = highest


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

    @property
    def actor(self) -> Actor:
        return Actor("worker", self.worker_id)


Handler = Callable[[JobContext], Awaitable[Verdict]]
# Called in the same transaction that abandons a job (by the supervisor or an operator).
AbandonHook = Callable[[AsyncConn, DictRow, Actor], Awaitable[None]]


@dataclass(frozen=True)
class JobKind:
    name: str
    handler: Handler
    on_abandoned: AbandonHook | None = None
    max_attempts: int = 5


class JobRegistry:
    """Handlers by job kind: what a worker can run and what an abandonment must also do."""

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
