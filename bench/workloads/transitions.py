"""Workload 1: the transition path against PostgreSQL's limit (pgbench on the same statement)."""

from __future__ import annotations

import asyncio
import re
import resource
import subprocess
import time
from pathlib import Path

import psycopg

from bench.core import Context, Metric, Target, Workload
from bench.peers.cost import ServerCpu
from bench.seed import ready_instances
from controlplane.db import sql

CLIENTS = 8
THREADS = 2  # pgbench -j 2; ours likewise runs its 8 clients in 2 processes of 4
TPS = Metric("transitions_per_s", "transitions/s", "1/s")
CPU = Metric("client_cpu_us", "client CPU us/transition", "us", 1)
SERVER_CPU = Metric("server_cpu_us", "server CPU us/transition", "us", 1)


def transition_statement() -> str:
    """The statement `transition()` sends for one move (the single-row form when the product has one)."""
    single: dict[str, str] | None = getattr(sql, "TRANSITION_ONE", None)
    return (single or sql.TRANSITION)["instance"]


def pgbench_script(statement_sql: str) -> str:
    """Two transitions per script run (suspend, then resume) with the product's statement text.

    Parameters become pgbench variables (bound as parameters under -M prepared); where the product
    sends an array, the variable is wrapped in ARRAY[...] (pgbench variables are scalars). The
    version comes from the previous statement's RETURNING via \\gset, so every statement really
    moves a row.
    """
    statement = statement_sql.strip()
    variables = {
        "ids": "inst",
        "versions": "p_state_version",
        "reasons": "reason",
        "details": "detail",
        "patches": "patch",
        "actor_kind": "actor_kind",
        "actor_id": "actor_id",
        "request_id": "request_id",
    }

    def bind(text: str, name: str, variable: str) -> str:
        placeholder = f"%({name})s"
        is_array = re.search(re.escape(placeholder) + r"::\w+\[\]", text) is not None
        return text.replace(placeholder, f"ARRAY[:{variable}]" if is_array else f":{variable}")

    for name, variable in variables.items():
        statement = bind(statement, name, variable)
    moves = []
    for from_state, to_state, event in (("ready", "suspended", "suspend"), ("suspended", "ready", "resume")):
        text = bind(statement, "from_states", from_state)
        text = bind(text, "to_states", to_state)
        moves.append(bind(text, "events", event) + " \\gset p_")
    assert "%(" not in moves[0], "an unhandled placeholder is left in the transition statement"
    init = (
        "\\if :initialised = 0\n"
        "SELECT inst FROM bench_clients WHERE client = :client_id \\gset\n"
        "\\set initialised 1\n"
        "\\endif\n"
    )
    return init + "\n".join(moves) + "\n"


PGBENCH_VARIABLES = {
    "initialised": "0",
    "p_state_version": "2",
    "ready": "ready",
    "suspended": "suspended",
    "suspend": "suspend",
    "resume": "resume",
    "reason": "bench",
    "detail": '{"bench": true}',
    "patch": "{}",
    "actor_kind": "system",
    "actor_id": "bench",
    "request_id": "bench",
}


