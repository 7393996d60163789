"""What the customer commands print of an instance and its lists: the fields, progress and failure
of one, the tables of instances, events and backups (as JSON or YAML with `-o`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from controlplane.cli.client import Api, connection_uri
from controlplane.cli.common import Listing, print_data, print_fields, print_table
from controlplane.core import dbmetrics

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
    """One instance, field by field; the password in its URI hidden (`--uri` and `-o json` give it)."""
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
        uri = connection_uri(api, connection) if api else str(connection.get("uri"))
        rows.append(("uri", masked(uri)))
        if connection.get("pool_mode"):
            # A pooler's stable address; the primary's own beside it, for whole sessions (LISTEN).
            rows.append(("pool_mode", str(connection["pool_mode"])))
            direct = connection.get("direct") or {}
            if direct.get("uri"):
                # Its sslrootcert names the CA file saved here too, as the pooled URI's does.
                direct_uri = (
                    connection_uri(api, connection | {"uri": direct["uri"]}) if api else direct["uri"]
                )
                rows.append(("direct_uri", masked(str(direct_uri))))
        reads = connection.get("read_only") or {}
        if reads.get("uri"):
            # An HA plan's standbys, for reads only (the CA file saved here named as well).
            read_only_uri = connection_uri(api, connection | {"uri": reads["uri"]}) if api else reads["uri"]
            rows.append(("read_only_uri", masked(str(read_only_uri))))
    # The values whole (a URI is copied from here): only very long ones are cut.
    print_fields(rows, max_cell=400)


def masked(uri: str) -> str:
    """A connection URI with its password replaced by ****."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    at = parts.netloc.rindex("@")
    user = parts.netloc[:at].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:****@{parts.netloc[at + 1 :]}"))


def ready_line(instance: dict[str, Any], api: Api, plan: str | None = None) -> None:
    """What `create --wait`, `resize --wait`, `retry --wait` and `restore --wait` print at the end:
    the instance ready (on its plan), then its URI for psql."""
    on_plan = f" on plan {plan}" if plan else ""
    print(f"{instance['name']} ({instance['id']}) is ready{on_plan}")
    if instance.get("connection"):
        print(connection_uri(api, instance["connection"]))


INSTANCES = Listing(("name", "id", "plan", "state", "created_at"), state_column="state")


def _event_view(e: dict[str, Any]) -> dict[str, Any]:
    return {"from": e.get("from_state") or "", "to": e["to_state"], "actor": actor_text(e)}


EVENTS = Listing(("at", "from", "to", "event", "actor", "reason"), _event_view, state_column="to")
BACKUPS = Listing(("id", "kind", "type", "taken_at", "size_bytes"), lambda b: {"type": b.get("type") or ""})


def actor_text(event: dict[str, Any]) -> str:
    """The actor of an event as kind:id (the API's object, or the database's two columns)."""
    actor = event.get("actor")
    if isinstance(actor, dict):
        return f"{actor.get('kind')}:{actor.get('id')}"
    if actor is None and "actor_kind" in event:
        return f"{event['actor_kind']}:{event['actor_id']}"
    return str(actor)


def _moment(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def window_rows(recovery: dict[str, Any]) -> list[tuple[str, str]]:
    """The recoverable window of an instance, as label and value lines (what `backups` prints above
    the list)."""
    archive = recovery.get("archive") or {}
    if archive.get("healthy") is False:
        health = f"FAILING since {archive.get('failing_since') or '?'}"
    else:
        health = {True: "healthy", None: "not known"}[archive.get("healthy")]
    earliest, latest = recovery.get("earliest"), recovery.get("latest")
    if earliest and latest and _moment(latest) < _moment(earliest):
        latest = "not yet: the archive has not reached the end of the first backup"
    rows = [
        ("restorable from", earliest or "nothing yet (no backup held)"),
        ("restorable until", latest or "not known yet"),
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


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], width: int = 40) -> str:
    """The last `width` values as block characters, scaled between their least and greatest; a gap
    where a value is missing."""
    shown = list(values)[-width:]
    known = [v for v in shown if v is not None]
    if not known:
        return ""
    low, high = min(known), max(known)
    span = (high - low) or 1.0
    return "".join(" " if v is None else SPARKS[round((v - low) / span * (len(SPARKS) - 1))] for v in shown)


def show_metrics(series: dict[str, Any], fmt: str) -> None:
    """A database's metrics: a row per metric with its latest value, its range and a sparkline."""
    if fmt != "table":
        print_data(series, fmt)
        return
    points = series["points"]
    rows = []
    for shown in dbmetrics.SHOWN:
        write = shown.write
        values = [p[shown.field] for p in points]
        known = [v for v in values if v is not None]
        latest = write(known[-1]) if known else "-"
        spread = f"{write(min(known))} .. {write(max(known))}" if known else "-"
        rows.append((shown.title.lower(), latest, spread, sparkline(values)))
    print(
        f"{series['from']} .. {series['to']}, every {series['step_s']} s; plan {series['plan']} allows "
        f"{series['max_connections']} connections"
    )
    print_table(rows, ("metric", "latest", "range", "trend"), max_cell=None)
