"""Workload 6: crash recovery; kill -9 one of two workers mid-run, time until its jobs complete elsewhere."""

from __future__ import annotations

import signal
import subprocess
import time
from typing import Any

import psycopg

from bench.core import Context, Metric, Workload
from bench.procs import wait_for

RECOVERY = Metric("recovery_s", "recovery s (kill to last orphan done)", "s", 1)
ORPHANS = Metric("orphans", "jobs held by the killed worker", "")
DUPLICATES = Metric("duplicates", "jobs completed twice", "")
LOST = Metric("not_completed", "jobs not completed", "")
TOTAL = Metric("total_s", "all jobs done s", "s", 1)
RECLAIMED = Metric("reclaimed_s", "kill to last orphan reclaimed s", "s", 1)
REQUEUED = Metric("requeued_wait_s", "longest orphan wait reclaimed->claimed s", "s", 1)
CONCURRENCY = 10
JOB_SECONDS = 2.0
WORKERS = ("bench-a", "bench-b")


class CrashWorkload(Workload):
    def __init__(self) -> None:
        super().__init__(
            key="crash",
            title="6. Crash recovery",
            variants=("ours",),
            metrics={"ours": (RECOVERY, RECLAIMED, REQUEUED, ORPHANS, DUPLICATES, LOST, TOTAL)},
        )
        self.jobs = 0

    def prepare(self, ctx: Context) -> None:
        self.jobs = ctx.size(200, 80)
        self.notes = [
            f"{self.jobs} jobs of {JOB_SECONDS:g} s on 2 worker processes (the worker role, concurrency "
            f"{CONCURRENCY} each) and one supervisor process (Supervisor.run, product defaults: heartbeat "
            "every 2 s, reclaim after 5 missed intervals = 10 s, a pass every 2 s). Worker A is killed "
            "with SIGKILL once a third of the jobs are done.",
            "Recovery: from the kill to the finish event of the last job worker A held (claimed or "
            "running at the kill), completed by worker B. Duplicates: jobs with more than one finish "
            "event (must be 0). The floor is the reclaim delay plus one job's run time; the phases come "
            "from the job_events timestamps (the reclaim by the supervisor, then the next claim).",
        ]

    def run(self, ctx: Context, variant: str, repetition: int) -> dict[str, float]:
        name, url = ctx.fresh_database("w6_ours")
        base = [ctx.project_python, "-m", "bench.drivers.queue"]
        common = ["--url", url, "--concurrency", str(CONCURRENCY)]
        started: list[subprocess.Popen[str]] = []
        try:
            ctx.procs.run_json(
                [
                    *base,
                    "enqueue-sleepers",
                    *common,
                    "--jobs",
                    str(self.jobs),
                    "--job-seconds",
                    str(JOB_SECONDS),
                ],
                name="w6-enqueue",
                timeout=120,
            )
            t0 = time.time()
            started.append(ctx.procs.start([*base, "supervise", "--url", url], name="w6-supervisor"))
            workers = {
                worker_id: ctx.procs.start(
                    [*base, "worker", *common, "--worker-id", worker_id], name=f"w6-{worker_id}"
                )
                for worker_id in WORKERS
            }
            started += workers.values()
            with psycopg.connect(url, autocommit=True) as conn:
                self._wait(conn, lambda n: n >= self.jobs // 3, timeout=300, what="a third of the jobs done")
                # Kill worker A while it holds jobs (under load it may be slow to start claiming).
                wait_for(
                    lambda: held_by(conn, WORKERS[0]) > 0,
                    timeout=120,
                    interval=0.05,
                    what="worker A to hold jobs",
                )
                victim = workers[WORKERS[0]]
                ctx.procs.kill(victim, signal.SIGKILL)
                victim.wait(timeout=10)
                killed_at = time.time()
                orphans = [
                    row[0]
                    for row in conn.execute(
                        "SELECT id FROM jobs WHERE claimed_by = %s AND state IN ('claimed', 'running')",
                        (WORKERS[0],),
                    ).fetchall()
                ]
                self._wait(
                    conn, lambda n: n >= self.jobs, timeout=300, what="every job done", orphans=orphans
                )
                all_done = time.time()
                last_orphan = conn.execute(
                    "SELECT extract(epoch FROM max(at)) FROM job_events"
                    " WHERE event = 'finish' AND job_id = ANY(%s)",
                    (orphans,),
                ).fetchone()
                duplicates = conn.execute(
                    "SELECT count(*) FROM (SELECT job_id FROM job_events WHERE event = 'finish'"
                    " GROUP BY job_id HAVING count(*) > 1) d"
                ).fetchone()
                completed = conn.execute("SELECT count(*) FROM jobs WHERE state = 'completed'").fetchone()
                phases = conn.execute(
                    """
                    SELECT extract(epoch FROM max(r.at)) AS reclaimed,
                           extract(epoch FROM max(c.at - r.at)) AS requeued
                    FROM job_events r
                    JOIN job_events c ON c.job_id = r.job_id AND c.event = 'claim' AND c.id > r.id
                    WHERE r.event = 'reclaim' AND r.job_id = ANY(%s)
                    """,
                    (orphans,),
                ).fetchone()
        finally:
            for proc in started:
                ctx.procs.stop(proc)
            ctx.cluster.drop_database(name)
        assert last_orphan is not None and duplicates is not None and completed is not None
        if not orphans or last_orphan[0] is None:
            raise RuntimeError("the killed worker held no jobs at the kill: nothing to recover")
        recovery = float(last_orphan[0]) - killed_at
        assert phases is not None
        return {
            RECOVERY.key: recovery,
            RECLAIMED.key: float(phases[0] or killed_at) - killed_at,
            REQUEUED.key: float(phases[1] or 0.0),
            ORPHANS.key: float(len(orphans)),
            DUPLICATES.key: float(duplicates[0]),
            LOST.key: float(self.jobs - completed[0]),
            TOTAL.key: all_done - t0,
        }

    @staticmethod
    def _wait(
        conn: psycopg.Connection[Any],
        done: object,
        *,
        timeout: float,
        what: str,
        orphans: list[object] | None = None,
    ) -> None:
        assert callable(done)
        deadline = time.monotonic() + timeout
        while True:
            row = conn.execute("SELECT count(*) FROM jobs WHERE state = 'completed'").fetchone()
            if row is not None and done(row[0]):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what} ({row[0] if row else '?'} completed)")
            time.sleep(0.1)


def held_by(conn: psycopg.Connection[Any], worker_id: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM jobs WHERE claimed_by = %s AND state IN ('claimed', 'running')", (worker_id,)
    ).fetchone()
    return int(row[0]) if row else 0
