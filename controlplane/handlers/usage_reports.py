"""The `report_usage` job: one period's usage sent to Stripe as meter events with the `stripe` library.

Stripe's errors are translated at this edge: a connection error, a rate limit or a server error
is temporary (the job queue retries it after its backoff: an outage delays the report, it never
loses it); a refused request is permanent. Each meter event carries its identifier and the same
value as its Idempotency-Key, so a retry after a lost answer is not counted twice.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

import stripe
from stripe._base_address import BaseAddresses

from controlplane.core.step_errors import PermanentError, TemporaryError
from controlplane.queue.registry import JobContext, JobKind, Verdict
from controlplane.runtime.settings import BillingSettings
from controlplane.services import usage
from controlplane.services.usage import REPORT_USAGE, MeterEvent

# How long a report waits after Stripe failed before it tries again (the queue's attempts count).
RETRY_AFTER_S = 60.0


def client(billing: BillingSettings) -> stripe.StripeClient:
    """A Stripe client for the configured account (and base URL); its own retries are off."""
    if billing.stripe_api_key is None:
        raise PermanentError("CONTROLPLANE_STRIPE_API_KEY is not set: usage cannot be reported")
    base: BaseAddresses = {"api": billing.stripe_api_base.rstrip("/")} if billing.stripe_api_base else {}
    return stripe.StripeClient(
        billing.stripe_api_key.get_secret_value(), base_addresses=base, max_network_retries=0
    )


def event_names(billing: BillingSettings) -> dict[str, str]:
    return {
        "billed": billing.meter_event_billed,
        "storage_only": billing.meter_event_storage_only,
        usage.STORAGE_METER: billing.meter_event_storage_gb,
    }


def sender(api: stripe.StripeClient):  # type: ignore[no-untyped-def]
    async def send(event: MeterEvent) -> None:
        try:
            await asyncio.to_thread(
                api.v1.billing.meter_events.create,
                event.params(),  # type: ignore[arg-type]
                {"idempotency_key": event.identifier},
            )
        except (stripe.APIConnectionError, stripe.RateLimitError) as exc:
            raise TemporaryError(f"Stripe unreachable: {exc.user_message or exc}", RETRY_AFTER_S) from exc
        except stripe.InvalidRequestError as exc:
            if _already_recorded(exc):  # sent before, its answer lost, its idempotency key expired
                return
            raise PermanentError(
                f"Stripe refused meter event {event.identifier}: {exc.user_message or exc}"
            ) from exc
        except stripe.StripeError as exc:
            status = exc.http_status or 0
            if status >= 500 or status in (401, 403, 409):
                raise TemporaryError(
                    f"Stripe answered {status}: {exc.user_message or exc}", RETRY_AFTER_S
                ) from exc
            raise PermanentError(
                f"Stripe refused meter event {event.identifier}: {exc.user_message or exc}"
            ) from exc

    return send


def _already_recorded(exc: stripe.InvalidRequestError) -> bool:
    """Stripe's refusal of a second meter event with an identifier it has (within its window)."""
    message = str(exc.user_message or exc).lower()
    return exc.code == "resource_already_exists" or ("identifier" in message and "already" in message)


async def report_usage(ctx: JobContext) -> Verdict:
    start = datetime.fromisoformat(str(ctx.payload["period_start"]))
    end = datetime.fromisoformat(str(ctx.payload["period_end"]))
    billing = ctx.settings.billing
    send = sender(client(billing))
    async with ctx.pool.connection() as conn:
        count = await usage.report_period(conn, start, end, event_names(billing), send)
    return {"result": "reported", "period_start": start.isoformat(), "meter_events": count}


def kinds(run: bool) -> list[JobKind]:
    """The report job kind: with its handler where jobs run (a worker), without elsewhere."""
    return [JobKind(REPORT_USAGE, report_usage if run else None, max_attempts=50)]
