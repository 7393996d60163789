"""Workload 4: POST /v1/instances against a one-INSERT baseline route in the same server."""

from __future__ import annotations

import asyncio
import importlib
import json
import secrets
import subprocess
import time
from pathlib import Path

import httpx

from bench.core import Context, Metric, NotAvailable, Target, Workload, percentile
from bench.procs import wait_for
from controlplane.db import connection as db
from controlplane.runtime.postgres import free_port

RPS = Metric("rps", "req/s at saturation", "1/s")
P50 = Metric("p50_ms", "p50 ms at 200 req/s", "ms", 2)
P99 = Metric("p99_ms", "p99 ms at 200 req/s", "ms", 2)
ERRORS = Metric("errors", "non-2xx responses", "")
PATHS = {"ours": "/v1/instances", "baseline": "/bench/baseline"}
WRK_SCRIPT = Path(__file__).resolve().parent / "wrk_post.lua"
CONNECTIONS = 32
RATE = 200.0
RATE_CONNECTIONS = 16


async def make_tenant(url: str) -> str:
    from controlplane.services.tenants import create_org

    conn = await db.connect(url)
    async with conn:
        _, key = await create_org(conn, f"bench-{secrets.token_hex(4)}")
        await conn.execute("CREATE TABLE bench_baseline (id bigserial PRIMARY KEY, body jsonb NOT NULL)")
    return key.plaintext


class ApiWorkload(Workload):
    def __init__(self) -> None:
        super().__init__(
            key="api",
            title="4. API create",
            variants=("ours", "baseline"),
            metrics={v: (RPS, P50, P99, ERRORS) for v in ("ours", "baseline")},
            targets=(Target("ours/baseline", ("ours", RPS.key), ("baseline", RPS.key), ">=", 0.5),),
            profiled=("ours",),
            contested=("ours", "baseline"),
        )
        self.seconds = 0.0
        self.warmup = 0.0

    def prepare(self, ctx: Context) -> None:
        try:
            importlib.import_module("controlplane.api.app")
            importlib.import_module("controlplane.services.tenants")
        except ImportError as exc:
            raise NotAvailable(f"the REST API is not in the product yet ({exc})") from exc
        self.seconds = ctx.size(10.0, 2.0)
        self.warmup = ctx.size(2.0, 1.0)
        tool = (
            f"wrk -t1 -c{CONNECTIONS} (installed by the bench)"
            if ctx.wrk
            else f"the bench's own load generator, closed loop with {CONNECTIONS} connections "
            "(wrk could not be installed; the generator may limit the baseline)"
        )
        self.notes = [
            "One uvicorn process (as `controlplane api` serves it: uvloop/httptools, product logging at "
            "WARNING), CONTROLPLANE_PROVISIONER=noop, a fresh database per run; the load generator is a "
            "separate process.",
            f"Saturation: {tool} for {self.seconds:g} s after a {self.warmup:g} s warm-up. Latency: "
            f"the bench's open-loop generator (asyncio sockets, {RATE_CONNECTIONS} keep-alive connections) "
            f"at {RATE:g} req/s for {self.seconds:g} s, measured from the scheduled send time; when the "
            "offered rate exceeds what the server sustains, the queue grows and so does the latency.",
            "Ours: POST /v1/instances with a Bearer key (key lookup, instance row + audit row, provisioning "
            "job + job event, NOTIFY, one transaction, 202 with the instance document). Baseline: "
            "POST /bench/baseline mounted by the bench on the same app object: parse the body, one INSERT.",
        ]

    def run(self, ctx: Context, variant: str, repetition: int) -> dict[str, float]:
        name, url = ctx.fresh_database(f"w4_{variant}")
        key = asyncio.run(make_tenant(url))
        data_dir = ctx.work_dir / f"api-{name}"
        data_dir.mkdir()
        server, base = start_api(ctx, url, data_dir, f"w4-server-{variant}")
        try:
            ctx.cluster.checkpoint()
            path = PATHS[variant]
            self._saturate(ctx, base, path, key, self.warmup)
            if ctx.profiler is not None:
                ctx.profiler.attach(server.pid, f"api-{variant}-server", self.seconds)
            rps, sat_errors = self._saturate(ctx, base, path, key, self.seconds)
            latencies, rate_errors = self._at_rate(ctx, base, path, key)
        finally:
            ctx.procs.stop(server)
            ctx.cluster.drop_database(name)
        if sat_errors + rate_errors:
            # Refused requests answer faster than created ones: the figures would not be the path's.
            raise RuntimeError(f"{sat_errors + rate_errors} requests were not answered 2xx")
        return {
            RPS.key: rps,
            P50.key: percentile(latencies, 50),
            P99.key: percentile(latencies, 99),
            ERRORS.key: float(sat_errors + rate_errors),
        }

    def _saturate(self, ctx: Context, base: str, path: str, key: str, seconds: float) -> tuple[float, int]:
        if ctx.wrk is None:
            result = ctx.procs.run_json(
                [
                    ctx.project_python,
                    "-m",
                    "bench.drivers.loadgen",
                    "closed",
                    "--base",
                    base,
                    "--path",
                    path,
                    "--key",
                    key if path == PATHS["ours"] else "",
                    "--seconds",
                    str(seconds),
                    "--connections",
                    str(CONNECTIONS),
                ],
                name="w4-loadgen-closed",
                timeout=seconds + 60,
            )
            errors = sum(n for status, n in result["statuses"].items() if not 200 <= int(status) < 300)
            return float(result["rps"]), errors
        env = {
            "BENCH_TAG": secrets.token_hex(4),
            "BENCH_KEY": key if path == PATHS["ours"] else "",
            "BENCH_PATH": path,
            "PATH": "/usr/bin:/bin",
        }
        argv = [
            ctx.wrk,
            "-t1",
            f"-c{CONNECTIONS}",
            f"-d{max(1, round(seconds))}s",
            "-s",
            str(WRK_SCRIPT),
            base,
        ]
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=seconds + 60, check=False)
        line = next((x for x in out.stdout.splitlines() if x.startswith("{")), None)
        if out.returncode != 0 or line is None:
            raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr[-500:]}")
        summary = json.loads(line)
        return summary["requests"] / (summary["duration_us"] / 1e6), summary["status_errors"] + summary[
            "socket_errors"
        ]

    def _at_rate(self, ctx: Context, base: str, path: str, key: str) -> tuple[list[float], int]:
        requests = ["--path", path, "--key", key if path == PATHS["ours"] else ""]
        return at_rate(ctx, base, requests, RATE, self.seconds, RATE_CONNECTIONS, "w4-loadgen-rate")


