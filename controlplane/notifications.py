"""Notifications to customers: which instance events they hear of, the consumer that queues a
delivery per target and event, and the `deliver_notification` job (signed webhooks, email).

The `notifier` consumer turns each instance event a customer hears of (`notice_type`) into one
delivery row per subscribed target (unique per target and event: a replayed event creates
nothing) and one job per new delivery, in the batch's transaction. The job sends it: a webhook
as a signed POST (`controlplane.signatures`), an email through the configured SMTP server. A
failure schedules the next attempt as a new job after a growing delay, until the retry window
(a day by default) is over; then the delivery is given up and its target disabled. An endpoint's
address is checked at registration and again before every delivery (server-side request
forgery: https only, and no private, loopback or link-local address unless the operator allows).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
import smtplib
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Any
from urllib.parse import urlsplit

import httpx

from controlplane import failures, jobs, metrics, signatures, sql
from controlplane.consumers import Consumer, LogEvent
from controlplane.db import AsyncConn
from controlplane.domain_errors import InvalidRequest
from controlplane.errors import PermanentError
from controlplane.registry import JobContext, JobKind, Verdict
from controlplane.secretbox import load_box
from controlplane.settings import NotificationSettings
from controlplane.transitions import Actor

NOTIFIER = "notifier"
DELIVER = "deliver_notification"
ACTOR = Actor("system", NOTIFIER)

# The events a customer can subscribe to, with what each means.
EVENT_TYPES: Mapping[str, str] = {
    "instance.ready": "the database was created and accepts connections",
    "instance.failed": "the database failed (with the typed reason: code, message, hint)",
    "instance.degraded": "the database is degraded (with the typed reason)",
    "instance.recovered": "a degraded database is healthy again",
    "instance.suspended": "the database is read-only (a billing hold)",
    "instance.resumed": "a suspended database is writable again",
    "instance.deleted": "the database was deleted (with its final backup's name)",
    "instance.deadline_overdue": "an operation missed its deadline and was given up (with the reason)",
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
    failure = failures.reason(str(code)).as_dict() if event.to_state in ("failed", "degraded") else None
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
        },
    }


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


def address_allowed(address: str) -> bool:
    """A public unicast address: not private, loopback, link-local, multicast, reserved or unspecified."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def check_url(url: str, policy: NotificationSettings) -> None:
    """Refuse a webhook URL customers may not use (InvalidRequest on the `url` field): its scheme,
    then every address its host resolves to now (so it is checked again at each delivery)."""
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
        return
    try:
        infos = socket.getaddrinfo(parts.hostname, port or 443, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, ValueError):  # no such name, or not a name at all
        raise InvalidRequest("url", f"the host {parts.hostname[:100]} does not resolve") from None
    refused = sorted({str(info[4][0]) for info in infos if not address_allowed(str(info[4][0]))})
    if refused:
        raise InvalidRequest("url", f"the host {parts.hostname} resolves to an address that is not public")


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


def new_secret() -> str:
    return "whsec_" + secrets.token_urlsafe(32)


# ---- the delivery job -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    ok: bool
    status: int | None
    error: str | None


def retry_delay(attempts: int) -> float:
    return float(min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** max(0, attempts - 1)))


async def post_webhook(
    url: str, secret: str, body: bytes, headers: Mapping[str, str], policy: NotificationSettings
) -> Attempt:
    try:
        await asyncio.to_thread(check_url, url, policy)
    except InvalidRequest as exc:
        return Attempt(False, None, f"refused: {exc}")
    timestamp = int(time.time())
    sent = {
        "Content-Type": "application/json",
        "User-Agent": "controlplane-webhooks/1",
        signatures.SIGNATURE_HEADER: signatures.sign(secret, timestamp, body),
        **headers,
    }
    try:
        async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False) as client:
            response = await client.post(url, content=body, headers=sent)
    except httpx.HTTPError as exc:
        return Attempt(False, None, f"{type(exc).__name__}: {exc}"[:500])
    if 200 <= response.status_code < 300:
        return Attempt(True, response.status_code, None)
    return Attempt(False, response.status_code, f"answered {response.status_code}")


