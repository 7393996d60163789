"""Workload 9: the queue under MVCC pressure (a snapshot held open), and the claim beside 10 million
finished jobs."""

from __future__ import annotations

import math
import threading
import time

import psycopg

from bench.bulk import load_terminal_jobs
from bench.core import Context, Metric, Target, Workload, cpu_shares, cpu_times, percentile

WORST_P99 = Metric("worst_minute_p99_ms", "pickup p99 ms, worst minute", "ms", 2)
P99 = Metric("p99_ms", "pickup p99 ms, whole run", "ms", 2)
DEAD = Metric("dead_tuples", "dead tuples of jobs at the end", "")
CLAIM_P50 = Metric("claim_p50_ms", "claim and start p50 ms", "ms", 3)
CLAIM_P99 = Metric("claim_p99_ms", "claim and start p99 ms", "ms", 3)
RATE = 200.0
CLAIMS = 500
SMALL, LARGE = 10_000, 10_000_000


class MinuteCpu:
    """The machine's CPU each minute of a run, from /proc/stat: the share busy, and the shares the
    hypervisor took (steal) and that waited on I/O (iowait): the machine's moment, beside what
    the run measured in the same minute."""

    def __init__(self) -> None:
        self.minutes: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="mvcc-cpu", daemon=True)

    def __enter__(self) -> MinuteCpu:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        before = cpu_times()
        while before is not None:
            stopped = self._stop.wait(60.0)
            now = cpu_times()
            if now is None:
                return
            self.minutes.append(cpu_shares(before, now))
            before = now
            if stopped:
                return

    def text(self) -> str:
        return ", ".join(f"{m['busy']:.0f}/{m['steal']:.0f}/{m['iowait']:.0f}" for m in self.minutes)


class MvccWorkload(Workload):
    def __init__(self) -> None:
        super().__init__(
            key="mvcc",
            title="9. MVCC pressure and table size",
            variants=("snapshot held", "claim 10k", "claim 10M"),
            metrics={
                "snapshot held": (WORST_P99, P99, DEAD),
                "claim 10k": (CLAIM_P50, CLAIM_P99),
                "claim 10M": (CLAIM_P50, CLAIM_P99),
            },
            targets=(
                Target("worst minute pickup p99 ms", ("snapshot held", WORST_P99.key), None, "<=", 50.0),
                Target(
                    "claim p50 10M / 10k",
                    ("claim 10M", CLAIM_P50.key),
                    ("claim 10k", CLAIM_P50.key),
                    "<=",
                    1.5,
                ),
            ),
            once=("snapshot held",),
        )
        self.minutes = 0.0
        self.sizes: dict[str, int] = {}
        self.databases: dict[str, tuple[str, str]] = {}
        self.per_minute: list[list[float]] = []
        self.cpu_per_minute: list[str] = []

    def prepare(self, ctx: Context) -> None:
        self.minutes = ctx.mvcc_minutes
        self.sizes = {"claim 10k": SMALL, "claim 10M": ctx.size(LARGE, 1_000_000)}
        for variant, count in self.sizes.items():
            name, url = ctx.fresh_database("w9_" + variant.split()[1].lower())
            self.databases[variant] = (name, url)
            started = time.monotonic()
            load_terminal_jobs(url, count)
            ctx.log(f"  loaded {count:,} completed jobs in {time.monotonic() - started:.0f} s")
        self.notes = [
            f"snapshot held: the pickup workload's producer and worker (200 jobs/s, one enqueue "
            f"statement each, Worker at concurrency 10) for {self.minutes:g} minutes (`--mvcc-minutes`; "
            "in the first repetition only) "
            "while another session keeps a REPEATABLE READ transaction open with its snapshot taken "
            "(the xmin horizon pinned: no dead row of jobs can be removed). Pickup latency as in "
            "workload 3; p99 for each minute of enqueue time, the worst minute reported; the dead "
            "tuples of jobs (pg_stat_user_tables.n_dead_tup) at the end, before the snapshot is released.",
            f"claim 10k / 10M: {self.sizes['claim 10k']:,} and {self.sizes['claim 10M']:,} completed "
            "jobs bulk-loaded (one INSERT ... SELECT generate_series, indexes built after, ANALYZE), "
            f"then {CLAIMS} times: enqueue one job, time the worker's claim-and-start statement "
            "(cp_claim_and_start: one round trip), finish it.",
        ]

    def run(self, ctx: Context, variant: str, repetition: int) -> dict[str, float]:
        if variant == "snapshot held":
            return self._snapshot_held(ctx)
        url = self.databases[variant][1]
        argv = [ctx.project_python, "-m", "bench.drivers.queue", "claim-latency", "--url", url]
        result = ctx.procs.run_json([*argv, "--jobs", str(CLAIMS)], name="w9-claim", timeout=600)
        latencies = result["latencies_ms"]
        return {CLAIM_P50.key: percentile(latencies, 50), CLAIM_P99.key: percentile(latencies, 99)}

    def _snapshot_held(self, ctx: Context) -> dict[str, float]:
        name, url = ctx.fresh_database("w9_snapshot")
        seconds = self.minutes * 60
        holder = psycopg.connect(url)
        try:
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM jobs").fetchone()  # the snapshot is taken
            argv = [ctx.project_python, "-m", "bench.drivers.queue", "pickup", "--url", url]
            argv += ["--rate", str(RATE), "--seconds", str(seconds)]
            with MinuteCpu() as cpu:
                result = ctx.procs.run_json(argv, name="w9-pickup", timeout=seconds + 300)
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SELECT pg_stat_force_next_flush()")
                row = conn.execute(
                    "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'jobs'"
                ).fetchone()
            dead = float(row[0]) if row else float("nan")
        finally:
            holder.rollback()
            holder.close()
            ctx.cluster.drop_database(name)
        if result["started"] != result["enqueued"]:
            raise RuntimeError(f"{result['started']} of {result['enqueued']} jobs started")
        minutes: dict[int, list[float]] = {}
        last = max(0, math.ceil(seconds / 60) - 1)
        for at, latency in zip(result["sent_s"], result["latencies_ms"], strict=True):
            # A job the producer sent after the end, behind schedule, belongs to the last minute.
            minutes.setdefault(min(int(at // 60), last), []).append(latency)
        per_minute = [percentile(values, 99) for _, values in sorted(minutes.items())]
        ctx.log("  pickup p99 per minute (ms): " + ", ".join(f"{v:.1f}" for v in per_minute))
        cpu_text = cpu.text()
        ctx.log("  the machine's CPU per minute, % busy/steal/iowait: " + cpu_text)
        self.per_minute.append(per_minute)
        self.cpu_per_minute.append(cpu_text)
        return {
            WORST_P99.key: max(per_minute),
            P99.key: percentile(result["latencies_ms"], 99),
            DEAD.key: dead,
        }

    def finish(self, ctx: Context) -> None:
        for name, _ in self.databases.values():
            ctx.cluster.drop_database(name)
        for n, (values, cpu) in enumerate(zip(self.per_minute, self.cpu_per_minute, strict=True), 1):
            self.notes.append(
                f"snapshot held, repetition {n}: pickup p99 per minute (ms) "
                + ", ".join(f"{v:.1f}" for v in values)
                + f"; the machine's CPU per minute, % busy/steal/iowait (/proc/stat): {cpu}"
            )
