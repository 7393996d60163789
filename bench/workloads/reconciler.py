"""Workload 5: one reconciler pass with 100 live instances among 10,000 and among 1,000,000 rows."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
import statistics
import time
from pathlib import Path
from typing import Any

from bench.bulk import load_terminal_instances
from bench.core import Context, Metric, NotAvailable, Target, Workload
from bench.seed import ready_instances

PASS_MS = Metric("pass_ms", "pass ms", "ms", 1)
LIVE = 100
# Passes measured per run (after a warm one); the run's figure is their median.
PASSES = 5


def find_reconciler() -> Any:
    """The product's Reconciler class (with run_once(now)), wherever in `reconciler` it lives."""
    import reconciler

    for module_info in pkgutil.iter_modules(reconciler.__path__):
        module = importlib.import_module(f"reconciler.{module_info.name}")
        found = getattr(module, "Reconciler", None)
        if found is not None and hasattr(found, "run_once"):
            return found
    found = getattr(reconciler, "Reconciler", None)
    if found is not None and hasattr(found, "run_once"):
        return found
    raise NotAvailable(
        "the product has no Reconciler with run_once(now) yet (reconciler/ holds planning only)"
    )


class ReconcilerWorkload(Workload):
    def __init__(self) -> None:
        super().__init__(
            key="reconciler",
            title="5. Reconciler scale",
            variants=("small", "large"),
            metrics={"small": (PASS_MS,), "large": (PASS_MS,)},
            targets=(Target("large/small", ("large", PASS_MS.key), ("small", PASS_MS.key), "<=", 1.5),),
            profiled=("small", "large"),
        )
        self.databases: dict[str, tuple[str, str]] = {}
        self.sizes: dict[str, int] = {}

    def prepare(self, ctx: Context) -> None:
        find_reconciler()
        self.sizes = {"small": 10_000, "large": ctx.size(1_000_000, 100_000)}
        self.variants = ("small", "large")
        for variant, total in self.sizes.items():
            name, url = ctx.fresh_database(f"w5_{variant}")
            self.databases[variant] = (name, url)
            started = time.monotonic()
            load_terminal_instances(url, total - LIVE)
            asyncio.run(ready_instances(url, LIVE))
            ctx.log(f"  loaded {total:,} instances ({LIVE} live) in {time.monotonic() - started:.0f} s")
            self._pass(ctx, url)  # warm-up, not measured
        self.notes = [
            f"small = {self.sizes['small']:,} instances, large = {self.sizes['large']:,}; in each, {LIVE} "
            "ready instances made by the product's own paths, and the rest deleted (4 in 5) or failed, "
            "each with one completed provisioning job; bulk-loaded with the tables' triggers disabled "
            "for the load only, with every event row of their legal paths (5 or 2 per instance, 4 per "
            "job), then VACUUM ANALYZE.",
            f"Per repetition and size: the leader's pass, Maintenance.run_once then Reconciler.run_once "
            f"(noop provisioner, batch 100) on a new pool, one warm pass, then the median of {PASSES} "
            "passes. The figure is the pass time; the target is the ratio large/small.",
        ]

    def run(self, ctx: Context, variant: str, repetition: int) -> dict[str, float]:
        url = self.databases[variant][1]
        if ctx.profiler is not None:
            out = ctx.profiler.out_dir / f"reconciler-{variant}-explain.txt"
            out.write_text(asyncio.run(explain_scans(url)))
            ctx.profiler.taken[f"reconciler-{variant}-explain"] = out
        return {PASS_MS.key: self._pass(ctx, url)}

    def _pass(self, ctx: Context, url: str) -> float:
        return asyncio.run(one_pass(url, ctx.work_dir))

    def finish(self, ctx: Context) -> None:
        for name, _ in self.databases.values():
            ctx.cluster.drop_database(name)


async def one_pass(url: str, work_dir: Path) -> float:
    """The leader's pass (its maintenance, then Reconciler.run_once) over the noop provisioner, wired
    as the product's reconcile role wires it (pool, provisioner, the operations' job registry): one
    warm pass, then the median of PASSES."""
    import provisioners
    from controlplane.db import connection as db
    from controlplane.handlers import operations
    from controlplane.runtime.settings import Settings
    from reconciler.maintenance import Maintenance

    reconciler_class = find_reconciler()
    settings = Settings(database_url=url, provisioner="noop", data_dir=work_dir / "reconciler")
    provisioner = provisioners.build(settings)
    pool = db.pool(
        url, min_size=1, max_size=max(2, settings.reconciler.concurrency + 1), name="bench-reconciler"
    )
    await pool.open(wait=True, timeout=30)
    try:
        maintenance = Maintenance(settings, pool, provisioner, operations.registry(provisioner))
        reconciler = reconciler_class(settings, pool, provisioner, maintenance=maintenance)
        await maintenance.run_once()  # warm: prepared statements, pool connections
        await reconciler.run_once()
        times = []
        for _ in range(PASSES):
            started = time.perf_counter()
            await maintenance.run_once()
            summary = await reconciler.run_once()
            times.append(time.perf_counter() - started)
    finally:
        await pool.close()
        await provisioner.close()
    if getattr(summary, "scanned", LIVE) != LIVE:
        raise RuntimeError(f"the pass scanned {summary.scanned} instances, expected {LIVE}")
    return 1000 * statistics.median(times)


async def explain_scans(url: str) -> str:
    """EXPLAIN ANALYZE of the pass's instance scan and live-count query (what should follow live rows)."""
    from psycopg import sql as pgsql

    from controlplane.db import connection as db
    from controlplane.db import sql

    conn = await db.connect(url)
    report: list[str] = []
    async with conn:
        for label, statement, params in (
            (
                "SCAN_LIVE_INSTANCES",
                sql.SCAN_LIVE_INSTANCES,
                {"now": None, "limit": 100, "shards": None, "shard_count": 1},
            ),
            ("COUNT_LIVE_INSTANCES", sql.COUNT_LIVE_INSTANCES, {}),
            ("COUNT_LIVE_JOBS", sql.COUNT_LIVE_JOBS, {}),
        ):
            cursor = await conn.execute(
                pgsql.SQL("EXPLAIN (ANALYZE, BUFFERS) ") + pgsql.SQL(statement),
                params or None,
            )
            report += [f"-- {label}", *[r["QUERY PLAN"] for r in await cursor.fetchall()], ""]
    return "\n".join(report)
