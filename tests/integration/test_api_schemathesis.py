"""schemathesis against the app's own OpenAPI schema, in-process: no 5xx, every response conforms."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import positive_data_acceptance

from controlplane.api.app import create_app
from controlplane.db import connection as db
from controlplane.runtime.settings import Settings
from controlplane.services import tenants
from tests.api_support import WEBHOOK_SECRET

# Cases per operation; FUZZ_EXAMPLES=500 widens the search for a deeper run.
MAX_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "30"))
# A watch of an instance that exists stays open until the instance ends: its case reads for this
# long, then validates what came (the snapshot event) instead of waiting out the general timeout.
WATCH_READ_S = 1.0
# The same generated cases on every run, so that the suite's verdict does not depend on the seed;
# widen the search by raising FUZZ_EXAMPLES or turning derandomize off.
FUZZ = settings(
    max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)

# Statuses the API documents beyond schemathesis' defaults: 413 for a body over the size limit
# (schema-valid or not) and 412 for an If-Match that names another state_version.
CONFIG = SchemathesisConfig.from_dict(
    {
        "checks": {
            "negative_data_rejection": {
                "expected-statuses": [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429, "5xx"]
            },
            "positive_data_acceptance": {
                "expected-statuses": ["2xx", "3xx", 401, 403, 404, 409, 412, 413, 429, "5xx"]
            },
        }
    }
)


async def _keys(url: str) -> tuple[str, str]:
    conn = await db.connect(url)
    async with conn:
        admin = await tenants.create_admin_key(conn)
        _, key = await tenants.create_org(conn, "fuzzed", "cus_fuzzed")
    return admin.plaintext, key.plaintext


@pytest.fixture
def keys(settings: Settings) -> tuple[str, str]:
    return asyncio.run(_keys(settings.database.url_value or ""))


@pytest.fixture
def api_schema(settings: Settings, keys: tuple[str, str]) -> Iterator[Any]:
    # Endpoint hosts are not resolved (no DNS in the fuzz); the address checks have their own tests.
    configured = settings.replace(
        stripe_webhook_secret=WEBHOOK_SECRET, max_body_bytes=4096, notify_allow_private=True
    )
    app = create_app(configured)
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)
    finally:
        asgi.shutdown_lifespans()


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(autouse=True)
def _node_id_for_lazy_schemas(request: pytest.FixtureRequest) -> None:
    """schemathesis' lazy schemas rename the test node through `_nodeid`, which pytest 9 lacks."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


def _fresh_idempotency_key(case: Any) -> None:
    """Generated cases share few key values; a reused key with another body is a 422 by design
    (tested in test_api_idempotency), so each case gets a key of its own."""
    for name in list(case.headers or {}):
        if name.lower() == "idempotency-key" and isinstance(case.headers[name], str):
            case.headers[name] = uuid.uuid4().hex


def _call(case: Any, key: str) -> None:
    _fresh_idempotency_key(case)
    # A cursor is an opaque token only the API makes, a webhook needs Stripe's signature, an
    # endpoint's host must resolve to public addresses, a usage window must end after it starts
    # and a metrics range must lie within what is kept: anything else is refused (422, 400),
    # which the "schema-valid data is accepted" check cannot know.
    semantic = ("/v1/webhooks/stripe", "/v1/webhook-endpoints", "/v1/usage")
    opaque = (
        "cursor" in (case.query or {})
        or ((case.method == "POST" or case.path == "/v1/usage") and case.path in semantic)
        or case.path.endswith("/metrics")
    )
    excluded = [positive_data_acceptance] if opaque else []
    timeout = WATCH_READ_S if case.path.endswith("/watch") else 10
    case.call_and_validate(
        headers={"Authorization": f"Bearer {key}"}, excluded_checks=excluded, timeout=timeout
    )


@schema.parametrize()
@FUZZ
def test_with_a_customer_key(case: Any, keys: tuple[str, str]) -> None:
    _call(case, keys[1])


@schema.parametrize()
@FUZZ
def test_with_an_admin_key(case: Any, keys: tuple[str, str]) -> None:
    _call(case, keys[0])
