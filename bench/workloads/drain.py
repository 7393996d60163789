"""Workload 2: queue drain of no-op jobs through the whole lifecycle; ours, pgqueuer, procrastinate."""

from __future__ import annotations

from bench.core import Context, Metric, Target, Workload
from bench.workloads import peers

JOBS_S = Metric("jobs_per_s", "jobs/s", "1/s")
CLAIM_BATCH = Metric("claim_batch", "mean claim batch (jobs/statement)", "", 1)
FINISH_BATCH = Metric("finish_batch", "mean finish batch (jobs/statement)", "", 1)
COMMITS = Metric("commits_per_job", "write transactions (commits) per job", "", 2)
WAL = Metric("wal_bytes_per_job", "WAL bytes per job", "B")
PER_CORE = Metric("jobs_per_cpu_s", "jobs/s per core (jobs per CPU second, client + server)", "1/s")
CLIENT_CPU = Metric("client_cpu_us_per_job", "client CPU us/job (the driver process)", "us", 1)
SERVER_CPU = Metric("server_cpu_us_per_job", "server CPU us/job (every PostgreSQL process)", "us", 1)
COST = (COMMITS, WAL, PER_CORE, CLIENT_CPU, SERVER_CPU)
CONCURRENCY = 10


class DrainWorkload(Workload):
    def __init__(self) -> None:
        super().__init__(
            key="drain",
            title="2. Queue drain (concurrency 10)",
            variants=("ours", "pgqueuer", "procrastinate"),
            metrics={
                "ours": (JOBS_S, CLAIM_BATCH, FINISH_BATCH, *COST),
                "pgqueuer": (JOBS_S, *COST),
                "procrastinate": (JOBS_S, *COST),
            },
            targets=(
                Target("ours/pgqueuer", ("ours", JOBS_S.key), ("pgqueuer", JOBS_S.key), ">=", 1.0),
                Target("ours/procrastinate", ("ours", JOBS_S.key), ("procrastinate", JOBS_S.key), ">=", 10.0),
            ),
            # pgqueuer's too: its statements beside ours (the enqueue of the jobs included in both).
            profiled=("ours", "pgqueuer"),
            contested=("ours", "pgqueuer"),
        )
        self.jobs = 0
        self.procrastinate_jobs = 0

    def prepare(self, ctx: Context) -> None:
        self.jobs = ctx.size(20_000, 2_000)
        # procrastinate drains at a tenth of the others' pace: a quarter of the jobs keeps its three
        # repetitions within the bench's time (its table of kept jobs is then smaller, if anything
        # in its favour).
        self.procrastinate_jobs = ctx.size(5_000, 500)
        self.notes = [
            f"{self.jobs:,} no-op jobs enqueued first (not timed), then drained; each variant in a fresh "
            "database of the same cluster, timed from worker start to the last completion.",
            "Ours: controlplane.queue.worker.Worker at worker_concurrency 10 (claim, start, finish, each a "
            "transition with its job_events row; 4 event rows per job).",
            "pgqueuer 1.6.0: one QueueManager, asyncpg, batch_size 10, durable tables (its default); "
            "it buffers completions (status log rows flushed in batches) and deletes finished jobs.",
            f"procrastinate 3.10.0: one worker, concurrency 10, psycopg pool; finished jobs are kept; "
            f"{self.procrastinate_jobs:,} jobs (it drains about a tenth as fast as the others).",
            "Cost per job, measured by each driver around its timed phase (`bench/peers/cost.py`): write "
            "transactions (transaction ids taken: each commit is an fsync), WAL bytes "
            "(pg_current_wal_lsn before and after), and jobs per CPU second of the driver process and "
            "the database server together (/proc): jobs/s per core; and the two apart per job: client CPU "
            "(the driver process's own, time.process_time) and server CPU (utime + stime of the postmaster "
            "and all its children, live and reaped, from /proc: every backend, the WAL writer, the "
            "checkpointer, autovacuum; the cluster serves only the measured drain meanwhile).",
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
            argv = [*peers.driver(ctx, "procrastinate"), "drain", "--dsn", url]
            argv += ["--jobs", str(self.procrastinate_jobs)]
            argv += ["--concurrency", str(CONCURRENCY)]
        try:
            ctx.cluster.checkpoint()
            if ctx.profiler is not None:
                ctx.profiler.statements_begin(url)
            proc = ctx.procs.start(argv, name=f"w2-{variant}")
            if ctx.profiler is not None:
                ctx.profiler.attach(proc.pid, f"drain-{variant}-driver")
            result = ctx.procs.wait_json(proc, timeout=900)
            if ctx.profiler is not None:
                done = float(result.get("completed", result.get("executed")) or 0)
                ctx.profiler.statements_end(url, "drain", variant, done, "job")
                if variant == "ours":
                    explain_queue(ctx, url)
        finally:
            ctx.cluster.drop_database(name)
        executed = result.get("completed", result.get("executed"))
        expected = self.procrastinate_jobs if variant == "procrastinate" else self.jobs
        if result.get("stalled") or executed != expected:
            raise RuntimeError(
                f"{variant} completed {executed} of {expected} jobs and then stalled "
                f"(job states {result.get('states')}, worker counts {result.get('counts')})"
            )
        values = {JOBS_S.key: float(result["jobs_per_s"])}
        values.update({metric.key: float(result["cost"][metric.key]) for metric in COST})
        if "batches" in result:
            values[CLAIM_BATCH.key] = float(result["batches"].get("claim", 0.0))
            values[FINISH_BATCH.key] = float(result["batches"].get("finish", 0.0))
        return values


def explain_queue(ctx: Context, url: str) -> None:
    """EXPLAIN ANALYZE of the claim and of a 10-job start, with 1,000 jobs queued (rolled back)."""
    import asyncio

    assert ctx.profiler is not None
    out = ctx.profiler.out_dir / "drain-ours-explain.txt"
    out.write_text(asyncio.run(_explain(url)))
    ctx.profiler.taken["drain-ours-explain"] = out


async def _explain(url: str) -> str:
    from psycopg import sql as pgsql

    from controlplane.db import connection as db
    from controlplane.db import sql
    from controlplane.db.job_rows import NewJob, enqueue_many
    from controlplane.db.transitions import Actor, Move, _params

    actor = Actor("system", "bench")
    conn = await db.connect(url)
    report: list[str] = []
    async with conn, conn.transaction(force_rollback=True):
        await enqueue_many(conn, [NewJob("bench_noop") for _ in range(1000)], actor)
        await conn.execute("ANALYZE jobs")
        claim_params = {
            "kinds": ["bench_noop"],
            "limit": 10,
            "worker": "explain",
            "actor_kind": "worker",
            "actor_id": "explain",
            "request_id": None,
        }
        cursor = await conn.execute(
            pgsql.SQL("EXPLAIN (ANALYZE, BUFFERS) ") + pgsql.SQL(sql.CLAIM_JOBS),
            claim_params,
        )
        report += [
            "-- CLAIM_JOBS (limit 10, 1,000 queued)",
            *[r["QUERY PLAN"] for r in await cursor.fetchall()],
        ]
        cursor = await conn.execute(sql.CLAIM_JOBS, {**claim_params, "worker": "explain2"})
        claimed = await cursor.fetchall()
        moves = [Move(r["id"], "claimed", r["state_version"], "start") for r in claimed]
        cursor = await conn.execute(
            pgsql.SQL("EXPLAIN (ANALYZE, BUFFERS) ") + pgsql.SQL(sql.TRANSITION["job"]),
            _params("job", moves, actor, None),
        )
        report += [
            "",
            "-- TRANSITION job: start of 10 claimed jobs",
            *[r["QUERY PLAN"] for r in await cursor.fetchall()],
        ]
    return "\n".join(report) + "\n"
