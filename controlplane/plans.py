"""The plans a customer can choose (pure data): the PostgreSQL settings each one provisions."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

PLANS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "dev": MappingProxyType({"max_connections": 20, "shared_buffers": "32MB"}),
        "small": MappingProxyType({"max_connections": 50, "shared_buffers": "128MB"}),
        "medium": MappingProxyType({"max_connections": 100, "shared_buffers": "256MB"}),
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