class TransitionsWorkload(Workload):
    def __init__(self) -> None:
        super().__init__(
            key="transitions",
            title="1. Transition path (8 clients)",
            variants=("ours", "pgbench"),
            metrics={"ours": (TPS, CPU, SERVER_CPU), "pgbench": (TPS, CPU, SERVER_CPU)},
            targets=(Target("ours/pgbench", ("ours", TPS.key), ("pgbench", TPS.key), ">=", 0.9),),
            notes=[
                "Each transition: instance ready->suspended or suspended->ready through "
                "controlplane.db.transitions.transition (guarded UPDATE, version bump, event row, "
                "pg_notify), one statement, autocommit. Ours: 8 connections in 2 processes of 4; "
                "pgbench: the same statement text, -M prepared -c 8 -j 2, two moves per script run.",
                "Client CPU: CPU time of the client processes (ours: the two driver processes; pgbench: "
                "its process) per transition; on 2 cores it is taken from the server's share.",
                "Server CPU: utime + stime of the postmaster and all its children (live and reaped, from "
                "/proc: every backend, WAL writer, checkpointer, autovacuum) from just before the clients "
                "start to just after they exit, per transition; the cluster serves only the measured "
                "clients meanwhile (their connection set-up included, for both variants).",
            ],
            # pgbench too: the server's view of the same statement sent by each.
            profiled=("ours", "pgbench"),
            contested=("ours", "pgbench"),
        )
        self.seconds = 0.0

    def prepare(self, ctx: Context) -> None:
        self.seconds = ctx.size(10.0, 3.0)

    def _seed(self, ctx: Context, prefix: str) -> tuple[str, str, list[str]]:
        name, url = ctx.fresh_database(prefix)
        ids = [str(i) for i in asyncio.run(ready_instances(url, CLIENTS))]
        return name, url, ids

    def run(self, ctx: Context, variant: str, repetition: int) -> dict[str, float]:
        name, url, ids = self._seed(ctx, f"w1_{variant}")
        try:
            ctx.cluster.checkpoint()
            if ctx.profiler is not None:
                ctx.profiler.statements_begin(url)
            server = ServerCpu(url)
            server.begin()
            values = self._ours(ctx, url, ids) if variant == "ours" else self._pgbench(ctx, name, url, ids)
            moved = values.pop("moved")
            values[SERVER_CPU.key] = 1e6 * server.end() / max(moved, 1.0)
            if ctx.profiler is not None:
                ctx.profiler.statements_end(url, "transitions", variant, moved, "transition")
            return values
        finally:
            ctx.cluster.drop_database(name)

    def _ours(self, ctx: Context, url: str, ids: list[str]) -> dict[str, float]:
        start_at = time.time() + 1.5
        per_process = CLIENTS // THREADS
        procs = [
            ctx.procs.start(
                [
                    ctx.project_python,
                    "-m",
                    "bench.drivers.transitions",
                    "--url",
                    url,
                    "--ids",
                    ",".join(ids[n * per_process : (n + 1) * per_process]),
                    "--version",
                    "2",
                    "--start-at",
                    str(start_at),
                    "--seconds",
                    str(self.seconds),
                ],
                name="w1-ours",
            )
            for n in range(THREADS)
        ]
        if ctx.profiler is not None:
            ctx.profiler.attach(procs[0].pid, "transitions-ours-driver")
        results = [ctx.procs.wait_json(p, timeout=self.seconds + 60) for p in procs]
        moved = float(sum(r["transitions"] for r in results))
        cpu = sum(float(r["cpu_s"]) for r in results)
        return {TPS.key: moved / self.seconds, CPU.key: 1e6 * cpu / max(moved, 1.0), "moved": moved}

    def _pgbench(self, ctx: Context, name: str, url: str, ids: list[str]) -> dict[str, float]:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_clients (client int PRIMARY KEY, inst text NOT NULL)")
            with conn.cursor() as cur:
                cur.executemany("INSERT INTO bench_clients VALUES (%s, %s)", list(enumerate(ids)))
        script = ctx.work_dir / "transition.pgbench"
        script.write_text(pgbench_script(transition_statement()))
        argv = [
            ctx.cluster.server.bin("pgbench"),
            "-n",
            "-M",
            "prepared",
            "-c",
            str(CLIENTS),
            "-j",
            str(THREADS),
            "-T",
            str(int(self.seconds)),
            "-f",
            str(script),
        ]
        for key, value in PGBENCH_VARIABLES.items():
            argv += ["-D", f"{key}={value}"]
        argv.append(name)
        env = {**ctx.cluster.env, "PATH": "/usr/bin:/bin"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=self.seconds + 120)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        (ctx.work_dir / "pgbench.out").write_text(result.stdout + result.stderr)
        processed = re.search(r"number of transactions actually processed: (\d+)", result.stdout)
        failed = re.search(r"number of failed transactions: (\d+)", result.stdout)
        if result.returncode != 0 or not processed or (failed and int(failed.group(1))):
            raise RuntimeError(
                f"pgbench failed ({result.returncode}): {Path(script).name}: {result.stderr[-800:]}"
            )
        tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", result.stdout)
        assert tps is not None
        # Two transitions per script run.
        moved = 2 * int(processed.group(1))
        return {TPS.key: 2 * float(tps.group(1)), CPU.key: 1e6 * cpu / max(moved, 1), "moved": float(moved)}
