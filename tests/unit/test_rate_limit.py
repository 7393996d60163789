"""The per-key fixed window, on an injected clock."""

from __future__ import annotations

from controlplane.api.ratelimit import FixedWindow, sign_in_refusal


def test_a_window_allows_its_limit_then_refuses_until_it_resets() -> None:
    now = [100.0]
    limiter = FixedWindow(3, 60.0, clock=lambda: now[0])
    assert [limiter.take("a")[:2] for _ in range(3)] == [(True, 2), (True, 1), (True, 0)]
    allowed, remaining, reset = limiter.take("a")
    assert (allowed, remaining, reset) == (False, 0, 60.0)
    # Another caller has its own window.
    assert limiter.take("b")[:2] == (True, 2)
    now[0] += 59.5
    assert limiter.take("a") == (False, 0, 0.5)
    now[0] += 0.5
    assert limiter.take("a")[:2] == (True, 2)
    assert limiter.policy() == "3;w=60"


def test_sign_in_attempts_count_per_address_and_per_key_prefix() -> None:
    now = [0.0]
    limiter = FixedWindow(2, 60.0, clock=lambda: now[0])
    assert [sign_in_refusal(limiter, "a", "p1") for _ in range(2)] == [None, None]
    assert sign_in_refusal(limiter, "a", "p2") == 60  # the address is held
    assert sign_in_refusal(limiter, "b", "p1") == 60  # the prefix is held
    assert sign_in_refusal(limiter, "b", None) is None  # not a key's shape: the address alone counts
    now[0] += 59.9
    assert sign_in_refusal(limiter, "a", None) == 1
    assert sign_in_refusal(None, "a", "p1") is None  # no limit
