"""Workload 3: pickup latency, enqueue to handler start, at a steady 200 jobs/s; ours against pgqueuer."""

from __future__ import annotations

from bench.core import Context, Metric, Target, Workload, percentile
from bench.workloads import peers

P50 = Metric("p50_ms", "p50 ms", "ms", 2)
P95 = Metric("p95_ms", "p95 ms", "ms", 2)
P99 = Metric("p99_ms", "p99 ms", "ms", 2)
RATE_DONE = Metric("rate", "enqueued/s", "1/s")
TO_CLAIM = Metric("to_claim_p50_ms", "p50 enqueue->claim ms (db clock)", "ms", 2)
TO_START = Metric("to_start_p50_ms", "p50 claim->start ms (db clock)", "ms", 2)
RATE = 200.0


class PickupWorkload(Workload):
    def __init__(self) -> None:
        super().__init__(
            key="pickup",
            title="3. Pickup latency (200 jobs/s)",
            variants=("ours", "pgqueuer"),
            metrics={
                "ours": (P50, P95, P99, RATE_DONE, TO_CLAIM, TO_START),
                "pgqueuer": (P50, P95, P99, RATE_DONE),
            },
            targets=(
                Target("ours p50 ms", ("ours", P50.key), None, "<=", 10.0),
                Target("ours p99 ms", ("ours", P99.key), None, "<=", 50.0),
            ),
            contested=("ours", "pgqueuer"),
        )
        self.seconds = 0.0

    def prepare(self, ctx: Context) -> None:
        self.seconds = ctx.size(20.0, 4.0)
        self.notes = [
            f"A producer enqueues one job every 5 ms for {self.seconds:g} s (one committed statement each, "
            "open loop over 4 connections) in the worker's process; latency is wall clock from just "
            "before the enqueue to the start of the handler, same clock for both.",
            "Ours: Worker at concurrency 10, woken by LISTEN cp_job_queued. pgqueuer: QueueManager, "
            "asyncpg, batch_size 10, woken by its trigger's NOTIFY.",
            "Ours also shows where the time goes, from the job_events timestamps (each the now() of its "
            "statement's transaction): enqueue to claim (commit + NOTIFY + wake-up + claim) and claim to "
            "start (the claim's commit + the start statement).",
        ]

    def run(self, ctx: Context, variant: str, repetition: int) -> dict[str, float]:
        common = ["--rate", str(RATE), "--seconds", str(self.seconds)]
        if variant == "ours":
            name, url = ctx.fresh_database("w3_ours")
            argv = [ctx.project_python, "-m", "bench.drivers.queue", "pickup", "--url", url, *common]
        else:
            name, url = peers.fresh(ctx, "pgqueuer")
            argv = [*peers.driver(ctx, "pgqueuer"), "pickup", "--dsn", url, *common]
        try:
            ctx.cluster.checkpoint()
            result = ctx.procs.run_json(argv, name=f"w3-{variant}", timeout=self.seconds + 120)
        finally:
            ctx.cluster.drop_database(name)
        latencies = result["latencies_ms"]
        if result["started"] != result["enqueued"]:
            raise RuntimeError(f"{variant}: {result['started']} of {result['enqueued']} jobs started")
        if result["producer_fell_behind"]:
            ctx.log(f"  {variant}: the producer fell behind schedule {result['producer_fell_behind']} times")
        phases = {}
        if "to_claim_ms" in result:
            phases = {
                TO_CLAIM.key: percentile(result["to_claim_ms"], 50),
                TO_START.key: percentile(result["to_start_ms"], 50),
            }
        return {
            **phases,
            P50.key: percentile(latencies, 50),
            P95.key: percentile(latencies, 95),
            P99.key: percentile(latencies, 99),
            RATE_DONE.key: result["enqueued"] / result["produce_seconds"],
        }
