"""`python -m bench` (or `python3 dev.py bench`): set up, run the workloads interleaved, report, clean up."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType

from bench import env, report
from bench.cluster import Cluster
from bench.core import Context, NotAvailable, Outcome, Workload, cpu_shares, cpu_times, unloaded
from bench.procs import Processes
from bench.profiling import Profiler
from bench.workloads import all_workloads

RESULTS = Path(__file__).resolve().parent / "results"
# The workloads that compare the peer queues (their environment is set up only for them, or a profile).
PEER_WORKLOADS = frozenset({"drain", "pickup"})


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 dev.py bench",
        description="Benchmarks of the control plane against PostgreSQL's limit and peer queues.",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="repetitions of every workload (default 1, about 36 minutes on 2 cores; 2 with --quick)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, short durations, 2 repetitions (~3 minutes)"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated workload keys to run (default: all); see --list"
    )
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    parser.add_argument(
        "--mvcc-minutes",
        type=float,
        default=None,
        help="minutes of the MVCC-pressure workload (mvcc), its snapshot held (default 10; 1 with --quick)",
    )
    parser.add_argument("--conditions", default="", help="how the machine was when measured (for latest.md)")
    parser.add_argument("--no-write", action="store_true", help="print the table only; write no results")
    parser.add_argument(
        "--quiet-only",
        action="store_true",
        help="leave out the contested workloads' second figure, beside a busy loop on one core",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the measured repetitions, run the profiled variants once more under py-spy, "
        "with pg_stat_statements per statement (profiles in bench/results/profiles/; the cluster "
        "then preloads pg_stat_statements for the whole run)",
    )
    return parser.parse_args(argv)


def raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_workloads(
    ctx: Context, workloads: list[Workload], repeat: int, profiler: Profiler | None
) -> list[Outcome]:
    outcomes = [Outcome(w) for w in workloads]
    prepare_all(ctx, outcomes)
    for repetition in range(repeat):
        for outcome in outcomes:
            if outcome.unavailable:
                continue
            workload = outcome.workload
            for variant in workload.variants:
                if repetition > 0 and variant in workload.once:
                    continue
                if variant != unloaded(variant) and not ctx.under_load:
                    continue
                started, cpu_before = time.monotonic(), cpu_times()
                try:
                    with cpu_hog(ctx, variant != unloaded(variant)):
                        values = workload.run(ctx, unloaded(variant), repetition)
                except NotAvailable as exc:
                    outcome.errors.append(f"{variant}: not available: {exc}")
                    log(f"  {workload.key}/{variant}: not available: {exc}")
                    continue
                except Exception as exc:
                    outcome.errors.append(f"{variant} (repetition {repetition + 1}): {exc}")
                    log(f"  {workload.key}/{variant} failed: {traceback.format_exc()}")
                    continue
                outcome.add(variant, values)
                shown = ", ".join(f"{k}={v:,.2f}" for k, v in values.items())
                cpu_after = cpu_times()
                stolen = ""
                if cpu_before is not None and cpu_after is not None:
                    steal = cpu_shares(cpu_before, cpu_after)["steal"]
                    outcome.stolen.setdefault(variant, []).append(steal)
                    stolen = f", {steal:.0f} % of the CPU stolen by the host"
                log(
                    f"rep {repetition + 1}/{repeat} {workload.key}/{variant}: {shown} "
                    f"({time.monotonic() - started:.0f} s{stolen})"
                )
    if profiler is not None:
        ctx.profiler = profiler
        profile_pass(ctx, outcomes)
        ctx.profiler = None
    for outcome in outcomes:
        try:
            outcome.workload.finish(ctx)
        except Exception:
            log(f"  cleanup of {outcome.workload.key} failed: {traceback.format_exc()}")
    return outcomes


@contextlib.contextmanager
def cpu_hog(ctx: Context, on: bool) -> Iterator[None]:
    """With `on`, a busy loop (a process of its own, pinned to the last core) for the block's length."""
    if not on:
        yield
        return
    proc = ctx.procs.start([sys.executable, "-c", "while True: pass"], name="cpu-hog")
    try:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(proc.pid, {cores[-1]})
        yield
    finally:
        ctx.procs.stop(proc)


# The bulk loads of the large sizes (a million instances, ten million events, ten million jobs)
# are each one server process's work; two at once use both cores, before anything is measured.
PREPARE_THREADS = 2


def prepare_all(ctx: Context, outcomes: list[Outcome]) -> None:
    """Each workload's prepare (its databases and loads), on PREPARE_THREADS threads."""

    def prepare(outcome: Outcome) -> None:
        try:
            log(f"prepare {outcome.workload.title}")
            started = time.monotonic()
            outcome.workload.prepare(ctx)
            log(f"  prepared {outcome.workload.key} in {time.monotonic() - started:.0f} s")
        except NotAvailable as exc:
            outcome.unavailable = str(exc)
            log(f"  not available: {exc}")
        except Exception as exc:
            outcome.unavailable = f"setup failed: {exc}"
            log(f"  setup failed: {traceback.format_exc()}")

    with ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="prepare") as threads:
        list(threads.map(prepare, outcomes))


