"""Workload 7: the audit log at 100,000 and at 10,000,000 events: reading an instance's events
over the API, and `audit verify --since` after a day's worth of moves."""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
import uuid
from typing import Any

import psycopg

from bench.bulk import create_indexes, drop_indexes, load_chains, partitions_since
from bench.core import Context, Metric, Target, Workload, percentile
from bench.workloads.api import at_rate, base_env, start_api

P50 = Metric("get_p50_ms", "GET events p50 ms", "ms", 2)
P99 = Metric("get_p99_ms", "GET events p99 ms", "ms", 2)
ERRORS = Metric("errors", "non-2xx responses", "")
VERIFY = Metric("verify_since_s", "audit verify --since s", "s", 2)
CHECKED = Metric("verify_since_events", "events checked by --since", "")
FULL = Metric("verify_full_s", "audit verify (whole log) s", "s", 2)
# Events per instance: a creation, provisioning, then suspend and resume in turn (a page is 100).
DEPTH = 100
# The history is spread over the last year, so the log spans 13 monthly partitions.
HISTORY_DAYS = 365
RATE = 100.0
CONNECTIONS = 8
# Moves made after the checkpoint that `audit verify --since` starts from: 20 on each of 100 instances.
MOVED_INSTANCES = 100
MOVES_EACH = 20


def history_path() -> tuple[tuple[int, str | None, str, str], ...]:
    path: list[tuple[int, str | None, str, str]] = [
        (0, None, "pending", "create"),
        (1, "pending", "provisioning", "start_provisioning"),
        (2, "provisioning", "ready", "provisioned"),
    ]
    for v in range(3, DEPTH):
        path.append((v, "ready", "suspended", "suspend") if v % 2 else (v, "suspended", "ready", "resume"))
    return tuple(path)


def final_state() -> tuple[str, int]:
    _, _, state, _ = history_path()[-1]
    return state, DEPTH - 1


def load_history(url: str, instances: int) -> tuple[str, list[str]]:
    """`instances` instances of one organisation, each with DEPTH hash-chained events over the last
    year; return the organisation's API key and the instances' ids."""
    from controlplane.services.tenants import create_org

    async def tenant() -> tuple[uuid.UUID, str]:
        from controlplane.db import connection as db

        conn = await db.connect(url)
        async with conn:
            org, key = await create_org(conn, f"bench-audit-{uuid.uuid4().hex[:6]}")
            return org["id"], key.plaintext

    org, key = asyncio.run(tenant())
    state, version = final_state()
    step = f"{HISTORY_DAYS * 86400 / DEPTH:.3f}"
    with psycopg.connect(url) as conn:
        partitions_since(conn, HISTORY_DAYS + 31)
        indexes = drop_indexes(conn, ["instance_events"])
        conn.execute("ALTER TABLE instances DISABLE TRIGGER ALL")
        conn.execute("ALTER TABLE instance_events DISABLE TRIGGER ALL")
        conn.execute(
            """
            INSERT INTO instances (org_id, name, spec, state, state_version, observed_generation,
                                   created_at, updated_at)
            SELECT %(org)s, 'audit-' || g, '{"plan": "dev", "region": "local"}', %(state)s, %(version)s, 1,
                   now() - make_interval(days => %(days)s) + g * interval '1 millisecond', now()
            FROM generate_series(1, %(count)s) g
            """,
            {"org": org, "state": state, "version": version, "days": HISTORY_DAYS, "count": instances},
        )
        load_chains(
            conn,
            "instance",
            f"SELECT id, created_at AS base FROM instances WHERE org_id = '{org}'",
            history_path(),
            f"base + {{v}} * interval '{step} seconds'",
        )
        create_indexes(conn, indexes)
        conn.execute("ALTER TABLE instances ENABLE TRIGGER ALL")
        conn.execute("ALTER TABLE instance_events ENABLE TRIGGER ALL")
        ids = [str(r[0]) for r in conn.execute("SELECT id FROM instances WHERE org_id = %s", (org,))]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) instances")
        conn.execute("VACUUM (ANALYZE) instance_events")
    return key, ids


async def move_some(url: str, ids: list[str]) -> None:
    """MOVES_EACH suspends and resumes of MOVED_INSTANCES instances through the transition path."""
    from controlplane.db import connection as db
    from controlplane.db.transitions import Actor, Move, transition_many

    actor = Actor("system", "bench")
    conn = await db.connect(url)
    async with conn:
        cursor = await conn.execute(
            "SELECT id, state, state_version FROM instances WHERE id = ANY(%s::uuid[])", (ids,)
        )
        rows = {row["id"]: (row["state"], row["state_version"]) for row in await cursor.fetchall()}
        for _ in range(MOVES_EACH):
            moves = [
                Move(i, state, version, "resume" if state == "suspended" else "suspend")
                for i, (state, version) in rows.items()
            ]
            result = await transition_many(conn, "instance", moves, actor)
            if result.failed:
                raise RuntimeError(f"moving instances failed: {result.failed[0]}")
            rows = {row["id"]: (row["state"], row["state_version"]) for row in result.moved}


async def checkpoint(url: str, data_dir: Any) -> float:
    """Record a checkpoint (the first covers the whole log); return how long it took."""
    from controlplane.audit import checkpoints
    from controlplane.db import connection as db
    from controlplane.runtime.secretbox import load_box
    from controlplane.runtime.settings import Settings

    box = load_box(Settings(data_dir=data_dir))
    conn = await db.connect(url)
    async with conn:
        started = time.perf_counter()
        await checkpoints.record(conn, box)
        return time.perf_counter() - started


