"""Notices to customers: which instance events they hear of, the consumer that queues a delivery
per target and event, and the checks of a target's address (the job that sends a delivery is
`controlplane.handlers.delivery`).

The `notifier` consumer turns each instance event a customer hears of (`notice_type`) into one
delivery row per subscribed target (unique per target and event: a replayed event creates
nothing) and one job per new delivery, in the batch's transaction. The job sends it: a webhook
as a signed POST (`controlplane.core.webhook_signatures`), an email through the configured SMTP server. A
failure schedules the next attempt as a new job after a growing delay, until the retry window
(a day by default) is over; then the delivery is given up and its target disabled. An endpoint's
address is checked at registration and again before every delivery (server-side request
forgery: https only, and only globally reachable addresses unless the operator allows); the
delivery connects to the addresses it checked.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from controlplane.core import failures
from controlplane.core.refusals import InvalidRequest
from controlplane.db import job_rows as jobs
from controlplane.db import sql
from controlplane.db.connection import AsyncConn
from controlplane.db.transitions import Actor
from controlplane.queue.consumers import Consumer, LogEvent
from controlplane.runtime.settings import NotificationSettings

NOTIFIER = "notifier"
DELIVER = "deliver_notification"
ACTOR = Actor("system", NOTIFIER)

# The events a customer can subscribe to, with what each means.
EVENT_TYPES: Mapping[str, str] = {
    "instance.ready": "the database was created and accepts connections",
    "instance.failed": "the database failed (with the typed reason: code, message, hint)",
    "instance.degraded": "the database is degraded (with the typed reason)",
    "instance.recovered": "a degraded database is healthy again",
    "instance.suspended": (
        "the database is read-only (a billing hold; or its data beyond its allocation, with the typed reason)"
    ),
    "instance.failover": "a standby took over from a lost primary (who was promoted, at which WAL position)",
    "instance.resumed": "a suspended database is writable again",
    "instance.deleted": "the database was deleted (with its final backup's name)",
    "instance.deadline_overdue": "an operation missed its deadline and was given up (with the reason)",
    "instance.storage_grown": "storage autoscaling grew the database's allocation (with why)",
    "instance.storage_full": "nearly full at the plan's maximum storage: nothing will grow it",
    "billing.past_due": "the subscription is past due: the databases become read-only at `suspends_at`",
}
# The first delay after a failed delivery, doubled per attempt up to the largest.
FIRST_RETRY_S = 30.0
MAX_RETRY_S = 3600.0


def notice_types(event: LogEvent, deadline_codes: frozenset[str]) -> list[str]:
    """The notification types an instance event raises (none for most moves)."""
    found: list[str] = []
    if event.to_state == "ready":
        by_source = {
            "provisioning": "instance.ready",
            "degraded": "instance.recovered",
            "suspended": "instance.resumed",
        }
        if event.from_state in by_source:
            found.append(by_source[event.from_state])
        if event.from_state == "degraded" and isinstance(event.detail.get("failover"), Mapping):
            found.append("instance.failover")
    elif event.to_state in ("failed", "degraded", "suspended", "deleted"):
        found.append(f"instance.{event.to_state}")
    code = event.detail.get("code")
    if event.to_state in ("failed", "degraded") and isinstance(code, str) and code in deadline_codes:
        found.append("instance.deadline_overdue")
    return found


DEADLINE_CODES = frozenset(
    failures.deadline_missed(state) for state in ("pending", "provisioning", "updating", "deprovisioning")
) - {failures.UNKNOWN}


def event_id(event: LogEvent, notice: str) -> str:
    """The notification's id: the log event's, so a receiver de-duplicates by it."""
    return f"evt_{event.id}" if notice != "instance.deadline_overdue" else f"evt_{event.id}_overdue"


def body_of(event: LogEvent, notice: str, instance: Mapping[str, Any]) -> dict[str, Any]:
    code = event.detail.get("code") or instance.get("failure_code")
    # A suspension says why when it has a code (storage_full); a billing hold has none.
    coded = event.to_state == "suspended" and isinstance(event.detail.get("code"), str)
    failure = (
        failures.reason(str(code)).as_dict() if event.to_state in ("failed", "degraded") or coded else None
    )
    return {
        "id": event_id(event, notice),
        "type": notice,
        "created": int(event.at.timestamp()),
        "organisation_id": str(event.org_id),
        "data": {
            "instance": {
                "id": str(event.instance_id),
                "name": instance["name"],
                "plan": instance["plan"],
                "state": event.to_state,
                "previous_state": event.from_state,
                "state_version": event.state_version,
            },
            "failure": failure,
            "backup": event.detail.get("backup") if event.to_state == "deleted" else None,
            "failover": _failover(event) if notice == "instance.failover" else None,
        },
    }


def _failover(event: LogEvent) -> dict[str, Any]:
    """What a customer is told of a failover: who took over, at which WAL position, how long writes
    were refused (never the servers' paths)."""
    failover = event.detail["failover"]
    keys = ("promoted", "fenced", "lsn", "writes_refused_s")
    return {key: failover.get(key) for key in keys}


async def notify(conn: AsyncConn, event: LogEvent) -> None:
    """The notifier's effect: one delivery (and its job) per subscribed target, once per event."""
    types = notice_types(event, DEADLINE_CODES)
    if not types:
        return
    cursor = await conn.execute(sql.INSTANCE_FOR_NOTICE, {"id": event.instance_id})
    instance = await cursor.fetchone()
    assert instance is not None
    for notice in types:
        body = body_of(event, notice, instance)
        await queue_notice(conn, event.org_id, event.instance_id, notice, body)


async def queue_notice(
    conn: AsyncConn, org_id: uuid.UUID, instance_id: uuid.UUID | None, notice: str, body: Mapping[str, Any]
) -> int:
    """One delivery (and its job) per target of the organisation subscribed to `notice`, unless one
    exists for the body's id already; returns how many were queued."""
    cursor = await conn.execute(sql.TARGETS_FOR_EVENT, {"org": org_id, "type": notice})
    queued = 0
    for target in await cursor.fetchall():
        cursor = await conn.execute(
            sql.CREATE_DELIVERY,
            {
                "target": target["id"],
                "org": org_id,
                "instance": instance_id,
                "event_id": body["id"],
                "type": notice,
                "body": json.dumps(body),
            },
        )
        created = await cursor.fetchone()
        if created is not None:
            await jobs.enqueue(conn, deliver_job(created["id"]), ACTOR)
            queued += 1
    return queued


def deliver_job(delivery_id: uuid.UUID, delay_s: float = 0.0) -> jobs.NewJob:
    return jobs.NewJob(
        DELIVER, None, payload={"delivery_id": str(delivery_id)}, max_attempts=20, delay_s=delay_s
    )


def consumer() -> Consumer:
    return Consumer(NOTIFIER, notify)


# ---- endpoint addresses (server-side request forgery) ---------------------------------------------


# Not globally reachable (IANA's special-purpose registry) though the `is_global` of some Python
# versions says they are: IETF protocol assignments (192.0.0.8 among them), the 6to4 relays'
# anycast, IPv6 site-local, NAT64 for local use.
NOT_GLOBAL = tuple(
    ipaddress.ip_network(net) for net in ("192.0.0.0/24", "192.88.99.0/24", "fec0::/10", "64:ff9b:1::/48")
)
# NAT64's well-known prefix: an IPv4 address in its last 32 bits.
NAT64 = ipaddress.ip_network("64:ff9b::/96")


def wrapped_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 one carries to: 6to4, Teredo (its server and client), NAT64."""
    found = [ip.sixtofour] if ip.sixtofour is not None else []
    found += list(ip.teredo or ())
    if ip in NAT64:
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return found


def address_allowed(address: str) -> bool:
    """A globally reachable unicast address (`is_global`, and none of NOT_GLOBAL), and so is every
    IPv4 address it carries to; an IPv4-mapped address is its IPv4 one."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return address_allowed(str(ip.ipv4_mapped))
        if not all(address_allowed(str(inner)) for inner in wrapped_ipv4(ip)):
            return False
    return (
        ip.is_global
        and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified or ip.is_loopback or ip.is_link_local)
        and not any(ip in net for net in NOT_GLOBAL)
    )


