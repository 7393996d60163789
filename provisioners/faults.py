"""Fault injection: a wrapper around any provisioner that fails, hangs or kills its process at a step."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Literal, TypeVar

from controlplane.errors import PermanentError, TemporaryError
from controlplane.failures import QUOTA_EXCEEDED
from provisioners.base import (
    JOB_ATTEMPT,
    STEPS,
    BackupInfo,
    ConnectionInfo,
    DeprovisionResult,
    InstanceSpec,
    Observation,
    Provisioner,
    Resource,
)

Action = Literal["fail", "fail_permanent", "quota", "hang", "kill"]
ACTIONS: tuple[Action, ...] = ("fail", "fail_permanent", "quota", "hang", "kill")
T = TypeVar("T")


class FaultSpecError(ValueError):
    """A fault description that cannot be parsed."""


@dataclass(frozen=True)
class Fault:
    """At `step`, on job attempt `attempt` (None: every attempt), do `action`.

    `when` is "before" the real step runs, "after" it ran (its work is done but the caller never
    learns), or a number of seconds into the step ("during": the real step keeps running).
    """

    step: str
    action: Action
    attempt: int | None = 1
    when: str = "before"

    @property
    def during_s(self) -> float | None:
        return None if self.when in ("before", "after") else float(self.when)

    def matches(self, step: str, attempt: int) -> bool:
        return self.step == step and (self.attempt is None or self.attempt == attempt)

    def __str__(self) -> str:
        attempt = "*" if self.attempt is None else str(self.attempt)
        return f"{self.step}:{self.action}:{attempt}:{self.when}"


def parse_faults(text: str | None) -> list[Fault]:
    """`step:action[:attempt[:when]]`, comma-separated; attempt `*` means every attempt.

    Example: `initialize_database:kill:1:after,apply_plan:fail_permanent`.
    """
    faults: list[Fault] = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split(":")
        if len(parts) < 2 or len(parts) > 4:
            raise FaultSpecError(f"fault {item!r}: expected step:action[:attempt[:when]]")
        step, action = parts[0], parts[1]
        if step not in (*STEPS, "observe"):
            raise FaultSpecError(f"fault {item!r}: unknown step {step!r}")
        if action not in ACTIONS:
            raise FaultSpecError(f"fault {item!r}: action must be one of {', '.join(ACTIONS)}")
        attempt: int | None = 1
        if len(parts) > 2:
            attempt = None if parts[2] == "*" else int(parts[2])
        when = parts[3] if len(parts) > 3 else "before"
        if when not in ("before", "after"):
            try:
                float(when)
            except ValueError:
                raise FaultSpecError(f"fault {item!r}: when is before, after or seconds") from None
        faults.append(Fault(step, action, attempt, when))
    return faults


def kill_this_process() -> None:
    """What a crash looks like: SIGKILL, no cleanup, no goodbye."""
    os.kill(os.getpid(), signal.SIGKILL)


class FaultyProvisioner(Provisioner):
    """Runs `inner`, except where a fault matches the step and the job's attempt."""

    def __init__(
        self,
        inner: Provisioner,
        faults: list[Fault],
        *,
        kill: Callable[[], None] = kill_this_process,
    ) -> None:
        self.inner = inner
        self.faults = faults
        self.name = f"faulty-{inner.name}"
        self.supports_restore = inner.supports_restore
        self.supports_backups = inner.supports_backups
        self._kill = kill
        # (step, attempt) pairs that fired, for tests that watch from the same process.
        self.fired: list[tuple[str, int]] = []

    async def _act(self, fault: Fault, step: str) -> None:
        self.fired.append((step, JOB_ATTEMPT.get()))
        message = f"injected fault at {step} ({fault})"
        if fault.action == "fail":
            # No delay of its own: the job is retried after the policy's backoff, as a real
            # temporary failure would be.
            raise TemporaryError(message)
        if fault.action == "fail_permanent":
            raise PermanentError(message)
        if fault.action == "quota":
            # What a provider's quota refusal looks like once translated (e.g. a ResourceQuota's 403).
            raise PermanentError(f"{message}: quota exceeded", code=QUOTA_EXCEEDED)
        if fault.action == "hang":
            await asyncio.Event().wait()  # until cancelled
        if fault.action == "kill":
            self._kill()
            await asyncio.Event().wait()  # a replaced kill() that returns still never proceeds

    async def _around(self, step: str, work: Callable[[], Awaitable[T]]) -> T:
        attempt = JOB_ATTEMPT.get()
        fault = next((f for f in self.faults if f.matches(step, attempt)), None)
        if fault is None:
            return await work()
        if fault.when == "before":
            await self._act(fault, step)
        if fault.during_s is not None:
            task = asyncio.ensure_future(work())
            done, _ = await asyncio.wait({task}, timeout=fault.during_s)
            if not done:
                await self._act(fault, step)
            return await task
        result = await work()
        await self._act(fault, step)
        return result

    async def allocate_storage(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        await self._around("allocate_storage", lambda: self.inner.allocate_storage(instance_id, spec, fence))

    async def configure_network(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        await self._around(
            "configure_network", lambda: self.inner.configure_network(instance_id, spec, fence)
        )

    async def initialize_database(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, password: str | None = None
    ) -> ConnectionInfo:
        return await self._around(
            "initialize_database",
            lambda: self.inner.initialize_database(instance_id, spec, fence, password=password),
        )

    async def apply_plan(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return await self._around("apply_plan", lambda: self.inner.apply_plan(instance_id, spec, fence))

    async def suspend(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return await self._around("suspend", lambda: self.inner.suspend(instance_id, spec, fence))

    async def resume(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return await self._around("resume", lambda: self.inner.resume(instance_id, spec, fence))

    async def final_backup(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> str | None:
        return await self._around("final_backup", lambda: self.inner.final_backup(instance_id, spec, fence))

    async def deprovision(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, skip_backup: bool = False
    ) -> DeprovisionResult:
        return await self._around(
            "deprovision",
            lambda: self.inner.deprovision(instance_id, spec, fence, skip_backup=skip_backup),
        )

    async def observe(self, instance_id: uuid.UUID) -> Observation:
        return await self._around("observe", lambda: self.inner.observe(instance_id))

    async def take_backup(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, kind: str = "on_demand"
    ) -> BackupInfo:
        return await self._around(
            "take_backup", lambda: self.inner.take_backup(instance_id, spec, fence, kind=kind)
        )

    async def list_backups(self, instance_id: uuid.UUID) -> list[BackupInfo]:
        return await self.inner.list_backups(instance_id)

    async def restore(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, backup_id: str | None
    ) -> None:
        await self._around(
            "restore", lambda: self.inner.restore(instance_id, spec, fence, backup_id=backup_id)
        )

    async def ca_certificate(self) -> str | None:
        return await self.inner.ca_certificate()

    async def inventory(self) -> list[Resource]:
        return await self.inner.inventory()

    async def close(self) -> None:
        await self.inner.close()

    async def start_all(self, instance_ids: Collection[uuid.UUID]) -> list[uuid.UUID]:
        return await self.inner.start_all(instance_ids)

    async def stop_all(self) -> list[uuid.UUID]:
        return await self.inner.stop_all()

    def __getattr__(self, name: str) -> object:
        # Provisioner-specific helpers (e.g. the local one's paths) stay reachable through the wrapper.
        return getattr(self.inner, name)
