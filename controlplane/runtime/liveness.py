"""Whether a background role (worker, reconciler) is doing its work, for its health endpoints.

The role's own loop reports here: `turned()` each time round (a loop that hangs stops reporting)
and `reached(ok)` after each round trip to the database. `/healthz` is the loop having turned
within `stale_after_s`; `/readyz` is that and the last round trip having succeeded. A thread that
merely answers HTTP (the metrics server) proves neither, so neither is taken from it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Health:
    ok: bool
    detail: str


class Liveness:
    def __init__(self, role: str = "role", stale_after_s: float = 60.0) -> None:
        self.role = role
        self.stale_after_s = stale_after_s
        self._lock = threading.Lock()
        self._turned: float | None = None
        self._reached: bool | None = None

    def configure(self, role: str, stale_after_s: float) -> None:
        with self._lock:
            self.role, self.stale_after_s = role, stale_after_s
            self._turned, self._reached = None, None

    def turned(self, now: float | None = None) -> None:
        with self._lock:
            self._turned = time.monotonic() if now is None else now

    def reached(self, ok: bool) -> None:
        with self._lock:
            self._reached = ok

    def live(self, now: float | None = None) -> Health:
        with self._lock:
            turned = self._turned
        if turned is None:
            return Health(False, f"{self.role}: its loop has not turned yet")
        age = (time.monotonic() if now is None else now) - turned
        if age > self.stale_after_s:
            return Health(
                False,
                f"{self.role}: its loop last turned {age:.0f} s ago (stale after {self.stale_after_s:.0f} s)",
            )
        return Health(True, f"{self.role}: its loop turned {age:.1f} s ago")

    def ready(self, now: float | None = None) -> Health:
        alive = self.live(now)
        with self._lock:
            reached = self._reached
        if not alive.ok:
            return alive
        if reached is False:
            return Health(False, f"{self.role}: its last round trip to the database failed")
        return Health(
            reached is True, alive.detail if reached else f"{self.role}: no database round trip yet"
        )


# The process's one role loop (each process runs one background role).
LOOP = Liveness()
