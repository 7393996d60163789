"""Opaque cursors of paged lists (pure): encoded positions, decoded back or refused."""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from controlplane.core.refusals import InvalidRequest

Row = TypeVar("Row")


def created_cursor(created_at: datetime, row_id: Any) -> str:
    """The cursor after a row of a list ordered by (created_at, id)."""
    return encode_cursor(created_at.isoformat(), row_id)


def after_created(cursor: str | None) -> tuple[datetime, uuid.UUID] | None:
    """Where a page of a list ordered by (created_at, id) starts (None: at the beginning)."""
    if not cursor:
        return None
    created_s, id_s = decode_cursor(cursor, 2)
    try:
        return datetime.fromisoformat(created_s), uuid.UUID(id_s)
    except ValueError:
        raise bad_cursor() from None


def encode_cursor(*values: Any) -> str:
    raw = json.dumps([str(v) for v in values], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, arity: int) -> list[str]:
    """The values packed by encode_cursor, or a refusal naming the `cursor` parameter."""
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


def bad_cursor() -> InvalidRequest:
    return InvalidRequest("cursor", "not a cursor returned by this API", location="query")
