"""The retry policy: backoff with jitter, cap, and the retry-or-abandon decision."""

from __future__ import annotations

import pytest

from controlplane.core.retry import RetryPolicy


def policy(rand: float = 0.5) -> RetryPolicy:
    return RetryPolicy(base_delay_s=1.0, max_delay_s=60.0, rand=lambda: rand)


def test_backoff_doubles_per_attempt_within_its_jitter_band() -> None:
    low, high = policy(0.0), policy(0.999999)
    for attempt, step in [(1, 1), (2, 2), (3, 4), (4, 8), (5, 16)]:
        assert low.backoff_s(attempt) == pytest.approx(step / 2)
        assert high.backoff_s(attempt) == pytest.approx(step, rel=1e-5)


def test_backoff_is_capped() -> None:
    assert policy(0.999999).backoff_s(30) <= 60.0
    assert policy(0.0).backoff_s(30) == pytest.approx(30.0)


def test_jitter_comes_from_the_injected_source() -> None:
    draws = iter([0.1, 0.9])
    p = RetryPolicy(base_delay_s=10.0, max_delay_s=1000.0, rand=lambda: next(draws))
    assert p.backoff_s(1) == pytest.approx(5.5)
    assert p.backoff_s(1) == pytest.approx(9.5)


def test_temporary_errors_retry_until_the_last_attempt() -> None:
    p = policy()
    first = p.decide(attempt=1, max_attempts=3, error_kind="temporary")
    assert first.action == "retry" and first.delay_s == pytest.approx(0.75)
    assert p.decide(attempt=2, max_attempts=3, error_kind="temporary").action == "retry"
    last = p.decide(attempt=3, max_attempts=3, error_kind="temporary")
    assert last.action == "abandon" and last.delay_s == 0.0


def test_permanent_errors_abandon_at_once() -> None:
    decision = policy().decide(attempt=1, max_attempts=5, error_kind="permanent")
    assert decision.action == "abandon" and decision.why == "permanent error"


def test_a_requested_delay_replaces_the_backoff_up_to_the_cap() -> None:
    p = policy()
    assert p.decide(attempt=1, max_attempts=5, error_kind="temporary", requested_delay_s=7).delay_s == 7
    assert p.decide(attempt=1, max_attempts=5, error_kind="temporary", requested_delay_s=999).delay_s == 60


def test_unknown_error_kind_is_refused() -> None:
    with pytest.raises(ValueError):
        policy().decide(attempt=1, max_attempts=5, error_kind="weird")
