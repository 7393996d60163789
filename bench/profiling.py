"""Profiles of the project's processes (py-spy, sampling), taken in a separate pass after the measured ones.

Each profile is kept raw (collapsed stacks) and summarised: the functions where the samples were
taken (self) and the project functions that were on the stack (inclusive).
"""

from __future__ import annotations

import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.procs import Processes


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
