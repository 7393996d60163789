"""The workloads, in the order they run within each repetition."""

from __future__ import annotations

from bench.core import Workload


def all_workloads() -> list[Workload]:
    from bench.workloads.api import ApiWorkload
    from bench.workloads.audit import AuditWorkload
    from bench.workloads.crash import CrashWorkload
    from bench.workloads.drain import DrainWorkload
    from bench.workloads.durability import DurabilityWorkload
    from bench.workloads.failover import FailoverWorkload
    from bench.workloads.freshness import FreshnessWorkload
    from bench.workloads.mvcc import MvccWorkload
    from bench.workloads.pickup import PickupWorkload
    from bench.workloads.reconciler import ReconcilerWorkload
    from bench.workloads.transitions import TransitionsWorkload

    return [
        TransitionsWorkload(),
        DrainWorkload(),
        PickupWorkload(),
        ApiWorkload(),
        ReconcilerWorkload(),
        CrashWorkload(),
        AuditWorkload(),
        FreshnessWorkload(),
        MvccWorkload(),
        DurabilityWorkload(),
        FailoverWorkload(),
    ]
