"""WAL positions and the archive's coverage (pure): up to which moment every acknowledged commit of
an instance is in its archive, told from marks the observations take.

A mark is taken on the server: the time, the WAL flushed by then (every commit acknowledged before
that time ends at or before it), the next transaction id, and whether any transaction held an id.
The archive covers a mark once the end of its newest archived segment reaches the mark's position;
and once a covered mark saw no transaction in progress, every later mark with the same next id is
covered too (nothing was committed in between, whatever unimportant records the server wrote).
The newest covered mark's time is the latest moment a restore can reach.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

# PostgreSQL's default segment size (initdb's --wal-segsize is never changed here).
SEGMENT_BYTES = 16 * 1024 * 1024
_SEGMENT = re.compile(r"^[0-9A-F]{8}([0-9A-F]{8})([0-9A-F]{8})")
# Marks kept while waiting for the archive to cover them (older ones are dropped: the coverage
# then advances in coarser steps, never past what is archived).
MAX_MARKS = 64


def segment_end(walfile: str | None) -> int | None:
    """The WAL position just after segment `walfile` (a segment's name, or a `.backup` or
    `.partial` file named after one); None for anything else (a timeline's `.history`)."""
    if not walfile or walfile.endswith(".history"):
        return None
    found = _SEGMENT.match(walfile)
    if found is None:
        return None
    log, seg = int(found.group(1), 16), int(found.group(2), 16)
    return (log << 32) + (seg + 1) * SEGMENT_BYTES


def parse_lsn(text: str) -> int:
    """`0/16B3748` as a number."""
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) + int(low, 16)


@dataclass(frozen=True)
class Mark:
    at: datetime
    lsn: int
    next_xid: int
    idle: bool

    def as_json(self) -> list[Any]:
        return [self.at.isoformat(), self.lsn, self.next_xid, self.idle]

    @classmethod
    def from_json(cls, value: list[Any]) -> Mark:
        return cls(datetime.fromisoformat(str(value[0])), int(value[1]), int(value[2]), bool(value[3]))


@dataclass(frozen=True)
class Coverage:
    """How far the archive covers an instance's writes: the newest covered mark, those waiting."""

    covered: Mark | None = None
    waiting: tuple[Mark, ...] = ()
    # The end of the newest segment seen archived.
    archived_end: int = 0

    @property
    def latest(self) -> datetime | None:
        return None if self.covered is None else self.covered.at

    def lag_bytes(self) -> int | None:
        """WAL flushed by the newest mark and not archived yet."""
        newest = self.waiting[-1] if self.waiting else self.covered
        return None if newest is None else max(0, newest.lsn - self.archived_end)

    def as_json(self) -> dict[str, Any]:
        return {
            "covered": None if self.covered is None else self.covered.as_json(),
            "waiting": [mark.as_json() for mark in self.waiting],
            "archived_end": self.archived_end,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any] | None) -> Coverage:
        if not value:
            return cls()
        covered = value.get("covered")
        return cls(
            None if covered is None else Mark.from_json(covered),
            tuple(Mark.from_json(mark) for mark in value.get("waiting", [])),
            int(value.get("archived_end", 0)),
        )


def advance(coverage: Coverage, mark: Mark | None, archived_end: int | None) -> Coverage:
    """The coverage after a new observation: its mark (None: the server could not be marked, e.g.
    in recovery) and the end of the newest segment archived (None: not known)."""
    end = max(coverage.archived_end, archived_end or 0)
    waiting = (*coverage.waiting, mark) if mark is not None else coverage.waiting
    covered = coverage.covered
    left: list[Mark] = []
    for candidate in waiting:
        quiet = covered is not None and covered.idle and candidate.next_xid == covered.next_xid
        if candidate.lsn <= end or quiet:
            covered = candidate
            left = []
        else:
            left.append(candidate)
    return Coverage(covered, tuple(left[-MAX_MARKS:]), end)


def restart(coverage: Coverage) -> Coverage:
    """The coverage after the instance's WAL began again elsewhere (a restore, a new cluster): what
    was covered stays covered; positions from then on are not comparable with the old ones."""
    return replace(coverage, waiting=(), archived_end=0)


def seconds_between(earlier: datetime | None, later: datetime | None) -> float | None:
    if earlier is None or later is None:
        return None
    return max(0.0, (later - earlier) / timedelta(seconds=1))
