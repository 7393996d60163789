"""How long the CLI takes to answer, as a ratio to starting Python itself (`python -c pass`).

Each command runs as a new process, as a person runs it: `controlplane --help`, `--version`, and
`instances list` against a stub API on loopback (an empty page: the time is the CLI's own). The
runs are interleaved (pass, help, version, list, pass, ...) so that a change in the machine's load
touches every command alike; the medians are printed with the ratios (reported, never asserted:
the target is 0.3 s on a quiet machine, docs/decisions.md).

Run: .venv/bin/python -m bench.cli_startup [--runs 15] [--checkout ../other]   (another checkout's
CLI with this interpreter, for a before/after figure)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 0.3


@contextmanager
def stub_api() -> Iterator[str]:
    """An API answering every GET with an empty page."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            body = json.dumps({"items": [], "next_cursor": None}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, check=False)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {result.stderr.decode()[-500:]}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cli_startup", description=__doc__)
    parser.add_argument("--runs", type=int, default=15, help="runs of each command (default 15)")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose CLI is run")
    args = parser.parse_args(argv)
    checkout = args.checkout.resolve()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
    env |= {"PYTHONPATH": str(checkout), "XDG_CONFIG_HOME": "/nonexistent"}
    cli = [sys.executable, "-m", "controlplane.cli"]
    with stub_api() as url:
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "controlplane --help": [*cli, "--help"],
            "controlplane --version": [*cli, "--version"],
            "controlplane instances list": [*cli, "instances", "list", "--url", url, "--api-key", "cpk_x"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, command in commands.items():
                times[name].append(timed(command, checkout, env))
    base = statistics.median(times["python -c pass"])
    load = os.getloadavg()[0]
    print(f"CLI start-up of {checkout} ({args.runs} runs each, interleaved; load average {load:.2f})")
    print(f"{'command':<30} {'median s':>9} {'min s':>7} {'ratio':>7}  target")
    for name, samples in times.items():
        median = statistics.median(samples)
        target = "" if name == "python -c pass" else ("ok" if median <= TARGET_S else f"> {TARGET_S} s")
        print(f"{name:<30} {median:9.3f} {min(samples):7.3f} {median / base:7.1f}  {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
