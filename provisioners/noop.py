"""The noop provisioner: every step succeeds at once and creates nothing (benchmarks of the control plane)."""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

from controlplane.core.dbmetrics import DatabaseStats
from provisioners.base import (
    ConnectionInfo,
    DeprovisionResult,
    InstanceSpec,
    Observation,
    Provisioner,
    Resource,
)

if TYPE_CHECKING:
    from controlplane.runtime.settings import Settings


class NoopProvisioner(Provisioner):
    """No infrastructure: what is left is the control plane's own cost of running an operation."""

    name = "noop"
    observe_latency_s = 0.0
    observe_stats = False

    def __init__(self, observe_latency_s: float = 0.0, observe_stats: bool = False) -> None:
        # What an observe costs a real provisioner (a health check's round trip), and whether it
        # reports a database's metrics as the local one's does (the reconciler then samples them):
        # benchmarks set them.
        self.observe_latency_s = observe_latency_s
        self.observe_stats = observe_stats
        self._observed = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> NoopProvisioner:
        return cls(settings.provisioner.noop_observe_latency_s, settings.provisioner.noop_observe_stats)

    async def allocate_storage(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        return None

    async def configure_network(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> None:
        return None

    async def initialize_database(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, password: str | None = None
    ) -> ConnectionInfo:
        # A fixed placeholder: nothing listens behind it, so there is no secret to protect.
        return ConnectionInfo("noop.invalid", 5432, "app", f"app_{instance_id.hex[:12]}", password or "noop")

    async def apply_plan(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return False

    async def suspend(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return False

    async def resume(self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int) -> bool:
        return False

    async def deprovision(
        self, instance_id: uuid.UUID, spec: InstanceSpec, fence: int, *, skip_backup: bool = False
    ) -> DeprovisionResult:
        return DeprovisionResult(backup=None, removed=False)

    async def observe(self, instance_id: uuid.UUID) -> Observation:
        if self.observe_latency_s:
            await asyncio.sleep(self.observe_latency_s)
        stats = None
        if self.observe_stats:
            # Counters that move, a small database: sampled as a real one's, never nearly full.
            self._observed += 1
            n = self._observed
            stats = DatabaseStats(1, 20, n, 10 * n, n, 90 * n, n, 8 * 2**20)
        return Observation(True, running=True, healthy=True, read_only=False, detail="noop", stats=stats)

    async def inventory(self) -> list[Resource]:
        return []
