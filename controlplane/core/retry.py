"""The retry policy of failed jobs (pure): exponential backoff with jitter, and retry versus abandon."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

ErrorKind = Literal["temporary", "permanent"]
RetryAction = Literal["retry", "abandon"]
ERROR_KINDS: tuple[ErrorKind, ...] = ("temporary", "permanent")


@dataclass(frozen=True)
class RetryDecision:
    """What happens to a failed job, and when (seconds after the failure)."""

    action: RetryAction
    delay_s: float
    why: str


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff doubles per attempt from `base_delay_s` up to `max_delay_s`, with "equal jitter".

    The delay of attempt n is d/2 + U(0, d/2) with d = min(max, base * 2**(n-1)): never less than
    half the exponential step (so retries really back off) and spread over the other half (so jobs
    that failed together do not return together). `rand` returns a float in [0, 1).
    """

    base_delay_s: float = 1.0
    max_delay_s: float = 300.0
    rand: Callable[[], float] = random.random

    def backoff_s(self, attempt: int) -> float:
        step = min(self.max_delay_s, self.base_delay_s * 2.0 ** max(0, attempt - 1))
        return min(self.max_delay_s, step / 2 + self.rand() * step / 2)

    def decide(
        self,
        *,
        attempt: int,
        max_attempts: int,
        error_kind: str,
        requested_delay_s: float | None = None,
    ) -> RetryDecision:
        """Abandon after a permanent error or the last attempt; otherwise retry after a delay.

        A delay the handler asked for (TemporaryError(delay_s)) replaces the backoff, capped at
        `max_delay_s`.
        """
        if error_kind == "permanent":
            return RetryDecision("abandon", 0.0, "permanent error")
        if error_kind != "temporary":
            raise ValueError(f"unknown error kind {error_kind!r}; expected one of {ERROR_KINDS}")
        if attempt >= max_attempts:
            return RetryDecision("abandon", 0.0, f"attempt {attempt} of {max_attempts} failed")
        if requested_delay_s is not None:
            delay = min(self.max_delay_s, max(0.0, requested_delay_s))
            return RetryDecision("retry", delay, "delay requested by the handler")
        return RetryDecision("retry", self.backoff_s(attempt), f"backoff after attempt {attempt}")
