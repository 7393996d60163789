"""Workload 2: queue drain of no-op jobs through the whole lifecycle; ours, pgqueuer, procrastinate."""

from __future__ import annotations

from bench.core import Context, Metric, Target, Workload
from bench.workloads import peers

JOBS_S = Metric("jobs_per_s", "jobs/s", "1/s")
CONCURRENCY = 10


class DrainWorkload(Workload):
    def __init__(self) -> None:
        super().__init__(
            key="drain",
            title="2. Queue drain (concurrency 10)",
            variants=("ours", "pgqueuer", "procrastinate"),
            metrics={v: (JOBS_S,) for v in ("ours", "pgqueuer", "procrastinate")},
            targets=(
                Target("ours/pgqueuer", ("ours", JOBS_S.key), ("pgqueuer", JOBS_S.key), ">=", 1.0),
                Target("ours/procrastinate", ("ours", JOBS_S.key), ("procrastinate", JOBS_S.key), ">=", 10.0),
            ),
        )
        self.jobs = 0

    def prepare(self, ctx: Context) -> None:
        self.jobs = ctx.size(20_000, 2_000)
        self.notes = [
            f"{self.jobs:,} no-op jobs enqueued first (not timed), then drained; each variant in a fresh "
            "database of the same cluster, timed from worker start to the last completion.",
            "Ours: controlplane.worker.Worker at worker_concurrency 10 (claim, start, finish, each a "
            "transition with its job_events row; 4 event rows per job).",
            "pgqueuer 1.6.0: one QueueManager, asyncpg, batch_size 10, durable tables (its default); "
            "it buffers completions (status log rows flushed in batches) and deletes finished jobs.",
            "procrastinate 3.10.0: one worker, concurrency 10, psycopg pool; finished jobs are kept.",
        ]

    def run(self, ctx: Context, variant: str, repetition: int) -> dict[str, float]:
        if variant == "ours":
            name, url = ctx.fresh_database("w2_ours")
            argv = [ctx.project_python, "-m", "bench.drivers.queue", "drain", "--url", url]
            argv += ["--jobs", str(self.jobs), "--concurrency", str(CONCURRENCY)]
        elif variant == "pgqueuer":
            name, url = peers.fresh(ctx, "pgqueuer")
            argv = [*peers.driver(ctx, "pgqueuer"), "drain", "--dsn", url, "--jobs", str(self.jobs)]
            argv += ["--batch-size", "10"]
        else:
            name, url = peers.fresh(ctx, "procrastinate")
            argv = [*peers.driver(ctx, "procrastinate"), "drain", "--dsn", url, "--jobs", str(self.jobs)]
            argv += ["--concurrency", str(CONCURRENCY)]
        try:
            ctx.cluster.checkpoint()
            result = ctx.procs.run_json(argv, name=f"w2-{variant}", timeout=900)
        finally:
            ctx.cluster.drop_database(name)
        executed = result.get("completed", result.get("executed"))
        if executed != self.jobs:
            raise RuntimeError(f"{variant} finished {executed} of {self.jobs} jobs: {result}")
        return {JOBS_S.key: float(result["jobs_per_s"])}
