"""The plans a customer can choose (pure data): the PostgreSQL settings and the shape each one
provisions, and how often its instances are backed up."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

PLANS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "dev": MappingProxyType({"max_connections": 20, "shared_buffers": "32MB"}),
        "small": MappingProxyType({"max_connections": 50, "shared_buffers": "128MB"}),
        "medium": MappingProxyType({"max_connections": 100, "shared_buffers": "256MB"}),
    }
)


@dataclass(frozen=True)
class Shape:
    """What a plan runs on: PostgreSQL servers (one primary, the rest streaming standbys), the
    volume of each, and the CPU and memory each server asks for (Kubernetes quantities)."""

    instances: int
    storage_gb: int
    cpu: str
    memory: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "instances": self.instances,
            "storage_gb": self.storage_gb,
            "cpu": self.cpu,
            "memory": self.memory,
        }


# One server for dev; small and medium keep standbys the operator fails over to.
SHAPES: Mapping[str, Shape] = MappingProxyType(
    {
        "dev": Shape(instances=1, storage_gb=1, cpu="250m", memory="256Mi"),
        "small": Shape(instances=2, storage_gb=10, cpu="500m", memory="512Mi"),
        "medium": Shape(instances=3, storage_gb=50, cpu="1", memory="1Gi"),
    }
)


# The most storage autoscaling grows a plan's volume to (GB); the allocation starts at the shape's.
STORAGE_MAX_GB: Mapping[str, int] = MappingProxyType({"dev": 10, "small": 100, "medium": 500})


def storage_max_gb(name: str) -> int:
    """The largest allocation of plan `name` (what autoscaling stops at), or UnknownPlan."""
    try:
        return STORAGE_MAX_GB[name]
    except KeyError:
        raise UnknownPlan(name) from None


@dataclass(frozen=True)
class BackupSchedule:
    """A backup every `interval_s` seconds: a full one every `full_every` backups (at least that
    often), differential ones (what changed since the full) between; the newest `keep` full backups
    are kept, with the differential ones that need them and the WAL archived since the oldest, so
    any moment since the oldest full backup kept can be restored."""

    interval_s: float
    keep: int
    full_every: int = 1

    @property
    def full_interval_s(self) -> float:
        return self.interval_s * self.full_every


HOUR = 3600.0
BACKUPS: Mapping[str, BackupSchedule] = MappingProxyType(
    {
        "dev": BackupSchedule(interval_s=24 * HOUR, keep=3, full_every=1),
        "small": BackupSchedule(interval_s=12 * HOUR, keep=2, full_every=7),
        "medium": BackupSchedule(interval_s=6 * HOUR, keep=2, full_every=14),
    }
)


class UnknownPlan(KeyError):
    """A plan name that is not in PLANS."""


def plan_names() -> tuple[str, ...]:
    return tuple(PLANS)


def is_plan(name: str) -> bool:
    return name in PLANS


def get_plan(name: str) -> Mapping[str, Any]:
    """The settings of plan `name`, or UnknownPlan."""
    try:
        return PLANS[name]
    except KeyError:
        raise UnknownPlan(name) from None


def get_shape(name: str) -> Shape:
    """The shape of plan `name`, or UnknownPlan."""
    try:
        return SHAPES[name]
    except KeyError:
        raise UnknownPlan(name) from None


def backup_schedule(name: str) -> BackupSchedule:
    """The backup schedule of plan `name`, or UnknownPlan."""
    try:
        return BACKUPS[name]
    except KeyError:
        raise UnknownPlan(name) from None
