"""What `--wait` prints of an instance's steps: each line once, in the order the steps moved."""

from __future__ import annotations

import pytest

from controlplane.cli.follow import Follower


def _event(event: str, attempt: int = 1, duration_s: float | None = None) -> dict[str, object]:
    failure = {"message": "The storage for this database could not be allocated."}
    return {
        "event": event,
        "step": "allocate_storage",
        "label": "Allocate storage",
        "attempt": attempt,
        "duration_s": duration_s,
        "failure": failure if event == "failed" else None,
    }


def _lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]


def test_a_start_announced_after_its_attempt_ended_is_not_printed(capsys: pytest.CaptureFixture[str]) -> None:
    follower = Follower(as_json=False)
    follower.step(_event("failed", duration_s=0.03))
    follower.step(_event("started"))
    follower.step(_event("failed", duration_s=0.03))
    assert _lines(capsys) == [
        "  Allocate storage: failed after 0.03s: The storage for this database could not be allocated."
    ]


def test_a_new_attempt_is_printed_after_the_failed_one(capsys: pytest.CaptureFixture[str]) -> None:
    follower = Follower(as_json=False)
    follower.step(_event("started"))
    follower.step(_event("failed", duration_s=0.5))
    follower.step(_event("started", attempt=2))
    follower.step(_event("finished", attempt=2, duration_s=1.25))
    assert _lines(capsys) == [
        "  Allocate storage: started",
        "  Allocate storage: failed after 0.50s: The storage for this database could not be allocated.",
        "  Allocate storage: started (attempt 2)",
        "  Allocate storage: done in 1.25s, attempt 2",
    ]