def check_url(url: str, policy: NotificationSettings) -> list[str]:
    """Refuse a webhook URL customers may not use (InvalidRequest on the `url` field): its scheme,
    then every address its host resolves to now (so it is checked again at each delivery). Returns
    those addresses, for the delivery to connect to (no second look-up between the check and the
    connection), or none where the operator allows any address (`allow_private`).

    A name that does not resolve is refused with the same words as one that resolves to an address
    that is not public: the answer tells nothing of the names that resolve inside the network."""
    allowed = ("https", "http") if policy.allow_http else ("https",)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # a bracketed host that is no IPv6 address, a port out of range
        raise InvalidRequest("url", "the URL is not a valid URL") from None
    if parts.scheme not in allowed or not parts.hostname:
        raise InvalidRequest("url", f"the URL must be {' or '.join(allowed)}://host/...")
    if parts.username or parts.password:
        raise InvalidRequest("url", "the URL must not carry credentials")
    if policy.allow_private:
        return []
    refused = InvalidRequest("url", f"the host {parts.hostname[:100]} must resolve to public addresses only")
    try:
        infos = socket.getaddrinfo(parts.hostname, port or 443, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, ValueError):  # no such name, or not a name at all
        raise refused from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses or not all(address_allowed(address) for address in addresses):
        raise refused
    return addresses


def check_email(address: str) -> None:
    local, at, domain = address.partition("@")
    if not at or not local or "." not in domain or any(c.isspace() for c in address) or len(address) > 254:
        raise InvalidRequest("address", "the address must be an email address, like ops@example.com")


def check_event_types(types: list[str]) -> None:
    unknown = [t for t in types if t not in EVENT_TYPES and t != "*"]
    if unknown or not types:
        raise InvalidRequest(
            "event_types",
            f"event types must be among {', '.join(EVENT_TYPES)} (or '*'); not {unknown or 'none'}",
        )
