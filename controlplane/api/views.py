"""How rows become API documents: instance representation, customer actions, opaque cursors."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any, TypeVar
from urllib.parse import quote

from controlplane import backups, lifecycle, plans
from controlplane.api.errors import ProblemError
from controlplane.secretbox import SecretBox

Row = TypeVar("Row")

# The customer actions an instance can list in `allowed_actions`, and what each one does.
CUSTOMER_ACTIONS: dict[str, str] = {
    "resize": "PATCH {plan}: runs now when ready, otherwise as soon as the instance is ready",
    "set_deletion_protection": "PATCH {deletion_protection}: takes effect at once",
    "delete": "DELETE: starts now when ready, degraded or suspended, otherwise as soon as it can",
    "backup": "POST /backups: a backup now, beside the plan's schedule (ready or suspended)",
    "restore": "POST /restore {backup_id | empty}: bring back an instance whose data is lost",
}

# Columns every instance query selects (the table is aliased `i`, organisations `o`).
INSTANCE_COLUMNS = """
    i.*, o.billing_hold,
    extract(epoch FROM clock_timestamp() - i.state_entered_at)::float8 AS time_in_state_s
"""
INSTANCE_FROM = "instances i JOIN organisations o ON o.id = i.org_id"


@cache
def _reachable(state: str) -> frozenset[str]:
    """States reachable from `state` (itself included) along the instance lifecycle."""
    seen = {state}
    frontier = [state]
    while frontier:
        current = frontier.pop()
        for event in lifecycle.INSTANCE.allowed_events(current):
            nxt = lifecycle.INSTANCE.apply(current, event)
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return frozenset(seen)


def can_still_update(state: str) -> bool:
    """A spec change can be applied: the instance can still take the lifecycle's `update` edge."""
    return any("update" in lifecycle.INSTANCE.allowed_events(s) for s in _reachable(state))


def can_still_deprovision(state: str) -> bool:
    return any("deprovision" in lifecycle.INSTANCE.allowed_events(s) for s in _reachable(state))


def can_deprovision_now(state: str) -> bool:
    return "deprovision" in lifecycle.INSTANCE.allowed_events(state)


def allowed_actions(
    state: str, *, deletion_protection: bool, deletion_requested: bool, failure_code: str | None = None
) -> list[str]:
    """Customer actions the instance accepts now, from the lifecycle and the recorded intents."""
    if deletion_requested:
        return []
    actions = []
    if can_still_update(state):
        actions += ["resize", "set_deletion_protection"]
    if can_still_deprovision(state) and not deletion_protection:
        actions.append("delete")
    if backups.can_back_up(state):
        actions.append("backup")
    if backups.can_restore({"state": state, "failure_code": failure_code}):
        actions.append("restore")
    return actions


def row_actions(row: Mapping[str, Any]) -> list[str]:
    return allowed_actions(
        row["state"],
        deletion_protection=row["deletion_protection"],
        deletion_requested=row["deletion_requested_at"] is not None,
        failure_code=row.get("failure_code"),
    )


def connection(row: Mapping[str, Any], box: SecretBox, *, reveal: bool) -> dict[str, Any] | None:
    info = row.get("connection")
    if not info:
        return None
    host, port = str(info.get("host", "")), int(info.get("port", 5432))
    dbname, user = str(info.get("dbname", "postgres")), str(info.get("user", "postgres"))
    password = box.decrypt(row["secret"]) if reveal and row.get("secret") else None
    credentials = quote(user, safe="") + (f":{quote(password, safe='')}" if password is not None else "")
    sslmode = info.get("sslmode")
    query = f"?sslmode={quote(str(sslmode), safe='')}" if sslmode else ""
    return {
        "host": host,
        "port": port,
        "dbname": dbname,
        "user": user,
        "password": password,
        "sslmode": sslmode,
        "ca_certificate": info.get("ca_certificate"),
        "uri": f"postgresql://{credentials}@{host}:{port}/{quote(dbname, safe='')}{query}",
    }


def instance(row: Mapping[str, Any], box: SecretBox, *, reveal: bool = False) -> dict[str, Any]:
    """The API representation of an instance row (joined with its organisation's billing hold)."""
    spec = row["spec"] or {}
    shape = plans.SHAPES.get(str(spec.get("plan")))
    return {
        "id": row["id"],
        "name": row["name"],
        "plan": spec.get("plan"),
        "observed_plan": (row["observed_spec"] or {}).get("plan"),
        "region": spec.get("region"),
        "instances": None if shape is None else shape.instances,
        "storage_gb": None if shape is None else max(shape.storage_gb, int(spec.get("storage_gb") or 0)),
        "restore_from": spec.get("restore_from"),
        "state": row["state"],
        "state_version": row["state_version"],
        "progress": row["progress"],
        "allowed_actions": row_actions(row),
        "spec_generation": row["spec_generation"],
        "observed_generation": row["observed_generation"],
        "failed_generation": row["failed_generation"],
        "state_entered_at": row["state_entered_at"],
        "time_in_state_s": max(0.0, round(float(row["time_in_state_s"]), 3)),
        "deadline_at": row["deadline_at"],
        "failure_reason": row["failure_reason"],
        "failure_code": row.get("failure_code"),
        "deletion_protection": row["deletion_protection"],
        "billing_hold": row["billing_hold"],
        "deletion_requested": row["deletion_requested_at"] is not None,
        "connection": connection(row, box, reveal=reveal),
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
    }


def event(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "at": row["at"],
        "from_state": row["from_state"],
        "to_state": row["to_state"],
        "event": row["event"],
        "actor": {"kind": row["actor_kind"], "id": row["actor_id"]},
        "reason": row["reason"],
        "detail": row["detail"] or {},
        "seq": row["seq"],
        "hash": bytes(row["hash"]).hex(),
    }


def etag(state_version: int) -> str:
    return f'"{state_version}"'


def matches(if_match: str, state_version: int) -> bool:
    """RFC 9110 If-Match against the instance's ETag (weak tags compare by their value here)."""
    for tag in (t.strip() for t in if_match.split(",")):
        if tag == "*" or tag.removeprefix("W/").strip('"') == str(state_version):
            return True
    return False


def encode_cursor(*values: Any) -> str:
    raw = json.dumps([str(v) for v in values], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, arity: int) -> list[str]:
    """The values packed by encode_cursor, or a 422 naming the `cursor` parameter."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        values = json.loads(raw)
    except (binascii.Error, ValueError, UnicodeDecodeError):
        values = None
    if not isinstance(values, list) or len(values) != arity or not all(isinstance(v, str) for v in values):
        raise bad_cursor()
    return values


def after_id(cursor: str | None) -> int:
    """Where a page ordered by id starts: after the id in `cursor` (0 for the first page)."""
    if not cursor:
        return 0
    (after_s,) = decode_cursor(cursor, 1)
    if not after_s.isdigit():
        raise bad_cursor()
    return int(after_s)


def id_cursor(row: Mapping[str, Any]) -> str:
    return encode_cursor(row["id"])


def page_of(
    rows: Sequence[Row], limit: int, cursor_of: Callable[[Row], str]
) -> tuple[Sequence[Row], str | None]:
    """Rows fetched one beyond `limit`: the page, and the cursor after its last row if more follow."""
    page = rows[:limit]
    return page, cursor_of(page[-1]) if len(rows) > limit else None


def bad_cursor() -> ProblemError:
    return ProblemError(
        "validation",
        "query.cursor: not a cursor returned by this API",
        errors=[{"field": "query.cursor", "message": "not a cursor returned by this API"}],
    )
