"""Streaming replication between an instance's servers (pure): their names, and the settings that
make one the primary whose commits wait for a standby, the others its streaming standbys.

An HA plan's instance runs `members` servers: member 0 is its first (every instance has it), the
others standbys seeded from the primary. Commits are synchronous with `ANY 1` of the others: an
acknowledged commit is on two servers. Every server lists all the others, so whichever is promoted
needs no new setting to wait for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from provisioners.local.database import ADMIN_USER


def member_name(member: int) -> str:
    """A server's name among its instance's: its `application_name` as a standby."""
    return f"member{member}"


def synchronous_names(members: int, member: int) -> str:
    """`synchronous_standby_names` of `member`: any one of the other servers confirms each commit."""
    others = ", ".join(f'"{member_name(other)}"' for other in range(members) if other != member)
    return f"ANY 1 ({others})"


@dataclass(frozen=True)
class Upstream:
    """Where a standby streams from: its primary's address, and how it authenticates (the
    control plane's admin role over TLS, the server's certificate checked against the CA)."""

    host: str
    port: int
    password: str
    ca_file: str


def replication_settings(
    members: int, member: int, primary: int, upstream: Upstream | None, *, synchronous: bool
) -> dict[str, str]:
    """The replication settings of `member` among `members` servers whose primary is `primary`.

    One server: none. The primary waits for a standby once its standbys were started
    (`synchronous`; before that there is none to wait for); a standby streams from `upstream`,
    and waits for another once it is promoted.
    """
    if members <= 1:
        return {}
    settings = {
        # What a standby that was away may still need from the primary's own WAL.
        "wal_keep_size": "256MB",
        # A standby's takes effect once it is promoted: its commits then wait for another.
        "synchronous_standby_names": (
            synchronous_names(members, member) if synchronous or member != primary else ""
        ),
    }
    if member != primary and upstream is not None:
        settings["primary_conninfo"] = conninfo(upstream, member)
        settings["recovery_target_timeline"] = "latest"
    return settings


def conninfo(upstream: Upstream, member: int) -> str:
    parts = {
        "host": upstream.host,
        "port": str(upstream.port),
        "user": ADMIN_USER,
        "password": upstream.password,
        "sslmode": "verify-full",
        "sslrootcert": upstream.ca_file,
        # No client certificate: none looked for in the home of whoever started the server.
        "sslcert": f"{upstream.ca_file}.no-client-certificate",
        "sslkey": f"{upstream.ca_file}.no-client-key",
        "application_name": member_name(member),
        "connect_timeout": "3",
    }
    return " ".join(f"{key}={value}" for key, value in parts.items())
