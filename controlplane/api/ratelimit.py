"""Rate limits per API key, counted in this API process (a fixed window per key): 429 with
Retry-After beyond the limit, and the RateLimit-Policy and RateLimit headers on every answer.

In-process on purpose (docs/decisions.md): no database round trip per request, and a limit of N
per process is N times the replicas for the service, which the settings say. The Stripe webhook route has
its own limit, shared by every sender. Health probes and metrics are not limited. The console's
sign-in form counts its attempts in a window of its own, per client address and per key prefix
(`sign_in_refusal`); its page shows the refusal.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.problems import _HttpMiddleware, problem_response

UNLIMITED_PATHS = ("/healthz", "/readyz", "/metrics")
WEBHOOK_PREFIX = "/v1/webhooks/"
# Buckets kept at most; the oldest windows are dropped first beyond it (many keys or addresses).
MAX_BUCKETS = 100_000


@dataclass
class Window:
    started: float
    used: int = 0


@dataclass
class FixedWindow:
    """`limit` requests per `window_s` for each bucket; `clock` is injected (seconds, monotonic)."""

    limit: int
    window_s: float
    clock: Callable[[], float] = time.monotonic
    windows: dict[str, Window] = field(default_factory=dict)

    def take(self, bucket: str) -> tuple[bool, int, float]:
        """Count one request of `bucket`: (allowed, remaining, seconds until the window resets)."""
        now = self.clock()
        window = self.windows.get(bucket)
        if window is None or now - window.started >= self.window_s:
            if window is None and len(self.windows) >= MAX_BUCKETS:
                self._drop_stale(now)
            window = self.windows[bucket] = Window(now)
        reset = max(0.0, window.started + self.window_s - now)
        if window.used >= self.limit:
            return False, 0, reset
        window.used += 1
        return True, self.limit - window.used, reset

    def _drop_stale(self, now: float) -> None:
        for key in [k for k, w in self.windows.items() if now - w.started >= self.window_s]:
            del self.windows[key]
        while len(self.windows) >= MAX_BUCKETS:
            del self.windows[next(iter(self.windows))]

    def policy(self) -> str:
        return f"{self.limit};w={self.window_s:g}"


def bucket_of(scope: Scope) -> str:
    """The caller a request counts for: its bearer key (hashed), else its client address."""
    authorization = dict(scope["headers"]).get(b"authorization", b"")
    if authorization[:7].lower() == b"bearer " and authorization[7:].strip():
        return "key:" + hashlib.sha256(authorization[7:].strip()).hexdigest()[:32]
    client = scope.get("client")
    return f"addr:{client[0] if client else 'unknown'}"


class RateLimit(_HttpMiddleware):
    """Counts each /v1 request against its caller's window (the webhook route against its own)."""

    def __init__(self, app: ASGIApp, keys: FixedWindow | None, webhook: FixedWindow | None) -> None:
        super().__init__(app)
        self.keys = keys
        self.webhook = webhook

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        limiter, bucket = self._limiter(path, scope)
        if limiter is None:
            await self.app(scope, receive, send)
            return
        allowed, remaining, reset = limiter.take(bucket)
        reset_s = str(math.ceil(reset))
        headers = {
            "RateLimit-Policy": limiter.policy(),
            "RateLimit": f"limit={limiter.limit}, remaining={remaining}, reset={reset_s}",
        }
        if not allowed:
            detail = f"more than {limiter.limit} requests in {limiter.window_s:g}s; retry in {reset_s}s"
            state = scope.get("state", {})
            response = problem_response(
                "rate-limited",
                detail,
                instance=path,
                headers={**headers, "Retry-After": reset_s},
                request_id=state.get("request_id"),
            )
            await response(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, with_headers)

    def _limiter(self, path: str, scope: Scope) -> tuple[FixedWindow | None, str]:
        if path.startswith(WEBHOOK_PREFIX):
            return self.webhook, "webhook"
        if not path.startswith("/v1/") or path.startswith(UNLIMITED_PATHS):
            return None, ""
        return self.keys, bucket_of(scope)


def window(limit: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> FixedWindow | None:
    """A limiter of `limit` per `window_s` (None: a limit of 0 is none)."""
    return FixedWindow(limit, window_s, clock) if limit > 0 else None


def limiters(
    rate_limit: int, window_s: float, webhook_limit: int, clock: Callable[[], float] = time.monotonic
) -> tuple[FixedWindow | None, FixedWindow | None]:
    """The per-key and the webhook limiter of the settings (None: that one is off)."""
    return window(rate_limit, window_s, clock), window(webhook_limit, window_s, clock)


def sign_in_refusal(limiter: FixedWindow | None, address: str, prefix: str | None) -> int | None:
    """Count one sign-in attempt from `address` with a key of `prefix` (None: not a key's shape):
    the seconds to wait (whole, at least 1) when either has had its limit this window, else None."""
    if limiter is None:
        return None
    buckets = [f"addr:{address}", *([f"prefix:{prefix}"] if prefix is not None else [])]
    refused = [reset for allowed, _, reset in (limiter.take(bucket) for bucket in buckets) if not allowed]
    return max(1, math.ceil(max(refused))) if refused else None
