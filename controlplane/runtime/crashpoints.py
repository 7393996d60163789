"""Crash points: named places where a process kills itself (SIGKILL), for the fault tests.

A point is armed by CONTROLPLANE_CRASH_POINTS (comma-separated names from POINTS); in production
the setting is empty and `reached` costs one set lookup. Each point sits where a crash would split
an operation if it were not one transaction, or where the work is done and its record not yet
written: the tests kill a real process there and check that nothing is lost or done twice.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable

log = logging.getLogger(__name__)

POINTS = {
    "worker.after_handler": "a job's handler returned (its last step committed), before the job's finish",
    "webhook.after_record": "a Stripe event inserted, before its effect is applied and its jobs enqueued",
    "api.create.before_commit": "an instance, its job and the idempotent answer written, not yet committed",
    "api.create.after_commit": "an instance created and committed, before its answer is sent",
}

_armed: frozenset[str] = frozenset()


def parse(text: str | None) -> frozenset[str]:
    """The names in `text` (ValueError naming an unknown one)."""
    names = frozenset(part.strip() for part in (text or "").split(",") if part.strip())
    unknown = sorted(names - POINTS.keys())
    if unknown:
        raise ValueError(f"unknown crash point {unknown[0]!r}; known: {', '.join(sorted(POINTS))}")
    return names


def arm(names: Iterable[str]) -> None:
    """Arm `names` in this process (from the settings, at the start of a role)."""
    global _armed
    _armed = frozenset(names)
    for name in sorted(_armed):
        log.warning("crash point armed: %s (%s)", name, POINTS[name])


def reached(name: str) -> None:
    """Kill this process at once if `name` is armed: no cleanup, no commit, no answer."""
    if name in _armed:
        log.critical("crash point %s reached: killing this process", name)
        os.kill(os.getpid(), signal.SIGKILL)
