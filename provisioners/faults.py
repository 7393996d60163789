"""Fault injection: a wrapper around any provisioner that fails, hangs or kills its process at a step."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Awaitable, Callable, Collection
from typing import TypeVar

from controlplane.core.failures import QUOTA_EXCEEDED
from controlplane.core.faultspec import Fault
from controlplane.core.step_errors import PermanentError, TemporaryError
from provisioners.base import (
    JOB_ATTEMPT,
    BackupInfo,
    ConnectionInfo,
    DeprovisionResult,
    InstanceSpec,
    Observation,
    OperatorEvent,
    Promotion,
    Provisioner,
    RecoveryWindow,
    Resource,
    Restored,
    RestorePoint,
)

T = TypeVar("T")


def kill_this_process() -> None:
    """What a crash looks like: SIGKILL, no cleanup, no goodbye."""
    os.kill(os.getpid(), signal.SIGKILL)


class FaultyProvisioner(Provisioner):
    """Runs `inner`, except where a fault matches the step and the job's attempt."""

    wraps_another = True

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
        self.reports_windows = inner.reports_windows
        self.pools_ha_endpoint = inner.pools_ha_endpoint
        self.serves_read_only = inner.serves_read_only
        self.fails_over_itself = inner.fails_over_itself
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

    async def configure_archive(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        await self._around(
            "configure_archive", lambda: self.inner.configure_archive(instance_id, spec, fence)
        )

    async def start_standbys(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return await self._around(
            "start_standbys", lambda: self.inner.start_standbys(instance_id, spec, fence)
        )

    async def fence_primary(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> str | None:
        return await self._around("fence_primary", lambda: self.inner.fence_primary(instance_id, spec, fence))

    async def promote_standby(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> Promotion:
        return await self._around(
            "promote_standby", lambda: self.inner.promote_standby(instance_id, spec, fence)
        )

    async def switchover(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> Promotion | None:
        return await self._around("switchover", lambda: self.inner.switchover(instance_id, spec, fence))

    async def recovery_window(self, instance_id: uuid.UUID) -> RecoveryWindow | None:
        return await self.inner.recovery_window(instance_id)

    async def operator_events(self, instance_id: uuid.UUID) -> tuple[OperatorEvent, ...]:
        return await self.inner.operator_events(instance_id)

    async def verify_backups(self, instance_id: uuid.UUID) -> str | None:
        return await self.inner.verify_backups(instance_id)

    async def expire(self, instance_id: uuid.UUID) -> bool:
        return await self.inner.expire(instance_id)

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
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, point: RestorePoint
    ) -> Restored:
        return await self._around(
            "restore", lambda: self.inner.restore(instance_id, spec, fence, point=point)
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
