"""The workloads, in the order they run within each repetition."""

from __future__ import annotations

from bench.core import Workload


def all_workloads() -> list[Workload]:
    from bench.workloads.drain import DrainWorkload
    from bench.workloads.pickup import PickupWorkload
    from bench.workloads.transitions import TransitionsWorkload

    return [TransitionsWorkload(), DrainWorkload(), PickupWorkload()]
