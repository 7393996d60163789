"""Logging: one JSON object per line (or plain text), carrying the current request id."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import UTC, datetime

# The request id of the API request being served (also written into audit rows).
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

# The record's own attributes, and extras that are not for a JSON line: uvicorn's `color_message`
# (its message again, with terminal colour codes) would put escape sequences into the logs.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = REQUEST_ID.get()
        if request_id:
            entry["request_id"] = request_id
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def first_line(exc: BaseException) -> str:
    """An error's first line for a log line (its type's name when it has no text)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def configure(level: str = "INFO", fmt: str = "json") -> None:
    """Install one stderr handler on the root logger (replacing earlier ones)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