def _send_email(policy: NotificationSettings, to: str, body: Mapping[str, Any]) -> None:
    message = EmailMessage()
    instance = body["data"].get("instance")
    if instance is None:
        message["Subject"] = f"{body['type']}: {body['data'].get('message', '')}"
    else:
        message["Subject"] = f"{body['type']}: {instance['name']} is {instance['state']}"
    message["From"] = policy.smtp_from
    message["To"] = to
    message["X-Controlplane-Event-Id"] = body["id"]
    failure = body["data"].get("failure")
    lines = [
        f"Database {instance['name']} ({instance['id']}, plan {instance['plan']}) is now {instance['state']}."
        if instance is not None
        else str(body["data"].get("message", "")),
    ]
    if failure:
        lines += ["", f"{failure['message']} ({failure['code']})", failure["hint"]]
    lines += ["", f"Event {body['id']} ({body['type']}).", "", json.dumps(body, indent=2)]
    message.set_content("\n".join(lines))
    assert policy.smtp_host is not None
    with smtplib.SMTP(policy.smtp_host, policy.smtp_port, timeout=policy.timeout_s) as smtp:
        smtp.send_message(message)


async def send_email(policy: NotificationSettings, to: str, body: Mapping[str, Any]) -> Attempt:
    if policy.smtp_host is None:
        return Attempt(False, None, "no SMTP server is configured (CONTROLPLANE_SMTP_HOST)")
    try:
        await asyncio.to_thread(_send_email, policy, to, body)
    except (OSError, smtplib.SMTPException) as exc:
        return Attempt(False, None, f"{type(exc).__name__}: {exc}"[:500])
    return Attempt(True, None, None)


async def deliver(ctx: JobContext) -> Verdict:
    delivery_id = uuid.UUID(str(ctx.payload["delivery_id"]))
    policy = ctx.settings.notifications
    async with ctx.pool.connection() as conn:
        cursor = await conn.execute(sql.DELIVERY_TO_SEND, {"id": delivery_id})
        row = await cursor.fetchone()
    if row is None:
        raise PermanentError(f"delivery {delivery_id} does not exist")
    if row["state"] != "pending":
        return {"result": "nothing to do", "state": row["state"]}
    if row["deleted_at"] is not None or row["disabled_at"] is not None:
        return await _settle(ctx, row, Attempt(False, None, "the target was deleted or disabled"), final=True)
    if row["kind"] == "webhook":
        body = json.dumps(row["body"]).encode()
        headers = {
            signatures.EVENT_ID_HEADER: row["event_id"],
            signatures.EVENT_TYPE_HEADER: row["event_type"],
            signatures.DELIVERY_ID_HEADER: str(row["id"]),
        }
        secret = load_box(ctx.settings).decrypt(row["secret"])
        attempt = await post_webhook(row["address"], secret, body, headers, policy)
    else:
        attempt = await send_email(policy, row["address"], row["body"])
    return await _settle(ctx, row, attempt, final=False)


async def _settle(ctx: JobContext, row: Mapping[str, Any], attempt: Attempt, *, final: bool) -> Verdict:
    """Record the attempt; on failure, the next attempt's job, or (window over) give up and disable."""
    policy = ctx.settings.notifications
    channel = str(row["kind"])
    async with ctx.pool.connection() as conn, conn.transaction():
        state = "delivered" if attempt.ok else "pending"
        cursor = await conn.execute(
            sql.DELIVERY_ATTEMPTED,
            {"id": row["id"], "status": attempt.status, "error": attempt.error, "state": state},
        )
        done = await cursor.fetchone()
        assert done is not None
        if attempt.ok:
            metrics.NOTIFICATION_DELIVERIES.labels(channel, "delivered").inc()
            return {"result": "delivered", "status": attempt.status, "attempts": done["attempts"]}
        remaining = policy.retry_window_s - float(done["age_s"])
        if final or remaining <= 0:
            await conn.execute(sql.GIVE_UP_DELIVERY, {"id": row["id"]})
            if not final:
                reason = f"deliveries failed for {policy.retry_window_s:.0f} s; last: {attempt.error}"
                await conn.execute(sql.DISABLE_TARGET, {"id": row["target_id"], "reason": reason})
            metrics.NOTIFICATION_DELIVERIES.labels(channel, "given_up").inc()
            return {"result": "given up", "error": attempt.error, "attempts": done["attempts"]}
        delay = min(retry_delay(int(done["attempts"])), remaining)
        await jobs.enqueue(conn, deliver_job(row["id"], delay), ACTOR)
        metrics.NOTIFICATION_DELIVERIES.labels(channel, "retry").inc()
        return {"result": "retry scheduled", "error": attempt.error, "attempts": done["attempts"]}


def kinds(run: bool) -> list[JobKind]:
    """The delivery job kind: with its handler where jobs run (a worker), without elsewhere."""
    return [JobKind(DELIVER, deliver if run else None, max_attempts=20)]
