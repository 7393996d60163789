"""Workload 11: high availability of a local instance at product defaults: the failover after a
SIGKILL of the primary (RTO, RPO), an SRE's switchover (the write pause, rows lost), and the cost of
synchronous replication (commits/s through an HA plan's pooled endpoint as a ratio to one server)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from bench.core import Context, Metric, NotAvailable, Target, Workload

RTO = Metric("rto_s", "longest pause between acknowledged writes, SIGKILL of the primary s", "s", 1)
RPO = Metric("rpo_rows_lost", "acknowledged rows missing after the failover", "")
ACKED = Metric("failover_rows_acked", "rows acknowledged around the failover", "")
PAUSE = Metric("switchover_pause_s", "longest pause between acknowledged writes, switchover s", "s", 2)
SWITCH_LOST = Metric("switchover_rows_lost", "acknowledged rows missing after the switchover", "")
HA_RATE = Metric("commits_ha_per_s", "commits/s, 1 client, HA plan through its pooler", "/s")
SINGLE_RATE = Metric("commits_single_per_s", "commits/s, 1 client, one server", "/s")


class FailoverWorkload(Workload):
    def __init__(self) -> None:
        super().__init__(
            key="failover",
            title="11. High availability (failover RTO/RPO, switchover, synchronous commits)",
            variants=("ha", "single"),
            metrics={"ha": (RTO, RPO, ACKED, PAUSE, SWITCH_LOST, HA_RATE), "single": (SINGLE_RATE,)},
            targets=(
                Target("RTO after SIGKILL of the primary (s)", ("ha", RTO.key), None, "<=", 10.0),
                Target("acknowledged rows lost in a failover", ("ha", RPO.key), None, "<=", 0),
                Target("writes refused in a switchover (s)", ("ha", PAUSE.key), None, "<=", 2.0),
                Target("acknowledged rows lost in a switchover", ("ha", SWITCH_LOST.key), None, "<=", 0),
                Target(
                    "synchronous commits vs one server",
                    ("ha", HA_RATE.key),
                    ("single", SINGLE_RATE.key),
                    ">=",
                    0.5,
                ),
            ),
        )
        self.sample: dict[str, float] = {}

    def prepare(self, ctx: Context) -> None:
        for tool in ("pgbackrest", "pgbouncer"):
            if shutil.which(tool) is None:
                raise NotAvailable(f"{tool} is not installed (python3 dev.py bench installs it)")
        self.seconds = ctx.size(20, 5)
        self.notes = [
            "Two local instances through the real worker and reconciler at product defaults (reconciler"
            " interval 5 s): `small` (a primary and a synchronous standby behind PgBouncer, transaction"
            " pooling, TLS) and `dev` (one server).",
            "Commits/s: one client, single-row autocommitted inserts for "
            f"{ctx.size(20, 5)} s, through the HA endpoint, then on the single server.",
            "Failover: sequential single-row commits at 100 rows/s through the pooled endpoint for"
            f" {self.seconds} s, then SIGKILL of the primary's postmaster; the writer retries the same row"
            " on a new session until it is acknowledged (through the pooler, a write mostly waits there"
            " until a primary takes it). RTO: the longest pause between two acknowledgements around the"
            " kill; RPO: acknowledged rows missing once the instance is ready again.",
            "Switchover: the same writer, then an SRE's switchover; the longest gap between two"
            " acknowledgements from the request on, and rows missing afterwards.",
        ]

    def run(self, ctx: Context, variant: str, repetition: int) -> dict[str, float]:
        if variant == "ha":
            name, url = ctx.fresh_database("w11_failover")
            data_dir = Path(tempfile.mkdtemp(prefix=f"cp-bench-w11-{repetition}-"))
            os.chmod(data_dir, 0o755)  # the servers' user must traverse it
            try:
                self.sample = ctx.procs.run_json(
                    [
                        ctx.project_python,
                        "-m",
                        "bench.drivers.failover",
                        "--url",
                        url,
                        "--data-dir",
                        str(data_dir),
                        "--seconds",
                        str(self.seconds),
                        "--commit-seconds",
                        str(ctx.size(20, 5)),
                    ],
                    name="w11-failover",
                    timeout=1800,
                )
            finally:
                ctx.cluster.drop_database(name)
                shutil.rmtree(data_dir, ignore_errors=True)
            return {m.key: float(self.sample[m.key]) for m in self.metrics["ha"]}
        return {SINGLE_RATE.key: float(self.sample[SINGLE_RATE.key])}
