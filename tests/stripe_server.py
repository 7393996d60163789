"""A Stripe API stand-in on loopback for the metering tests: it records the meter events the real
`stripe` client sends, checks their shape against the Billing Meter Events API, and can fail the
first requests (an outage)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs

from tests.notify_support import serving

API_KEY = "sk_test_metering"
PATH = "/v1/billing/meter_events"


@dataclass
class Recorder:
    fail_first: int = 0
    requests: int = 0
    failed: int = 0
    # Accepted meter events by identifier, and the responses by Idempotency-Key (replayed).
    accepted: dict[str, dict[str, Any]] = field(default_factory=dict)
    by_key: dict[str, dict[str, Any]] = field(default_factory=dict)
    duplicates: int = 0
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def shape_problems(form: dict[str, list[str]], headers: Any) -> list[str]:
    """What does not match the API: required fields, the payload's keys, types and limits."""
    problems = []
    one = {key: values[0] for key, values in form.items() if len(values) == 1}
    if headers.get("Authorization") != f"Bearer {API_KEY}":
        problems.append("no Bearer secret key")
    if headers.get("Content-Type", "").split(";")[0] != "application/x-www-form-urlencoded":
        problems.append("not form-encoded")
    name = one.get("event_name", "")
    if not name or len(name) > 100:
        problems.append("event_name missing or over 100 characters")
    if not one.get("payload[stripe_customer_id]", "").startswith("cus_"):
        problems.append("payload[stripe_customer_id] missing")
    if not one.get("payload[value]", "").isdigit():
        problems.append("payload[value] is not a whole number")
    identifier = one.get("identifier", "")
    if not identifier or len(identifier) > 100:
        problems.append("identifier missing or over 100 characters")
    stamp = one.get("timestamp", "")
    if not stamp.isdigit() or not (time.time() - 35 * 86400 <= int(stamp) <= time.time() + 300):
        problems.append("timestamp not within the past 35 days")
    if headers.get("Idempotency-Key") != identifier:
        problems.append("Idempotency-Key is not the identifier")
    return problems


def _handler(recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Request-Id", "req_test")
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            form = parse_qs(self.rfile.read(length).decode(), keep_blank_values=True)
            with recorder.lock:
                recorder.requests += 1
                if self.path != PATH:
                    recorder.problems.append(f"unexpected path {self.path}")
                    return self._answer(
                        404, {"error": {"type": "invalid_request_error", "message": "no such path"}}
                    )
                if recorder.failed < recorder.fail_first:
                    recorder.failed += 1
                    return self._answer(500, {"error": {"type": "api_error", "message": "outage"}})
                key = self.headers.get("Idempotency-Key", "")
                if key in recorder.by_key:
                    return self._answer(200, recorder.by_key[key])
                recorder.problems += shape_problems(form, self.headers)
                identifier = form.get("identifier", [""])[0]
                if identifier in recorder.accepted:
                    recorder.duplicates += 1
                    message = "An event with this identifier already exists."
                    return self._answer(400, {"error": {"type": "invalid_request_error", "message": message}})
                event = {
                    "object": "billing.meter_event",
                    "created": int(time.time()),
                    "event_name": form["event_name"][0],
                    "identifier": identifier,
                    "livemode": False,
                    "payload": {k[8:-1]: v[0] for k, v in form.items() if k.startswith("payload[")},
                    "timestamp": int(form["timestamp"][0]),
                }
                recorder.accepted[identifier] = event
                recorder.by_key[key] = event
                return self._answer(200, event)

    return Handler


@contextmanager
def stripe_server(fail_first: int = 0) -> Iterator[tuple[str, Recorder]]:
    recorder = Recorder(fail_first=fail_first)
    with serving(_handler(recorder)) as base:
        yield base, recorder
