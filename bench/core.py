"""What a workload is: variants measured side by side, their metrics, and the targets they report against."""

from __future__ import annotations

import statistics
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.cluster import Cluster
from bench.procs import Processes

if TYPE_CHECKING:
    from bench.profiling import Profiler


class NotAvailable(Exception):
    """A workload cannot run here (a product part or a tool is missing); the reason is reported."""


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    decimals: int = 0


@dataclass(frozen=True)
class Target:
    """A figure to report against, never to assert: a ratio of two medians, or one median alone."""

    label: str
    numerator: tuple[str, str]
    denominator: tuple[str, str] | None
    op: str  # ">=" or "<="
    threshold: float

    def describe(self) -> str:
        return f"{self.op} {self.threshold:g}"

    def under_load(self) -> Target:
        """The same figure from the variants run beside the CPU hog (reported, never a target)."""
        num = (loaded(self.numerator[0]), self.numerator[1])
        den = None if self.denominator is None else (loaded(self.denominator[0]), self.denominator[1])
        return Target(f"{self.label}, {HOG}", num, den, self.op, self.threshold)

    def met(self, value: float) -> bool:
        return value >= self.threshold if self.op == ">=" else value <= self.threshold


@dataclass
class Context:
    """What every workload may use: the cluster, the process registry, the sizes, the peers' python."""

    cluster: Cluster
    procs: Processes
    quick: bool
    work_dir: Path
    template: str
    peers_python: str | None
    wrk: str | None
    log: Callable[[str], None]
    # Set only during the profiling pass (--profile), after the measured repetitions.
    profiler: Profiler | None = None
    project_python: str = sys.executable
    # How long the MVCC-pressure workload runs (`--mvcc-minutes`).
    mvcc_minutes: float = 10.0
    # Whether the contested workloads' variants also run beside the CPU hog (not `--quiet-only`).
    under_load: bool = True
    _counter: int = 0
    # Workloads prepare on two threads at once (see bench.__main__.prepare_all).
    _naming: threading.Lock = field(default_factory=threading.Lock)

    def fresh_database(self, prefix: str, template: str | None = None) -> tuple[str, str]:
        """A new database cloned from the migrated template (or `template`): (name, url)."""
        with self._naming:
            self._counter += 1
            name = f"{prefix}_{self._counter}"
        return name, self.cluster.create_database(name, template or self.template)

    def size(self, full: Any, quick: Any) -> Any:
        return quick if self.quick else full


# A contested workload's variants run once more with this beside them: a busy loop on one core.
HOG = "one core busy"


def loaded(variant: str) -> str:
    """The name of `variant` run beside the CPU hog."""
    return f"{variant}, {HOG}"


def unloaded(variant: str) -> str:
    """The variant a (possibly loaded) variant name runs."""
    return variant.removesuffix(f", {HOG}")


@dataclass
class Workload:
    """A comparison run in every repetition; subclasses fill in prepare/run."""

    key: str
    title: str
    variants: tuple[str, ...]
    metrics: dict[str, tuple[Metric, ...]]
    targets: tuple[Target, ...] = ()
    notes: list[str] = field(default_factory=list)
    # The variants worth a py-spy profile (the project's own processes).
    profiled: tuple[str, ...] = ()
    # Variants too long to repeat: run in the first repetition only (their n is 1).
    once: tuple[str, ...] = ()
    # Variants that contend for the CPU with what they are compared to: each runs once more beside
    # a busy loop on one core (`loaded(variant)`), its figures reported beside the quiet ones, with
    # the targets between two of them.
    contested: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.contested:
            return
        self.variants = (*self.variants, *(loaded(v) for v in self.contested))
        self.metrics = {**self.metrics, **{loaded(v): self.metrics[v] for v in self.contested}}
        both = [
            t
            for t in self.targets
            if t.numerator[0] in self.contested
            and (t.denominator is None or t.denominator[0] in self.contested)
        ]
        self.targets = (*self.targets, *(t.under_load() for t in both))

    def prepare(self, ctx: Context) -> None:
        """Once before the repetitions; raise NotAvailable when a part is missing."""

    def run(self, ctx: Context, variant: str, repetition: int) -> dict[str, float]:
        raise NotImplementedError

    def finish(self, ctx: Context) -> None:
        """Once after the repetitions (drop what prepare made)."""


def cpu_times() -> list[int] | None:
    """The machine's CPU time so far by kind (/proc/stat: user, nice, system, idle, iowait, irq,
    softirq, steal), in clock ticks; None where there is no /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    return [int(value) for value in fields[1:9]]


def cpu_shares(before: list[int], after: list[int]) -> dict[str, float]:
    """The machine's CPU between two cpu_times(), in % of it: busy, stolen by the hypervisor
    (steal: the host ran something else on these cores), waiting on I/O."""
    delta = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(delta) or 1
    return {
        "busy": 100 * (total - delta[3] - delta[4] - delta[7]) / total,
        "iowait": 100 * delta[4] / total,
        "steal": 100 * delta[7] / total,
    }


@dataclass
class Outcome:
    """Every sample of one workload, and why it did not run if it did not."""

    workload: Workload
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    unavailable: str | None = None
    # The % of the machine's CPU the host took while each variant ran, per repetition.
    stolen: dict[str, list[float]] = field(default_factory=dict)

    def add(self, variant: str, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.samples.setdefault(variant, {}).setdefault(key, []).append(float(value))

    def values(self, variant: str, metric: str) -> list[float]:
        return self.samples.get(variant, {}).get(metric, [])

    def median(self, variant: str, metric: str) -> float | None:
        values = self.values(variant, metric)
        return statistics.median(values) if values else None

    def target_value(self, target: Target) -> float | None:
        num = self.median(*target.numerator)
        if num is None:
            return None
        if target.denominator is None:
            return num
        den = self.median(*target.denominator)
        return None if not den else num / den

    def paired_ratios(self, target: Target) -> list[float]:
        """The ratio within each repetition (the variants ran back to back)."""
        if target.denominator is None:
            return self.values(*target.numerator)
        nums, dens = self.values(*target.numerator), self.values(*target.denominator)
        return [n / d for n, d in zip(nums, dens, strict=False) if d]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]