def all_ok(outcomes: list[Outcome]) -> bool:
    return all(not o.errors and not (o.unavailable or "").startswith("setup failed") for o in outcomes)


def profile_pass(ctx: Context, outcomes: list[Outcome]) -> None:
    """One more, unrecorded run of each profiled variant with py-spy attached to its process."""
    assert ctx.profiler is not None
    for outcome in outcomes:
        if outcome.unavailable:
            continue
        for variant in outcome.workload.profiled:
            log(f"profiling {outcome.workload.key}/{variant}")
            try:
                outcome.workload.run(ctx, variant, -1)
            except Exception:
                log(f"  profiling run failed: {traceback.format_exc()}")
            ctx.profiler.collect()
    for label, path in ctx.profiler.taken.items():
        log(f"profile {label}: {path}")


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.repeat is None:
        args.repeat = 2 if args.quick else 1
    workloads = all_workloads()
    if args.list:
        for w in workloads:
            print(f"{w.key:14} {w.title}")
        return 0
    if args.only:
        wanted = {key.strip() for key in args.only.split(",") if key.strip()}
        unknown = wanted - {w.key for w in workloads}
        if unknown:
            print(f"unknown workloads: {', '.join(sorted(unknown))} (see --list)", file=sys.stderr)
            return 2
        workloads = [w for w in workloads if w.key in wanted]
    # Explicit handlers: a bench started in the background may have inherited SIGINT ignored.
    signal.signal(signal.SIGTERM, raise_interrupt)
    signal.signal(signal.SIGINT, raise_interrupt)
    started = dt.datetime.now(dt.UTC).replace(microsecond=0)
    load_start = report.load_average()
    revision = report.revision()
    t0 = time.monotonic()
    peers = None
    try:
        if args.profile or PEER_WORKLOADS & {w.key for w in workloads}:
            peers = env.ensure_peers_venv(log)
    except Exception as exc:
        log(f"the peers' environment could not be set up: {exc}")
    wrk = env.ensure_wrk(log) if any(w.key == "api" for w in workloads) else None
    work_dir = Path(tempfile.mkdtemp(prefix="cp-bench-work-"))
    procs = Processes(work_dir)
    cluster: Cluster | None = None
    outcomes: list[Outcome] = []
    failed = True
    try:
        log("starting the scratch PostgreSQL cluster (fsync=on, synchronous_commit=on)")
        cluster = Cluster.start(statement_stats=args.profile)
        template = "bench_template"
        template_url = cluster.create_database(template)
        from controlplane.db import connection as db

        db.migrate(template_url)
        ctx = Context(
            cluster=cluster,
            procs=procs,
            quick=args.quick,
            work_dir=work_dir,
            template=template,
            peers_python=peers,
            wrk=wrk,
            log=log,
            mvcc_minutes=args.mvcc_minutes or (1.0 if args.quick else 10.0),
            under_load=not args.quiet_only,
        )
        profiler = None
        if args.profile:
            py_spy = env.py_spy()
            if py_spy is None:
                log("py-spy is not installed: no profiles")
            else:
                profiles = RESULTS / "profiles"
                shutil.rmtree(profiles, ignore_errors=True)  # profiles of an earlier run would mislead
                profiler = Profiler(py_spy, profiles, procs)
        pg_settings = cluster.settings()
        outcomes = run_workloads(ctx, workloads, args.repeat, profiler)
        failed = False
    except KeyboardInterrupt:
        log("interrupted: stopping everything the bench started")
        return 130
    finally:
        # A second Ctrl-C must not cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        procs.stop_all()
        if cluster is not None:
            cluster.stop()
        if failed or not all_ok(outcomes):
            log(f"stopped the cluster and every process; driver logs kept in {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
            log("stopped the cluster and every process")
    load_end = report.load_average()
    conditions = args.conditions or (
        "quiet machine"
        if load_start and load_start[0] < 0.5
        else "machine busy with other work during the run (load average above); figures are noisy"
    )
    meta = {
        "started_at": started.isoformat(),
        "duration_s": time.monotonic() - t0,
        "command": "python3 dev.py bench " + " ".join(argv),
        "repeat": args.repeat,
        "quick": args.quick,
        "conditions": conditions,
        "revision": revision,
        "revision_end": report.revision(),
        "load_start": load_start,
        "load_end": load_end,
        "machine": report.machine(),
        "postgres": pg_settings,
    }
    print(report.text_table(outcomes))
    if not args.no_write:
        json_path, md_path = report.write(RESULTS, outcomes, meta)
        log(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
