"""The `deliver_notification` job: sends one queued delivery (a signed webhook POST, or an email) and
records the attempt; a failure schedules the next attempt after a growing delay, until the retry
window is over (then the delivery is given up and its target disabled).

A receiver cannot hold more than its own: an attempt takes at most `notify_timeout_s` in all
(however slowly the answer comes), only the answer's status is read (never its body), the
deliveries run in slots of their own in each worker (`notify_concurrency`, beside the slots of the
instances' jobs), and at most `notify_endpoint_concurrency` of them at once to one endpoint (another
waits, queued again, for it to answer).
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import smtplib
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Any

import httpx

from controlplane.core import webhook_signatures as signatures
from controlplane.core.refusals import InvalidRequest
from controlplane.core.retry import RetryPolicy
from controlplane.core.step_errors import PermanentError
from controlplane.db import job_rows as jobs
from controlplane.db import sql
from controlplane.queue.registry import JobContext, JobKind, Verdict
from controlplane.runtime import metrics
from controlplane.runtime.secretbox import load_box
from controlplane.runtime.settings import NotificationSettings, Settings
from controlplane.services.notices import (
    ACTOR,
    DELIVER,
    FIRST_RETRY_S,
    MAX_RETRY_S,
    check_url,
    deliver_job,
)

# Webhook deliveries being sent by this process, per endpoint (at most notify_endpoint_concurrency).
SENDING: collections.Counter[uuid.UUID] = collections.Counter()


@dataclass(frozen=True)
class Attempt:
    ok: bool
    status: int | None
    error: str | None


def retry_delay(attempts: int, rand: Callable[[], float] = random.random) -> float:
    """Seconds before the next try after `attempts` failed ones: doubling from FIRST_RETRY_S up to
    MAX_RETRY_S, with the jobs' "equal jitter" (half the step, plus up to the other half), so that
    the deliveries of one outage do not all come back at once. `rand` is in [0, 1)."""
    return RetryPolicy(FIRST_RETRY_S, MAX_RETRY_S, rand).backoff_s(attempts)


async def post_webhook(
    url: str, secret: str, body: bytes, headers: Mapping[str, str], policy: NotificationSettings
) -> Attempt:
    """One attempt, `policy.timeout_s` at most in all: the URL checked, the POST, the answer's status."""
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _post(url, secret, body, headers, policy)
    except TimeoutError:
        return Attempt(False, None, f"no answer within {policy.timeout_s:g} s")


async def _post(
    url: str, secret: str, body: bytes, headers: Mapping[str, str], policy: NotificationSettings
) -> Attempt:
    try:
        addresses = await asyncio.to_thread(check_url, url, policy)
    except InvalidRequest as exc:
        return Attempt(False, None, f"refused: {exc}")
    timestamp = int(time.time())
    sent = {
        "Content-Type": "application/json",
        "User-Agent": "controlplane-webhooks/1",
        **signatures.signed_headers(secret, headers.get(signatures.EVENT_ID_HEADER, ""), timestamp, body),
        **headers,
    }
    target = httpx.URL(url)
    if addresses:  # to the addresses checked, under the URL's name: Host, TLS server name, certificate
        named = {"Host": target.netloc.decode("ascii")}
        server_name = {"sni_hostname": target.raw_host.decode("ascii")}
        tries = [(target.copy_with(host=address), {**sent, **named}, server_name) for address in addresses]
    else:  # any address is allowed: by name
        tries = [(target, sent, {})]
    try:
        async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False) as client:
            status = await _status(client, body, tries)
    except httpx.HTTPError as exc:
        return Attempt(False, None, f"{type(exc).__name__}: {exc}"[:500])
    if 200 <= status < 300:
        return Attempt(True, status, None)
    return Attempt(False, status, f"answered {status}")


async def _status(
    client: httpx.AsyncClient, body: bytes, tries: list[tuple[httpx.URL, dict[str, str], dict[str, Any]]]
) -> int:
    """The answer's status, from the first of `tries` that can be reached; its body is never read
    (the response is streamed and closed)."""
    for number, (url, headers, extensions) in enumerate(tries, 1):
        try:
            async with client.stream(
                "POST", url, content=body, headers=headers, extensions=extensions
            ) as response:
                return response.status_code
        except httpx.ConnectError:
            if number == len(tries):
                raise
    raise ValueError("nothing to try")


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
        target = row["target_id"]
        if SENDING[target] >= policy.endpoint_concurrency:
            return await _wait_for_endpoint(ctx, row)
        body = json.dumps(row["body"]).encode()
        headers = {
            signatures.EVENT_ID_HEADER: row["event_id"],
            signatures.EVENT_TYPE_HEADER: row["event_type"],
            signatures.DELIVERY_ID_HEADER: str(row["id"]),
        }
        secret = load_box(ctx.settings).decrypt(row["secret"])
        SENDING[target] += 1
        try:
            attempt = await post_webhook(row["address"], secret, body, headers, policy)
        finally:
            SENDING[target] -= 1
            if SENDING[target] <= 0:
                del SENDING[target]
    else:
        attempt = await send_email(policy, row["address"], row["body"])
    return await _settle(ctx, row, attempt, final=False)


async def _wait_for_endpoint(ctx: JobContext, row: Mapping[str, Any]) -> Verdict:
    """The endpoint is answering as many of this process's deliveries as it may: this one is queued
    again, not attempted, for later than an attempt can take (spread, so that a burst of them for one
    endpoint does not come back at once), and leaves its slot."""
    delay = ctx.settings.notifications.timeout_s * random.uniform(1.0, 2.0)  # noqa: S311 (jitter)
    async with ctx.pool.connection() as conn:
        await jobs.enqueue(conn, deliver_job(row["id"], delay), ACTOR)
    return {"result": "endpoint busy", "again_in_s": round(delay, 3)}


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
    return [JobKind(DELIVER, deliver if run else None, max_attempts=20, own_slots=_slots)]


def _slots(settings: Settings) -> int:
    return settings.notifications.concurrency