def at_rate(
    ctx: Context, base: str, requests: list[str], rate: float, seconds: float, connections: int, name: str
) -> tuple[list[float], int]:
    """The load generator's open loop (`requests`: its --path/--paths-file and --key flags): the
    latencies (ms) and the number of non-2xx answers."""
    result = ctx.procs.run_json(
        [
            *(ctx.project_python, "-m", "bench.drivers.loadgen", "rate", "--base", base, *requests),
            *("--rate", str(rate), "--seconds", str(seconds), "--connections", str(connections)),
        ],
        name=name,
        timeout=seconds + 120,
    )
    errors = sum(n for status, n in result["statuses"].items() if not 200 <= int(status) < 300)
    return list(result["latencies_ms"]), errors


def start_api(ctx: Context, url: str, data_dir: Path, name: str) -> tuple[subprocess.Popen[str], str]:
    """The product's API (noop provisioner) in its own process, answering `/healthz`: (process, URL)."""
    port = free_port()
    env = {
        **base_env(),
        "CONTROLPLANE_DATABASE_URL": url,
        "CONTROLPLANE_PROVISIONER": "noop",
        "CONTROLPLANE_DATA_DIR": str(data_dir),
        "CONTROLPLANE_LOG_LEVEL": "WARNING",
        # The bench measures the request path, not the per-key limit (600 a minute by default),
        # which a load generator passes within a second: every answer beyond it would be a 429.
        "CONTROLPLANE_API_RATE_LIMIT": "0",
    }
    server = ctx.procs.start(
        [ctx.project_python, "-m", "bench.drivers.api_server", "--port", str(port)], name=name, env=env
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: healthy(base) or server.poll() is not None, 60, what="the API server")
        if server.poll() is not None:
            raise RuntimeError(f"the API server exited: {ctx.procs.log_tail(server)}")
    except BaseException:
        ctx.procs.stop(server)
        raise
    return server, base


def base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}


def healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        time.sleep(0.1)
        return False
