"""What the use cases take from the settings, built once where the process starts."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.settings import Settings


@dataclass(frozen=True)
class Policy:
    # Attempts of the jobs a use case enqueues before they are abandoned.
    job_max_attempts: int = 5
    # The deadline of a new instance's `pending` state.
    pending_deadline_s: float = 300.0

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        return cls(
            job_max_attempts=settings.worker.job_max_attempts,
            pending_deadline_s=settings.reconciler.deadline_s("pending") or 300.0,
        )
