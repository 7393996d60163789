"""What the customer commands print of an instance and its lists: the fields, progress and failure
of one, the tables of instances, events and backups (as JSON or YAML with `-o`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from controlplane.cli.client import Api, connection_uri
from controlplane.cli.common import print_data, print_table

LIST_COLUMNS = ("name", "id", "plan", "state", "created_at")
# Shown in their own rows by `instances show` (the rest, field by field).
SHOWN_APART = ("connection", "progress", "failure", "failure_reason", "failure_code", "state_info")


def _duration(seconds: Any) -> str:
    return "" if seconds is None else f"{float(seconds):.2f}s"


def step_summary(step: dict[str, Any]) -> str:
    """One step of a progress as a person reads it: done in 0.52s, running for 3.10s, failed ..."""
    state = step["state"]
    tries = f", attempt {step['attempts']}" if step.get("attempts", 0) > 1 else ""
    if state == "done":
        return f"done in {_duration(step['duration_s'])}{tries}"
    if state == "running":
        usual = f" (usually {_duration(step['expected_s'])})" if step.get("expected_s") is not None else ""
        return f"running for {_duration(step['duration_s'])}{usual}{tries}"
    if state == "failed":
        failure = step.get("failure") or {}
        return f"failed after {_duration(step['duration_s'])}{tries}: {failure.get('message', 'no reason')}"
    return "pending"


def failure_rows(failure: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        ("failure", f"{failure['code']}: {failure['message']}"),
        ("retryable", "yes" if failure["retryable"] else "no"),
        ("hint", failure["hint"]),
    ]


def progress_rows(progress: dict[str, Any]) -> list[tuple[str, str]]:
    attempt = f", attempt {progress['attempt']}" if progress.get("attempt") else ""
    late = "; taking longer than expected" if progress.get("overdue") else ""
    rows = [("progress", f"{progress['operation']}{attempt}{late}")]
    rows += [(f"  {step['label']}", step_summary(step)) for step in progress["steps"]]
    rows += [
        ("expected_by", progress.get("expected_by") or ""),
        ("deadline_at", progress.get("deadline_at") or ""),
    ]
    return rows


def show_instance(instance: dict[str, Any], fmt: str, api: Api | None = None) -> None:
    if fmt != "table":
        print_data(instance, fmt)
        return
    rows: list[tuple[str, Any]] = []
    for key, value in instance.items():
        if key in SHOWN_APART:
            continue
        rows.append((key, value))
        if key == "state" and instance.get("state_info"):
            info = instance["state_info"]
            rows.append(("status", f"{info['label']} ({info['severity']}; billing: {info['billing']})"))
    if instance.get("failure"):
        rows += failure_rows(instance["failure"])
    if instance.get("progress"):
        rows += progress_rows(instance["progress"])
    connection = instance.get("connection")
    if connection:
        rows.append(("uri", connection_uri(api, connection) if api else connection.get("uri")))
    # The values whole (a URI is copied from here): only very long ones are cut.
    print_table(rows, ("field", "value"), max_cell=400)


def show_items(
    items: list[dict[str, Any]],
    fmt: str,
    columns: Sequence[str],
    row: Callable[[dict[str, Any]], Sequence[Any]],
    state_column: str | None = None,
) -> None:
    """A list as a table of `columns`, a `row` an item; with `-o json|yaml`, the items as they are."""
    if fmt != "table":
        print_data(items, fmt)
        return
    print_table([row(item) for item in items], columns, state_column=state_column)


def show_instances(items: list[dict[str, Any]], fmt: str) -> None:
    show_items(items, fmt, LIST_COLUMNS, lambda item: [item.get(c) for c in LIST_COLUMNS], "state")


def show_events(items: list[dict[str, Any]], fmt: str) -> None:
    columns = ("at", "from", "to", "event", "actor", "reason")
    show_items(items, fmt, columns, _event_row, "to")


def _event_row(e: dict[str, Any]) -> tuple[Any, ...]:
    return (e["at"], e.get("from_state") or "", e["to_state"], e["event"], _actor(e), e.get("reason") or "")


def _actor(event: dict[str, Any]) -> str:
    actor = event.get("actor")
    if isinstance(actor, dict):
        return f"{actor.get('kind')}:{actor.get('id')}"
    return str(actor)


def show_backups(items: list[dict[str, Any]], fmt: str) -> None:
    columns = ("id", "kind", "type", "taken_at", "size_bytes")
    show_items(
        items,
        fmt,
        columns,
        lambda b: (b["id"], b["kind"], b.get("type") or "", b["taken_at"], b["size_bytes"]),
    )


def window_rows(recovery: dict[str, Any]) -> list[tuple[str, str]]:
    """The recoverable window of an instance, as label and value lines (what `backups` prints above
    the list)."""
    archive = recovery.get("archive") or {}
    if archive.get("healthy") is False:
        health = f"FAILING since {archive.get('failing_since') or '?'}"
    else:
        health = {True: "healthy", None: "not known"}[archive.get("healthy")]
    rows = [
        ("restorable from", recovery.get("earliest") or "nothing yet (no backup held)"),
        ("restorable until", recovery.get("latest") or "not known yet"),
        ("archive", health),
    ]
    if archive.get("lag_s") is not None:
        rows.append(("archive lag", f"{archive['lag_s']:.1f} s, {archive.get('lag_bytes') or 0} bytes"))
    if recovery.get("retained_until"):
        rows.append(("kept until", str(recovery["retained_until"])))
    if recovery.get("verified_at"):
        verdict = "sound" if recovery.get("verified") else "PROBLEMS FOUND"
        rows.append(("last verified", f"{recovery['verified_at']} ({verdict})"))
    return rows
