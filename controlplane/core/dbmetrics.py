"""A customer database's own metrics (pure): what the observation samples, the two resolutions it
is kept at, and how a requested range is cut into bounded points.

A sample holds the server's cumulative counters (transactions, rows, cache blocks) and its gauges
(connections, size); rates come from the difference between two samples, so a sample stands alone
and a missed one loses nothing but resolution. Replication and archive lag have their place here,
empty until the servers report them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

GIB = 1024**3


@dataclass(frozen=True)
class DatabaseStats:
    """One look at a customer database's server: counters since its statistics began, and gauges."""

    connections: int
    max_connections: int
    # Cumulative counters (pg_stat_database): a lower value than before means they were reset.
    transactions: int
    rows_read: int
    rows_written: int
    blocks_hit: int
    blocks_read: int
    size_bytes: int
    # Seconds a standby is behind, and since the newest WAL was archived (None: not reported).
    replication_lag_s: float | None = None
    archive_lag_s: float | None = None


@dataclass(frozen=True)
class Retention:
    """Samples at `raw_s` are kept `raw_keep_s`; rolled up into `rollup_s` buckets kept `rollup_keep_s`."""

    raw_s: int = 10
    raw_keep_s: int = 86_400
    rollup_s: int = 300
    rollup_keep_s: int = 30 * 86_400


# A series never has more points than this, whatever the range asked.
MAX_POINTS = 720


class BadRange(ValueError):
    """A range that cannot be served: reversed, too long or too old."""


@dataclass(frozen=True)
class SeriesRequest:
    """A range cut into points: which stored resolution serves it, and the step between points."""

    start: datetime
    end: datetime
    step_s: int
    resolution_s: int


def series_request(
    start: datetime, end: datetime, step_s: int | None, now: datetime, retention: Retention
) -> SeriesRequest:
    """The range [start, end) served from the finest resolution still kept for all of it, in steps
    of at least that resolution and at most MAX_POINTS of them (a smaller step is widened)."""
    if end <= start:
        raise BadRange("`to` must be after `from`")
    if end - start > timedelta(seconds=retention.rollup_keep_s):
        raise BadRange(f"a range is at most {retention.rollup_keep_s // 86_400} days")
    if start < now - timedelta(seconds=retention.rollup_keep_s):
        raise BadRange(f"metrics are kept {retention.rollup_keep_s // 86_400} days")
    raw = start >= now - timedelta(seconds=retention.raw_keep_s) and (step_s or 0) < retention.rollup_s
    resolution = retention.raw_s if raw else retention.rollup_s
    span = (end - start).total_seconds()
    fewest = math.ceil(span / MAX_POINTS)
    step = max(resolution, step_s or 0, fewest)
    step = math.ceil(step / resolution) * resolution  # whole stored samples per point
    return SeriesRequest(start, end, step, resolution)


def rate(newer: int | None, older: int | None, seconds: float) -> float | None:
    """Per second between two readings of a counter; None across a reset or a gap in the data."""
    if newer is None or older is None or seconds <= 0 or newer < older:
        return None
    return (newer - older) / seconds


def hit_ratio_of_rates(hit: float, read: float) -> float | None:
    """The share of block reads served from shared buffers (None: no reads at all)."""
    if hit + read <= 0:
        return None
    return hit / (hit + read)


@dataclass(frozen=True)
class Shown:
    """A metric as the console's charts and the CLI's table show it: its name, the point's field,
    and how a value is written."""

    key: str
    title: str
    field: str
    write: Callable[[float], str]


SHOWN: tuple[Shown, ...] = (
    Shown("connections", "Connections", "connections", lambda v: f"{v:.1f}"),
    Shown("transactions", "Transactions per second", "transactions_per_s", lambda v: f"{v:.1f}/s"),
    Shown("reads", "Rows read per second", "rows_read_per_s", lambda v: f"{v:,.0f}/s"),
    Shown("writes", "Rows written per second", "rows_written_per_s", lambda v: f"{v:,.0f}/s"),
    Shown("cache", "Cache hit ratio", "cache_hit_ratio", lambda v: f"{v:.1%}"),
    Shown("size", "Database size", "size_bytes", lambda v: f"{v / 2**20:,.1f} MiB"),
)