class AuditWorkload(Workload):
    def __init__(self) -> None:
        super().__init__(
            key="audit",
            title="7. Audit log at scale",
            variants=("small", "large"),
            metrics={
                "small": (P50, P99, ERRORS, VERIFY, CHECKED, FULL),
                "large": (P50, P99, ERRORS, VERIFY, CHECKED),
            },
            targets=(
                Target("large/small GET p99", ("large", P99.key), ("small", P99.key), "<=", 1.5),
                Target("large/small verify --since", ("large", VERIFY.key), ("small", VERIFY.key), "<=", 1.5),
            ),
        )
        self.databases: dict[str, tuple[str, str, str, list[str]]] = {}
        self.sizes: dict[str, int] = {}
        self.seconds = 0.0

    def prepare(self, ctx: Context) -> None:
        self.sizes = {"small": 1_000, "large": ctx.size(100_000, 10_000)}
        self.seconds = ctx.size(10.0, 3.0)
        first_checkpoint: dict[str, float] = {}
        for variant, instances in self.sizes.items():
            name, url = ctx.fresh_database(f"w7_{variant}")
            started = time.monotonic()
            key, ids = load_history(url, instances)
            loaded = time.monotonic() - started
            first_checkpoint[variant] = asyncio.run(checkpoint(url, ctx.work_dir / f"audit-{variant}"))
            # A second, ordinary checkpoint: each run's `--since` starts from one like it.
            asyncio.run(move_some(url, random.sample(ids, MOVED_INSTANCES)))
            asyncio.run(checkpoint(url, ctx.work_dir / f"audit-{variant}"))
            self.databases[variant] = (name, url, key, ids)
            ctx.log(
                f"  loaded {instances * DEPTH:,} events of {instances:,} instances in {loaded:.0f} s; "
                f"first checkpoint {first_checkpoint[variant]:.1f} s"
            )
        small, large = (self.sizes[v] * DEPTH for v in ("small", "large"))
        self.notes = [
            f"small = {small:,} events, large = {large:,}: {DEPTH} events per instance (creation, "
            "provisioning, then suspend and resume in turn), hash-chained as the transition path writes "
            f"them, spread over the last {HISTORY_DAYS} days (13 monthly partitions); bulk-loaded one "
            "chain step at a time for all instances, then VACUUM ANALYZE.",
            f"GET: the product's API (one uvicorn process, as `controlplane serve`) reading the first page "
            f"(100 events) of random instances' logs, open loop at {RATE:g} req/s over {CONNECTIONS} "
            f"keep-alive connections for {self.seconds:g} s; latency from the scheduled send time.",
            f"verify --since: `controlplane audit verify --since N` (a new process, start-up included) "
            f"after {MOVED_INSTANCES * MOVES_EACH:,} moves of {MOVED_INSTANCES} instances made since "
            "checkpoint N: replay and chain check of the events since, and checkpoint N and later. "
            "The whole-log `audit verify` is timed on the small log only.",
            "First checkpoint (all chains' heads, the whole log's count), once: "
            + ", ".join(f"{v} {s:.1f} s" for v, s in first_checkpoint.items())
            + ".",
        ]

    def run(self, ctx: Context, variant: str, repetition: int) -> dict[str, float]:
        _, url, key, ids = self.databases[variant]
        values = self._reads(ctx, variant, url, key, ids)
        values.update(self._verify_since(ctx, variant, url, ids))
        if variant == "small":
            started = time.perf_counter()
            self._cli(ctx, url, "verify")
            values[FULL.key] = time.perf_counter() - started
        return values

    def _reads(self, ctx: Context, variant: str, url: str, key: str, ids: list[str]) -> dict[str, float]:
        sample = random.sample(ids, min(2000, len(ids)))
        paths = ctx.work_dir / f"audit-{variant}-paths.txt"
        paths.write_text("\n".join(f"/v1/instances/{i}/events" for i in sample))
        server, base = start_api(ctx, url, ctx.work_dir / f"audit-{variant}", f"w7-server-{variant}")
        try:
            ctx.cluster.checkpoint()
            requests = ["--paths-file", str(paths), "--key", key]
            latencies, errors = at_rate(
                ctx, base, requests, RATE, self.seconds, CONNECTIONS, f"w7-reads-{variant}"
            )
        finally:
            ctx.procs.stop(server)
        return {
            P50.key: percentile(latencies, 50),
            P99.key: percentile(latencies, 99),
            ERRORS.key: float(errors),
        }

    def _verify_since(self, ctx: Context, variant: str, url: str, ids: list[str]) -> dict[str, float]:
        asyncio.run(checkpoint(url, ctx.work_dir / f"audit-{variant}"))
        with psycopg.connect(url) as conn:
            row = conn.execute("SELECT max(number) FROM audit_checkpoints").fetchone()
        assert row is not None
        asyncio.run(move_some(url, random.sample(ids, MOVED_INSTANCES)))
        started = time.perf_counter()
        out = self._cli(ctx, url, "verify", "--since", str(row[0]))
        elapsed = time.perf_counter() - started
        checked = out.strip().splitlines()[-1].split("; ")[1].split(" events")[0]
        return {VERIFY.key: elapsed, CHECKED.key: float(checked)}

    def _cli(self, ctx: Context, url: str, *args: str) -> str:
        result = subprocess.run(
            [ctx.project_python, "-m", "controlplane.cli", "audit", *args, "--database-url", url],
            capture_output=True,
            text=True,
            env=base_env(),
            timeout=3600,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"audit {' '.join(args)} failed ({result.returncode}): {result.stdout[-800:]}")
        return result.stdout

    def finish(self, ctx: Context) -> None:
        for name, *_ in self.databases.values():
            ctx.cluster.drop_database(name)
