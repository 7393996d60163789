"""How the console words what it shows (pure): durations, times, connection formats, badges.

What a state is called, how severe it is and how it is billed are the lifecycle's metadata, read
from the instance document (`state_info`), never worded here.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from controlplane.api.views import CA_FILE
from controlplane.core import lifecycle

__all__ = [
    "CA_FILE",
    "CONNECTABLE",
    "badge",
    "connection_formats",
    "cpu",
    "duration",
    "every",
    "iso",
    "memory",
    "when",
]
MASK = "\u2022" * 8

# The badge colour of each severity class of the lifecycle metadata: wait, act, fine, suspended.
BADGES: Mapping[str, str] = {
    "transient": "wait",
    "fault": "act",
    "healthy": "fine",
    "suspended": "suspended",
    "terminal": "ended",
}

# States in which the instance's server serves its data (read-only while suspended): its
# connection panel shows. Live states with a server, less those on their way out.
CONNECTABLE = tuple(s for s in lifecycle.WITH_SERVER if s not in lifecycle.GONE_OR_GOING)


def badge(severity: str | None) -> str:
    """The badge colour of a severity class."""
    return BADGES.get(str(severity), "ended")


def duration(seconds: float | None) -> str:
    """A short human duration: 4 s, 2 min 05 s, 3 h 10 min, 2 d 4 h."""
    if seconds is None:
        return "\u2013"
    total = max(0, int(seconds))
    if seconds < 10 and seconds != total:
        return f"{max(0.0, seconds):.1f} s"
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


# Interval units as people say them, the largest first: "every 12 hours", "every day".
_UNITS = (("week", 7 * 86400), ("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1))
# Kubernetes binary suffixes of memory quantities, as bytes.
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def every(seconds: float) -> str:
    """A schedule's interval in the largest whole unit: every day, every 12 hours, every 90 minutes."""
    total = max(1, round(seconds))
    for unit, size in _UNITS:
        if total % size == 0:
            count = total // size
            return f"every {unit}" if count == 1 else f"every {count} {unit}s"
    return f"every {total} seconds"  # pragma: no cover (the seconds unit divides every total)


def cpu(quantity: str) -> str:
    """A Kubernetes CPU quantity in words: 250m is a quarter of a CPU core, 1 is one, 2 two."""
    cores = float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
    shown = f"{cores:g}"
    return f"{shown} CPU core" + ("" if cores == 1 else "s")


def memory(quantity: str) -> str:
    """A Kubernetes memory quantity in binary units: 256Mi is 256 MiB, 1536Mi 1.5 GiB, 1Gi 1 GiB."""
    suffix = quantity[-2:]
    size = float(quantity[:-2]) * _BINARY[suffix] if suffix in _BINARY else float(quantity)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size:g} bytes"


def iso(at: datetime | str | None) -> str:
    if at is None:
        return ""
    if isinstance(at, str):
        return at
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def when(at: datetime | str | None) -> str:
    """A time as people read it in a table: 2026-05-01 10:00:04 UTC."""
    if at is None:
        return "\u2013"
    moment = datetime.fromisoformat(at.replace("Z", "+00:00")) if isinstance(at, str) else at
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def connection_formats(connection: Mapping[str, Any], *, reveal: bool) -> dict[str, str]:
    """The ways to connect: a URI, a `psql` command and environment variables, and an HA plan's
    read-only URI (its standbys); the password masked unless `reveal` (then `connection` must
    carry it)."""
    password = connection.get("password")
    if reveal != (password is not None):
        raise ValueError("reveal the password from a revealed connection, mask it from one without it")
    shown = MASK if password is None else str(password)
    host, port, sslmode = str(connection["host"]), int(connection["port"]), connection.get("sslmode")
    # The API's URI (naming the CA file as sslrootcert when the server is verified): with the
    # password when revealed, else without it (where the mask then goes).
    uri = str(connection["uri"])
    reads = connection.get("read_only") or {}
    read_only = str(reads["uri"]) if reads.get("uri") else None
    if password is None:
        uri = uri.replace("@", f":{MASK}@", 1)
        read_only = None if read_only is None else read_only.replace("@", f":{MASK}@", 1)
    env = {
        "PGHOST": host,
        "PGPORT": str(port),
        "PGDATABASE": str(connection["dbname"]),
        "PGUSER": str(connection["user"]),
        "PGPASSWORD": shown,
    }
    if sslmode:
        env["PGSSLMODE"] = str(sslmode)
    if connection.get("sslrootcert"):
        env["PGSSLROOTCERT"] = str(connection["sslrootcert"])
    formats = {
        "uri": uri,
        "psql": f"psql {shlex.quote(uri)}",
        "env": "\n".join(f"export {name}={shlex.quote(value)}" for name, value in env.items()),
    }
    if read_only is not None:
        formats["read_only"] = read_only
    return formats
