"""An instance's progress through a transitional state (pure): its operation's named steps with
their state and times, the step running now, when the state is expected to be left, and whether
that time has passed ("taking longer than expected") before its deadline does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from controlplane.core import failures, lifecycle, plans
from controlplane.core.kinds import DEPROVISION, DRIVING_JOB, OPERATION_STEPS, STEP_LABELS
from controlplane.core.records import Instance, StepRecord

# How a step's usual duration is measured: this percentile of its latest finished runs.
PERCENTILE = 0.95
SAMPLE = 200
# Slack on top of the usual durations before a state counts as taking longer than expected.
GRACE_FRACTION = 0.25
GRACE_MIN_S = 2.0

assert set(DRIVING_JOB) == lifecycle.INSTANCE.transitional, "an operation drives every transitional state"


@dataclass(frozen=True)
class LiveJob:
    """The live job of the operation driving a state (before any step is recorded, the only sign)."""

    id: Any
    kind: str
    attempt: int
    state: str


def operation_of(state: str) -> str | None:
    return DRIVING_JOB.get(state)


def steps_of(operation: str, *, skip_final_backup: bool = False, plan: str | None = None) -> tuple[str, ...]:
    """The steps `operation` runs, in order (a deletion without a final backup skips that one; a
    plan of one server has no standbys to start)."""
    steps = OPERATION_STEPS.get(operation, ())
    if operation == DEPROVISION and skip_final_backup:
        return tuple(step for step in steps if step != "final_backup")
    shape = plans.SHAPES.get(plan or "")
    if shape is None or shape.instances <= 1:
        return tuple(step for step in steps if step != "start_standbys")
    return steps


def wanted(instances: Sequence[Instance]) -> list[tuple[str, str]]:
    """The (operation, step) pairs whose usual durations the progress of `instances` needs."""
    pairs: dict[tuple[str, str], None] = {}
    for inst in instances:
        operation = operation_of(inst.state)
        if operation is not None:
            for step in steps_of(operation, skip_final_backup=inst.skip_final_backup, plan=inst.plan):
                pairs[(operation, step)] = None
    return list(pairs)


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round(max(0.0, (end - start).total_seconds()), 3)


def _failure(operation: str, step: str, code: str | None) -> dict[str, object]:
    code = code or failures.given_up(operation, step=step, error_code=None, by_operator=False)
    return failures.reason(code).as_dict()


def _step(
    operation: str,
    name: str,
    records: Sequence[StepRecord],
    job: LiveJob | None,
    expected_s: float | None,
    now: datetime,
) -> dict[str, Any]:
    """One step's entry: its latest attempt's state and times."""
    mine = [r for r in records if r.step == name]
    started = [r for r in mine if r.event == "started"]
    doc: dict[str, Any] = {
        "name": name,
        "label": STEP_LABELS.get(name, name),
        "state": "pending",
        "attempts": len(started),
        "started_at": None,
        "finished_at": None,
        "duration_s": None,
        "expected_s": None if expected_s is None else round(expected_s, 3),
        "failure": None,
    }
    if not mine:
        return doc
    latest = mine[-1]
    if latest.event == "started":
        doc["started_at"] = latest.at
        running = job is not None and job.state == "running" and job.attempt == latest.attempt
        if running:
            doc |= {"state": "running", "duration_s": _seconds(latest.at, now)}
        else:
            # The attempt ended with no word from the step (its worker was lost): it failed.
            doc |= {"state": "failed", "failure": _failure(operation, name, None)}
        return doc
    doc |= {
        "started_at": latest.started_at,
        "finished_at": latest.at,
        "duration_s": _seconds(latest.started_at, latest.at),
    }
    if latest.event == "failed":
        doc |= {"state": "failed", "failure": _failure(operation, name, latest.code)}
    else:
        doc["state"] = "done"
    return doc


def _expected_by(
    inst: Instance, steps: list[dict[str, Any]], records: Sequence[StepRecord]
) -> datetime | None:
    """The state's entry (or the last step's news) plus the usual durations of the steps still to
    run, with some slack; never later than the deadline, and the deadline without history."""
    deadline = inst.deadline_at
    if any(s["expected_s"] is None for s in steps):
        return deadline
    total = sum(float(s["expected_s"]) for s in steps)
    grace = timedelta(seconds=max(GRACE_MIN_S, GRACE_FRACTION * total))
    ahead = [s for s in steps if s["state"] != "done"]
    anchor: datetime
    if ahead and ahead[0]["state"] == "running":
        anchor = ahead[0]["started_at"]
    else:
        anchor = max([inst.state_entered_at, *(r.at for r in records)])
    projected = anchor + timedelta(seconds=sum(float(s["expected_s"]) for s in ahead)) + grace
    return projected if deadline is None else min(projected, deadline)


def progress(
    inst: Instance,
    records: Sequence[StepRecord],
    job: LiveJob | None,
    expected: Mapping[tuple[str, str], float],
    now: datetime,
) -> dict[str, Any] | None:
    """The `progress` of an instance (None outside a transitional state).

    `records` are its step records since it entered its state (oldest first), `job` the live job
    of the operation driving the state, `expected` the usual duration of each (operation, step).
    """
    operation = operation_of(inst.state)
    if operation is None:
        return None
    mine = [r for r in records if r.kind == operation and r.at >= inst.state_entered_at]
    names = steps_of(operation, skip_final_backup=inst.skip_final_backup, plan=inst.plan)
    steps = [_step(operation, n, mine, job, expected.get((operation, n)), now) for n in names]
    last = mine[-1] if mine else None
    current = last.step if last is not None and last.event != "finished" else None
    job_id: Any = None
    attempt: int | None = None
    if job is not None:
        job_id, attempt = job.id, job.attempt
    elif last is not None:
        job_id, attempt = last.job_id, last.attempt
    expected_by = _expected_by(inst, steps, mine)
    return {
        "operation": operation,
        "job_id": job_id,
        "attempt": attempt,
        "started_at": inst.state_entered_at,
        "current_step": current,
        "steps": steps,
        "expected_by": expected_by,
        "deadline_at": inst.deadline_at,
        "overdue": expected_by is not None and now > expected_by,
    }
