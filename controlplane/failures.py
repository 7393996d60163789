"""Stable codes for what is wrong with an instance (pure data): kept in `instances.failure_code`
beside the reason's words, shown in the API, and what alerts and runbooks key on."""

from __future__ import annotations

# The instance's storage is gone: it comes back only restored from a backup, or re-created empty
# once someone accepted the loss (never by a heal).
DATA_LOST = "data_lost"

CODES: dict[str, str] = {
    DATA_LOST: "the instance's data is lost; it is restored from a backup, or re-created empty once accepted",
}
