"""What the use cases take from the settings, built once where the process starts."""

from __future__ import annotations

from dataclasses import dataclass

import provisioners
from controlplane.runtime.settings import Settings


@dataclass(frozen=True)
class Policy:
    # Attempts of the jobs a use case enqueues before they are abandoned.
    job_max_attempts: int = 5
    # The deadline of a new instance's `pending` state.
    pending_deadline_s: float = 300.0
    # The provisioner of this installation (named in refusals), and what it can do: fill a new
    # instance from another's backup (`restore_from`), take the backups the control plane
    # schedules, records and restores in place.
    provisioner: str = "noop"
    supports_restore: bool = False
    supports_backups: bool = False
    # Whether it reports each instance's recoverable window (a restore's point is checked against it).
    reports_windows: bool = False
    # The time a past-due subscription is given before the organisation's instances are suspended.
    grace_period_s: float = 7 * 86400.0

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        kind = settings.provisioner.kind
        return cls(
            job_max_attempts=settings.worker.job_max_attempts,
            pending_deadline_s=settings.reconciler.deadline_s("pending") or 300.0,
            provisioner=kind,
            supports_restore=provisioners.supports_restore(kind),
            supports_backups=provisioners.supports_backups(kind),
            reports_windows=provisioners.reports_windows(kind),
            grace_period_s=settings.billing.grace_period_s,
        )
