"""What the control plane publishes about its lifecycle (pure): the tables with their metadata, the
deadlines in force, the failure reasons, the steps of each operation and the customer actions.

`GET /v1/lifecycle` and `controlplane lifecycle --json` publish this one document; the API's
instance views, the CLI and the console read the same tables (never a copy of them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from controlplane.core import actions, failures, lifecycle
from controlplane.core.kinds import OPERATION_STEPS, STEP_LABELS


def lifecycle_document(deadline_s: Callable[[str], float | None]) -> dict[str, Any]:
    """The document, with the deadline of each transitional state as `deadline_s` gives it (the
    installation's settings)."""
    instance = lifecycle.INSTANCE.as_dict()
    states = instance["state_info"]
    assert isinstance(states, dict)
    for state, info in states.items():
        info["deadline_s"] = deadline_s(state) if state in lifecycle.INSTANCE.transitional else None
    return {
        "instance": instance,
        "job": lifecycle.JOB.as_dict(),
        "customer_actions": dict(actions.CUSTOMER_ACTIONS),
        "severities": dict(lifecycle.SEVERITIES),
        "billing_classes": dict(lifecycle.BILLING_CLASSES),
        "failure_reasons": [reason.published() for reason in failures.REASONS.values()],
        "steps": {
            operation: [{"name": step, "label": STEP_LABELS[step]} for step in steps]
            for operation, steps in OPERATION_STEPS.items()
        },
    }


def reason_table() -> str:
    """The failure reasons as the Markdown table docs/api.md carries.

    `python -m controlplane.core.reference` prints it.
    """
    lines = ["| code | appears on | retry helps | customer message | hint |", "|---|---|---|---|---|"]
    for reason in failures.REASONS.values():
        states = ", ".join(reason.states)
        helps = "yes" if reason.retryable else "no"
        lines.append(f"| `{reason.code}` | {states} | {helps} | {reason.message} | {reason.hint} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reason_table())
