"""Fault specifications (pure): which provisioner step fails, hangs or kills its process, and when.

`CONTROLPLANE_FAULTS` is parsed here, below the settings; `provisioners.faults` injects them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from controlplane.core.kinds import STEP_LABELS

STEPS = tuple(STEP_LABELS)

FaultAction = Literal["fail", "fail_permanent", "quota", "hang", "kill"]
ACTIONS: tuple[FaultAction, ...] = ("fail", "fail_permanent", "quota", "hang", "kill")


class FaultSpecError(ValueError):
    """A fault description that cannot be parsed."""


@dataclass(frozen=True)
class Fault:
    """At `step`, on job attempt `attempt` (None: every attempt), do `action`.

    `when` is "before" the real step runs, "after" it ran (its work is done but the caller never
    learns), or a number of seconds into the step ("during": the real step keeps running).
    """

    step: str
    action: FaultAction
    attempt: int | None = 1
    when: str = "before"

    @property
    def during_s(self) -> float | None:
        return None if self.when in ("before", "after") else float(self.when)

    def matches(self, step: str, attempt: int) -> bool:
        return self.step == step and (self.attempt is None or self.attempt == attempt)

    def __str__(self) -> str:
        attempt = "*" if self.attempt is None else str(self.attempt)
        return f"{self.step}:{self.action}:{attempt}:{self.when}"


def parse_faults(text: str | None) -> list[Fault]:
    """`step:action[:attempt[:when]]`, comma-separated; attempt `*` means every attempt.

    Example: `initialize_database:kill:1:after,apply_plan:fail_permanent`.
    """
    faults: list[Fault] = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split(":")
        if len(parts) < 2 or len(parts) > 4:
            raise FaultSpecError(f"fault {item!r}: expected step:action[:attempt[:when]]")
        step, action = parts[0], parts[1]
        if step not in (*STEPS, "observe"):
            raise FaultSpecError(f"fault {item!r}: unknown step {step!r}")
        if action not in ACTIONS:
            raise FaultSpecError(f"fault {item!r}: action must be one of {', '.join(ACTIONS)}")
        attempt: int | None = 1
        if len(parts) > 2:
            attempt = None if parts[2] == "*" else int(parts[2])
        when = parts[3] if len(parts) > 3 else "before"
        if when not in ("before", "after"):
            try:
                float(when)
            except ValueError:
                raise FaultSpecError(f"fault {item!r}: when is before, after or seconds") from None
        faults.append(Fault(step, action, attempt, when))
    return faults
