"""What a job step tells the engine by raising (pure): retry later, give up, or stop (a stale fence).

An error may carry a stable code (`controlplane.core.failures`) saying what went wrong in terms a
customer can be told (a quota, a spec that can never be provisioned); the message is the raw
text, for SREs only.
"""

from __future__ import annotations


class StepError(Exception):
    """Root of the errors a step raises on purpose; the worker turns each into the job's next move."""

    # The failure code this error stands for (None: the operation and its step decide).
    code: str | None = None


class TemporaryError(StepError):
    """The step failed but may work later: the job is retried after `delay_s` (or the backoff)."""

    def __init__(self, message: str, delay_s: float | None = None, *, code: str | None = None) -> None:
        super().__init__(message)
        self.delay_s = delay_s
        if code is not None:
            self.code = code


class PermanentError(StepError):
    """The step can never succeed: the job is abandoned at once."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class StaleFence(StepError):
    """A resource has seen a higher fence: this worker no longer owns the job and must stop."""

    def __init__(self, resource: str, fence: int, highest: int) -> None:
        super().__init__(f"{resource}: fence {fence} is lower than {highest}, already seen")
        self.resource = resource
        self.fence = fence
        self.highest = highest
