"""Where a worker's next claim starts, from the jobs its claim returned and the bound it read."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from controlplane.queue.moves import ClaimFrom

T = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
CLOCK = timedelta(milliseconds=100)
MOST = timedelta(seconds=1)


def claimed(run_at: datetime, look_from: datetime) -> dict[str, object]:
    return {"priority": 100, "attempt": 1, "run_at": run_at, "_look_from": look_from}


def test_a_claim_no_older_writer_held_back_starts_just_before_the_jobs() -> None:
    point = ClaimFrom.before(claimed(T, T + timedelta(seconds=3)), CLOCK, most=MOST)
    assert point == ClaimFrom(100, True, T - CLOCK)


def test_a_claim_starts_before_the_oldest_writer_begun_before_the_jobs() -> None:
    writer = T - timedelta(milliseconds=400)
    assert ClaimFrom.before(claimed(T, writer), CLOCK, most=MOST).run_at == writer - CLOCK


def test_a_claim_starts_no_further_back_than_the_most_it_may() -> None:
    # An older writer's enqueue is left to the look off the claim path.
    assert ClaimFrom.before(claimed(T, T - timedelta(minutes=5)), CLOCK, most=MOST).run_at == T - MOST


def test_the_point_keeps_the_jobs_priority_and_whether_it_was_fresh() -> None:
    job = {"priority": 5, "attempt": 2, "run_at": T, "_look_from": T + MOST}
    assert ClaimFrom.before(job, MOST, most=2 * MOST) == ClaimFrom(5, False, T - MOST)
