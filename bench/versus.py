"""`python -m bench.versus --other DIR`: workload 1 (the transition path) of this checkout against
another one (for instance an export of `main` with its own `.venv`), tightly interleaved on one
scratch cluster, so that a change's effect on the ratio is not lost in the machine's drift.

Each side has its own template database, migrated by its own code; each measured run gets a fresh
clone seeded by that side's code (8 ready instances), then that side's driver
(`bench.drivers.transitions`, 8 clients in 2 processes) or pgbench on that side's statement
(`bench.workloads.transitions.pgbench_script`), as workload 1 runs them. Rounds alternate which
side goes first. It prints one line per run and the medians; it writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg

from bench.cluster import Cluster
from bench.workloads.transitions import CLIENTS, PGBENCH_VARIABLES, THREADS

HERE = Path(__file__).resolve().parent.parent
MIGRATE = "import sys\nfrom controlplane.db import connection\nconnection.migrate(sys.argv[1])\nprint('ok')"
SEED = (
    "import asyncio, sys\nfrom bench.seed import ready_instances\n"
    "print(','.join(str(i) for i in asyncio.run(ready_instances(sys.argv[1], 8))))"
)
SCRIPT = (
    "import sys\nfrom bench.workloads.transitions import pgbench_script, transition_statement\n"
    "open(sys.argv[1], 'w').write(pgbench_script(transition_statement()))\nprint('ok')"
)


class Side:
    def __init__(self, name: str, root: Path, work: Path) -> None:
        self.name = name
        self.root = root
        self.python = str(root / ".venv" / "bin" / "python")
        self.script = work / f"{name}.pgbench"
        self.ours: list[float] = []
        self.pgbench: list[float] = []
        self.cpu: list[float] = []

    def run(self, code: str, *args: str) -> str:
        out = subprocess.run([self.python, "-c", code, *args], cwd=self.root, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"{self.name}: {out.stderr[-2000:]}")
        return out.stdout.strip().splitlines()[-1]


def fresh(cluster: Cluster, side: Side, n: int) -> tuple[str, str, list[str]]:
    name = f"run_{side.name}_{n}"
    url = cluster.create_database(name, f"tpl_{side.name}")
    return name, url, side.run(SEED, url).split(",")


def ours(cluster: Cluster, side: Side, seconds: float, n: int) -> None:
    name, url, ids = fresh(cluster, side, n)
    cluster.checkpoint()
    start_at = time.time() + 1.5
    per = CLIENTS // THREADS
    procs = [
        subprocess.Popen(
            [
                side.python,
                "-m",
                "bench.drivers.transitions",
                "--url",
                url,
                "--ids",
                ",".join(ids[k * per : (k + 1) * per]),
                "--version",
                "2",
                "--start-at",
                str(start_at),
                "--seconds",
                str(seconds),
            ],
            cwd=side.root,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in range(THREADS)
    ]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    moved = sum(o["transitions"] for o in outs)
    side.ours.append(moved / seconds)
    side.cpu.append(1e6 * sum(o["cpu_s"] for o in outs) / max(moved, 1))
    cluster.drop_database(name)


def pgbench(cluster: Cluster, side: Side, seconds: float, n: int) -> None:
    name, url, ids = fresh(cluster, side, n)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_clients (client int PRIMARY KEY, inst text NOT NULL)")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO bench_clients VALUES (%s, %s)", list(enumerate(ids)))
    cluster.checkpoint()
    argv = [cluster.server.bin("pgbench"), "-n", "-M", "prepared", "-c", str(CLIENTS), "-j", str(THREADS)]
    argv += ["-T", str(int(seconds)), "-f", str(side.script)]
    for key, value in PGBENCH_VARIABLES.items():
        argv += ["-D", f"{key}={value}"]
    out = subprocess.run(
        [*argv, name], capture_output=True, text=True, env={**cluster.env, "PATH": "/usr/bin:/bin"}
    )
    tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out.stdout)
    if out.returncode or tps is None:
        raise RuntimeError(f"pgbench ({side.name}) failed: {out.stderr[-1000:]}")
    side.pgbench.append(2 * float(tps.group(1)))  # two transitions per script run
    cluster.drop_database(name)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.versus", description=__doc__.splitlines()[0])
    parser.add_argument("--other", type=Path, required=True, help="the other checkout (with its .venv)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    work = Path(os.environ.get("TMPDIR", "/tmp"))
    sides = [Side("other", args.other.resolve(), work), Side("this", HERE, work)]
    cluster = Cluster.start()
    runs = 0
    try:
        for side in sides:
            side.run(MIGRATE, cluster.create_database(f"tpl_{side.name}"))
            side.run(SCRIPT, str(side.script))
        for rnd in range(args.rounds):
            for side in sides if rnd % 2 == 0 else sides[::-1]:
                runs += 1
                ours(cluster, side, args.seconds, runs)
                pgbench(cluster, side, args.seconds, runs)
                print(
                    f"round {rnd + 1} {side.name:5}: ours {side.ours[-1]:5.0f}/s (client CPU "
                    f"{side.cpu[-1]:3.0f} us), pgbench {side.pgbench[-1]:5.0f}/s, ratio "
                    f"{side.ours[-1] / side.pgbench[-1]:.2f}, load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    finally:
        cluster.stop()
    for side in sides:
        ratios = [o / p for o, p in zip(side.ours, side.pgbench, strict=True)]
        print(
            f"{side.name} ({side.root}): ours/pgbench median {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f} to {max(ratios):.2f}), ours {statistics.median(side.ours):.0f}/s, "
            f"pgbench {statistics.median(side.pgbench):.0f}/s, client CPU "
            f"{statistics.median(side.cpu):.0f} us/transition, n={len(ratios)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
