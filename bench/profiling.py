"""Profiles of the project's processes (py-spy, sampling), taken in a separate pass after the measured ones.

Each profile is kept raw (collapsed stacks) and summarised: the functions where the samples were
taken (self) and the project functions that were on the stack (inclusive). Beside them, the
server's view of the same runs: pg_stat_statements of the run's database, per statement, per
unit of work (job, transition), one section per variant in one file per workload.
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from bench.procs import Processes

# Per statement of the run's database: top-level or nested (run inside a function), calls, total
# and mean time on the server's clock (execution, planning apart), rows, shared buffers touched.
STATEMENTS = """
SELECT toplevel, calls, total_exec_time AS total_ms, mean_exec_time AS mean_ms,
       total_plan_time AS plan_ms, rows,
       shared_blks_hit + shared_blks_read + shared_blks_dirtied + shared_blks_written AS buffers,
       wal_bytes, query
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY total_exec_time DESC
"""


@dataclass
class Profiler:
    py_spy: str
    out_dir: Path
    procs: Processes
    taken: dict[str, Path] = field(default_factory=dict)
    _running: list[tuple[str, subprocess.Popen[str], Path]] = field(default_factory=list)

    def attach(self, pid: int, label: str, seconds: float | None = None) -> None:
        """Sample `pid` (and its threads) until it exits or for `seconds`."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        raw = self.out_dir / f"{label}.collapsed.txt"
        argv = [
            self.py_spy,
            "record",
            "--nonblocking",
            "-r",
            "200",
            "-f",
            "raw",
            "-o",
            str(raw),
            "-p",
            str(pid),
        ]
        if seconds:
            argv += ["-d", str(max(1, int(seconds)))]
        proc = self.procs.start(argv, name=f"py-spy-{label}")
        self._running.append((label, proc, raw))

    def statements_begin(self, url: str) -> None:
        """Start counting the statements of `url`'s database (pg_stat_statements, preloaded)."""
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")

    def statements_end(self, url: str, workload: str, variant: str, units: float, unit: str) -> None:
        """Append `variant`'s statements to `<workload>-statements.txt`, per `unit` of work done."""
        with psycopg.connect(url, autocommit=True) as conn:
            rows = conn.execute(STATEMENTS).fetchall()
        units = max(units, 1.0)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        out = self.out_dir / f"{workload}-statements.txt"
        top = [r for r in rows if r[0]]
        lines = [
            f"== {variant}: {units:,.0f} {unit}s, taken {time.strftime('%H:%M:%S')}",
            f"top-level statements: {sum(r[1] for r in top) / units:.3f} calls per {unit}, "
            f"{1000 * sum(r[2] for r in top) / units:.1f} us server execution time per {unit}, "
            f"{float(sum(r[7] for r in top)) / units:,.0f} WAL bytes per {unit}",
            f"{'level':6} {'calls/' + unit:>11} {'us/' + unit:>9} {'mean ms':>8} {'plan ms':>8} "
            f"{'rows/call':>9} {'bufs/call':>9} {'WAL B/' + unit:>10}  statement",
        ]
        for toplevel, calls, total_ms, mean_ms, plan_ms, n_rows, buffers, wal, query in rows[:30]:
            text = " ".join(str(query).split())
            lines.append(
                f"{'top' if toplevel else 'nested':6} {calls / units:11.3f} {1000 * total_ms / units:9.1f} "
                f"{mean_ms:8.3f} {plan_ms:8.1f} {n_rows / max(calls, 1):9.1f} "
                f"{buffers / max(calls, 1):9.1f} {float(wal) / units:10.0f}  {text[:160]}"
            )
        with out.open("a") as handle:
            handle.write("\n".join(lines) + "\n\n")
        self.taken[f"{workload}-statements"] = out

    def collect(self, timeout: float = 60) -> None:
        for label, proc, raw in self._running:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.procs.stop(proc)
            if raw.exists():
                summary = self.out_dir / f"{label}.summary.txt"
                summary.write_text(summarise(raw))
                self.taken[label] = summary
        self._running.clear()


def summarise(raw: Path, top: int = 25) -> str:
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [
            f for f in stack.split(";") if f and not f.startswith("process ") and not f.startswith("thread ")
        ]
        if not frames:
            continue
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if not total:
        return "no samples\n"
    lines = [f"{total} samples", "", "self (where the samples were taken):"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in self_counts.most_common(top)]
    lines += ["", "inclusive, the project's and the bench's own functions:"]
    ours = [(f, n) for f, n in inclusive.most_common() if "controlplane/" in f or "bench/" in f]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in ours[:top]]
    lines += ["", "inclusive, libraries (psycopg, fastapi, starlette, pydantic, asyncio):"]
    libs = [
        (f, n)
        for f, n in inclusive.most_common()
        if any(
            k in f
            for k in ("psycopg", "fastapi", "starlette", "pydantic", "asyncio", "uvicorn", "prometheus")
        )
    ]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in libs[:top]]
    return "\n".join(lines) + "\n"
