"""Workload 8: reconciler freshness at scale: 10,000 live instances, observe 20 ms, 1, 2 and 4 processes;
and 1 process with the databases' metrics sampled (what the sampling costs the passes)."""

from __future__ import annotations

import asyncio
import os
import statistics
import time

from bench.core import Context, Metric, Target, Workload
from bench.seed import ready_instances
from reconciler.leader import SHARD_LOCK_CLASS

MAX_AGE = Metric("max_age_s", "oldest observation age max s", "s", 1)
P50_AGE = Metric("p50_age_s", "oldest observation age p50 s", "s", 1)
OBSERVE_LATENCY_S = 0.02
CONCURRENCY = 10
PROCESSES = {"1 process": 1, "2 processes": 2, "4 processes": 4, "1 process, sampled": 1}
# The variants whose observations report database metrics, which the reconciler then samples.
SAMPLED = frozenset({"1 process, sampled"})


class FreshnessWorkload(Workload):
    def __init__(self) -> None:
        super().__init__(
            key="freshness",
            title="8. Reconciler freshness (10,000 live instances)",
            variants=tuple(PROCESSES),
            metrics={variant: (P50_AGE, MAX_AGE) for variant in PROCESSES},
            targets=(
                Target("max age s, 2 processes", ("2 processes", MAX_AGE.key), None, "<=", 30.0),
                # Near-linear gain: the oldest age shrinks with the processes sharing the instances.
                Target(
                    "p50 age 1 / 2 processes",
                    ("1 process", P50_AGE.key),
                    ("2 processes", P50_AGE.key),
                    ">=",
                    1.8,
                ),
                Target(
                    "p50 age 1 / 4 processes",
                    ("1 process", P50_AGE.key),
                    ("4 processes", P50_AGE.key),
                    ">=",
                    3.0,
                ),
                # The metrics' sampling keeps freshness within 10 % (one process: the most per pass).
                Target(
                    "p50 age sampled / not, 1 process",
                    ("1 process, sampled", P50_AGE.key),
                    ("1 process", P50_AGE.key),
                    "<=",
                    1.10,
                ),
            ),
        )
        self.live = 0
        self.seconds = 0.0
        self.database: tuple[str, str] | None = None

    def prepare(self, ctx: Context) -> None:
        self.live = ctx.size(10_000, 1_000)
        self.seconds = ctx.size(20.0, 8.0)
        name, url = ctx.fresh_database("w8")
        self.database = (name, url)
        started = time.monotonic()
        asyncio.run(ready_instances(url, self.live))
        ctx.log(f"  made {self.live:,} ready instances in {time.monotonic() - started:.0f} s")
        self.notes = [
            f"{self.live:,} ready instances (made by the product's paths), the noop provisioner with an "
            f"observe latency of {OBSERVE_LATENCY_S * 1000:g} ms (`noop_observe_latency_s`), "
            f"`controlplane reconcile` processes at reconcile_concurrency {CONCURRENCY} each, the "
            "other reconciler settings at their defaults (batch 100, 16 shards).",
            "Per variant: every instance marked just reconciled, the processes started, one full "
            "cycle (every instance reconciled since the start) as warm-up, then the oldest observation "
            f"age (now() - min(last_reconciled_at)) sampled every 0.5 s for {self.seconds:g} s: p50 and "
            "max of the samples. The gain targets are ratios of the p50 ages (1 process over 2 and 4).",
            "1 process, sampled: the same with `noop_observe_stats` on, so that every observation "
            "reports a database's metrics and each pass records them (one batched INSERT of its "
            "instances, at most one row per instance per 10 s), as with real servers; the sampling "
            "target is the ratio of its p50 age to the unsampled one's.",
        ]

    def run(self, ctx: Context, variant: str, repetition: int) -> dict[str, float]:
        assert self.database is not None
        url = self.database[1]
        asyncio.run(_execute(url, "UPDATE instances SET last_reconciled_at = now()"))
        asyncio.run(_execute(url, "DELETE FROM instance_metrics"))
        env = {
            **os.environ,
            "CONTROLPLANE_PROVISIONER": "noop",
            "CONTROLPLANE_NOOP_OBSERVE_LATENCY_S": str(OBSERVE_LATENCY_S),
            "CONTROLPLANE_RECONCILE_CONCURRENCY": str(CONCURRENCY),
            "CONTROLPLANE_NOOP_OBSERVE_STATS": "true" if variant in SAMPLED else "false",
            "CONTROLPLANE_LOG_LEVEL": "WARNING",
        }
        procs = []
        try:
            for n in range(PROCESSES[variant]):
                argv = [ctx.project_python, "-m", "controlplane.cli", "reconcile", "--database-url", url]
                argv += ["--data-dir", str(ctx.work_dir / f"w8-{n}")]
                tag = variant.split()[0] + ("s" if variant in SAMPLED else "")
                procs.append(ctx.procs.start(argv, name=f"w8-{tag}-{n}", env=env))
            figures = asyncio.run(_measure(url, self.seconds, PROCESSES[variant]))
            sampled = asyncio.run(
                _count(url, "SELECT count(DISTINCT instance_id) AS n FROM instance_metrics")
            )
            if (sampled > 0) != (variant in SAMPLED):
                raise RuntimeError(f"{variant}: {sampled} instances sampled")
            return figures
        finally:
            for proc in procs:
                ctx.procs.stop(proc)

    def finish(self, ctx: Context) -> None:
        if self.database is not None:
            ctx.cluster.drop_database(self.database[0])


async def _execute(url: str, statement: str) -> None:
    from controlplane.db import connection as db

    conn = await db.connect(url)
    async with conn:
        await conn.execute(statement)


async def _count(url: str, query: str) -> int:
    from controlplane.db import connection as db

    conn = await db.connect(url)
    async with conn:
        cursor = await conn.execute(query)
        row = await cursor.fetchone()
        assert row is not None
        return int(row["n"])


async def _measure(url: str, seconds: float, processes: int) -> dict[str, float]:
    from controlplane.db import connection as db

    conn = await db.connect(url)
    async with conn:
        cursor = await conn.execute("SELECT now() AS t")
        row = await cursor.fetchone()
        assert row is not None
        began = row["t"]
        deadline = time.monotonic() + 600
        while True:  # warm-up: the shards shared out among the processes ...
            cursor = await conn.execute(
                "SELECT count(DISTINCT pid) AS n FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND classid = %s::oid AND objsubid = 2",
                (SHARD_LOCK_CLASS,),
            )
            row = await cursor.fetchone()
            if row is not None and row["n"] == processes:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the shards were not shared by {processes} processes in 600 s")
            await asyncio.sleep(0.2)
        cursor = await conn.execute("SELECT now() AS t")
        row = await cursor.fetchone()
        assert row is not None
        began = row["t"]
        while True:  # ... then one full cycle
            cursor = await conn.execute(
                "SELECT count(*) AS n FROM instances WHERE last_reconciled_at <= %s", (began,)
            )
            row = await cursor.fetchone()
            if row is not None and row["n"] == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{row and row['n']} instances never reconciled in 600 s")
            await asyncio.sleep(0.5)
        ages: list[float] = []
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            cursor = await conn.execute(
                "SELECT extract(epoch FROM now() - min(last_reconciled_at))::float8 AS age FROM instances"
            )
            row = await cursor.fetchone()
            assert row is not None
            ages.append(float(row["age"]))
            await asyncio.sleep(0.5)
    return {
        P50_AGE.key: statistics.median(ages),
        MAX_AGE.key: max(ages),
    }
