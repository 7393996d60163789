"""How far an instance's archive covers its writes, from the marks its observations take (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from provisioners.local.wal import SEGMENT_BYTES, Coverage, Mark, advance, parse_lsn, restart, segment_end

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def mark(seconds: float, lsn: int, next_xid: int = 100, idle: bool = True) -> Mark:
    return Mark(T0 + timedelta(seconds=seconds), lsn, next_xid, idle)


def test_wal_positions_and_segment_ends() -> None:
    assert parse_lsn("0/16B3748") == 0x16B3748 and parse_lsn("1/0") == 1 << 32
    assert segment_end("000000010000000000000003") == 4 * SEGMENT_BYTES
    assert segment_end("000000020000000100000000") == (1 << 32) + SEGMENT_BYTES
    assert segment_end("000000010000000000000003.00000028.backup") == 4 * SEGMENT_BYTES
    assert segment_end("00000002.history") is None and segment_end(None) is None


def test_a_mark_is_covered_once_its_segment_is_archived() -> None:
    coverage = advance(Coverage(), mark(0, 3 * SEGMENT_BYTES + 100, next_xid=5, idle=False), None)
    assert coverage.latest is None and coverage.lag_bytes() == 3 * SEGMENT_BYTES + 100
    coverage = advance(coverage, mark(1, 3 * SEGMENT_BYTES + 900, next_xid=7, idle=False), 3 * SEGMENT_BYTES)
    assert coverage.latest is None and len(coverage.waiting) == 2
    coverage = advance(coverage, mark(2, 4 * SEGMENT_BYTES + 10, next_xid=9, idle=False), 4 * SEGMENT_BYTES)
    # The first two marks' WAL is archived: the newest of them is the latest restorable moment.
    assert coverage.latest == T0 + timedelta(seconds=1) and [m.lsn for m in coverage.waiting] == [
        4 * SEGMENT_BYTES + 10
    ]
    assert coverage.lag_bytes() == 10
    assert Coverage.from_json(coverage.as_json()) == coverage


def test_nothing_committed_since_an_idle_covered_mark_keeps_later_marks_covered() -> None:
    # Idle: the server writes an unimportant record after the switch (no new segment follows it),
    # but no transaction id was handed out since the covered mark, and none was running then.
    covered = advance(Coverage(), mark(0, 4 * SEGMENT_BYTES, next_xid=50), 4 * SEGMENT_BYTES)
    later = advance(covered, mark(20, 4 * SEGMENT_BYTES + 0x60, next_xid=50), 4 * SEGMENT_BYTES)
    assert later.latest == T0 + timedelta(seconds=20) and later.waiting == ()
    # A transaction held an id at the covered mark: a later commit may not be archived.
    busy = advance(Coverage(), mark(0, 4 * SEGMENT_BYTES, next_xid=50, idle=False), 4 * SEGMENT_BYTES)
    after = advance(busy, mark(20, 4 * SEGMENT_BYTES + 0x60, next_xid=50), 4 * SEGMENT_BYTES)
    assert after.latest == T0
    # A new id was handed out: not quiet.
    moved = advance(covered, mark(20, 4 * SEGMENT_BYTES + 0x60, next_xid=51), 4 * SEGMENT_BYTES)
    assert moved.latest == T0


def test_a_restart_keeps_what_was_covered_and_forgets_positions() -> None:
    coverage = advance(Coverage(), mark(0, 100), SEGMENT_BYTES)
    coverage = advance(coverage, mark(5, 2 * SEGMENT_BYTES), SEGMENT_BYTES)
    again = restart(coverage)
    assert again.latest == coverage.latest and again.waiting == () and again.archived_end == 0
