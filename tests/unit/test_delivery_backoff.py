"""Notification redelivery backs off with jitter (controlplane/handlers/delivery.py `retry_delay`):
the step doubles from FIRST_RETRY_S up to MAX_RETRY_S, and each delay lies in the upper half of its
step, drawn from the injected random source."""

from __future__ import annotations

import pytest

from controlplane.handlers.delivery import retry_delay
from controlplane.services.notices import FIRST_RETRY_S, MAX_RETRY_S


def test_the_delay_doubles_and_spreads_over_the_upper_half_of_its_step() -> None:
    for attempts in range(1, 12):
        step = min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** (attempts - 1))
        assert retry_delay(attempts, lambda: 0.0) == step / 2
        assert retry_delay(attempts, lambda: 0.999999) == pytest.approx(step, rel=1e-5)
        assert retry_delay(attempts, lambda: 0.5) == 0.75 * step


def test_deliveries_that_failed_together_come_back_apart() -> None:
    draws = iter([0.1, 0.6, 0.9])
    delays = [retry_delay(3, lambda: next(draws)) for _ in range(3)]
    assert len(set(delays)) == 3 and all(FIRST_RETRY_S * 2 <= d < FIRST_RETRY_S * 4 for d in delays)


def test_the_cap_holds_however_many_attempts_failed() -> None:
    assert retry_delay(40, lambda: 0.999999) <= MAX_RETRY_S
