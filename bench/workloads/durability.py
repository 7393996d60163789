"""Workload 10: durability of a local instance: the archive's lag under 1,000 rows/s, what a removed
data directory loses once restored by itself (RPO), and the restore time of a large database as a
ratio to `pgbackrest restore` alone on the same data."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from bench.core import Context, Metric, NotAvailable, Target, Workload

LAG_RATE = Metric("lag_rows_per_s", "rows/s written (lag phase)", "rows/s")
LAG_P50 = Metric("lag_p50_s", "archive lag p50 s", "s", 1)
LAG_MAX = Metric("lag_max_s", "archive lag max s", "s", 1)
LAG_BYTES = Metric("lag_max_bytes", "WAL not yet archived, max bytes", "B")
ACKED = Metric("rpo_rows_acked", "rows acknowledged before the loss", "")
LOST = Metric("rpo_rows_lost", "of them lost", "")
SECONDS_LOST = Metric("rpo_seconds_lost", "seconds of acknowledged writes lost", "s", 1)
REPORTED = Metric("rpo_seconds_lost_reported", "seconds lost, as the recover event says", "s", 1)
OLD_LOST = Metric("rpo_lost_older_than_archive_timeout", "lost rows older than archive_timeout", "")
LOSS_TO_READY = Metric("rpo_loss_to_ready_s", "loss to ready again s", "s", 1)
DB_BYTES = Metric("restore_db_bytes", "database size", "B")
ALONE = Metric("restore_pgbackrest_s", "pgbackrest restore alone s", "s", 1)
OURS = Metric("restore_ours_s", "data directory removed to ready s", "s", 1)


class DurabilityWorkload(Workload):
    def __init__(self) -> None:
        metrics = (LAG_RATE, LAG_P50, LAG_MAX, LAG_BYTES, ACKED, LOST, SECONDS_LOST, REPORTED, OLD_LOST)
        super().__init__(
            key="durability",
            title="10. Durability (archive lag, RPO, restore time)",
            variants=("ours", "pgbackrest"),
            metrics={"ours": (*metrics, LOSS_TO_READY, DB_BYTES, OURS), "pgbackrest": (ALONE,)},
            targets=(
                Target("lost rows older than archive_timeout", ("ours", OLD_LOST.key), None, "<=", 0),
                Target(
                    "restore time vs pgbackrest restore alone",
                    ("ours", OURS.key),
                    ("pgbackrest", ALONE.key),
                    "<=",
                    3.0,
                ),
            ),
        )
        self.sample: dict[str, float] = {}

    def prepare(self, ctx: Context) -> None:
        if shutil.which("pgbackrest") is None:
            raise NotAvailable("pgBackRest is not installed (python3 dev.py bench installs it)")
        self.archive_timeout_s = ctx.size(60.0, 10.0)
        self.size_mb = ctx.size(1024, 100)
        self.notes = [
            "One local instance (dev plan) through the real worker and reconciler (reconciler interval "
            f"5 s), archive_timeout {self.archive_timeout_s:g} s, pgBackRest 2.45, lz4, encrypted"
            " repository.",
            f"Lag: single-row commits at 1,000 rows/s for {ctx.size(60, 20)} s; the latest restorable "
            "moment's lag behind the observation, sampled every second.",
            f"RPO: single-row commits at 100 rows/s for {ctx.size(150, 40)} s, then the data directory is "
            "removed (rm -rf); the instance restores itself to the end of its archive. Target: no row "
            "committed more than archive_timeout before the loss is lost.",
            f"Restore time: a {self.size_mb} MB table, a backup, then `pgbackrest restore` alone of that "
            "backup into an empty directory, against the data directory removed and the instance "
            "ready again (the loss seen by a pass, the restore job, replay, promotion, the usual steps).",
            "Both restores run once per repetition, in that order; the ratio is ours / pgBackRest alone.",
        ]

    def run(self, ctx: Context, variant: str, repetition: int) -> dict[str, float]:
        if variant == "ours":
            name, url = ctx.fresh_database("w10_durability")
            # The servers' user must traverse it (the work directory is private).
            data_dir = Path(tempfile.mkdtemp(prefix=f"cp-bench-w10-{repetition}-"))
            os.chmod(data_dir, 0o755)
            try:
                self.sample = ctx.procs.run_json(
                    [
                        ctx.project_python,
                        "-m",
                        "bench.drivers.durability",
                        "--url",
                        url,
                        "--data-dir",
                        str(data_dir),
                        "--archive-timeout-s",
                        str(self.archive_timeout_s),
                        "--lag-seconds",
                        str(ctx.size(60, 20)),
                        "--rpo-seconds",
                        str(ctx.size(150, 40)),
                        "--size-mb",
                        str(self.size_mb),
                    ],
                    name="w10-durability",
                    timeout=3600,
                )
            finally:
                ctx.cluster.drop_database(name)
                shutil.rmtree(data_dir, ignore_errors=True)
            return {m.key: float(self.sample[m.key]) for m in self.metrics["ours"]}
        return {ALONE.key: float(self.sample[ALONE.key])}
