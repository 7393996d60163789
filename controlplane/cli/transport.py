"""HTTP for the CLI on the standard library (`http.client`): a request, its answer read whole, or a
stream read line by line (Server-Sent Events). The CLI does not import an HTTP client library:
httpx alone took longer to import than the rest of a command (`bench/cli_startup.py`).

One connection is kept alive between the requests of a command. A request that is not safe to
send twice (`safe=False`: a POST without an Idempotency-Key, a PATCH) always goes on a fresh
connection, so a kept connection the server has meanwhile closed can never leave it unknown
whether such a request was received. `HTTP_PROXY`, `HTTPS_PROXY` and `NO_PROXY` are honoured.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit

DEFAULT_TIMEOUT_S = 30.0
# What a kept connection the server closed in the meantime raises on its next use.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class TransportError(Exception):
    """No answer: the server cannot be reached, or the connection failed or timed out."""


class ReadTimeout(TransportError):
    """A stream sent nothing for as long as it was given."""


@dataclass(frozen=True)
class Response:
    status: int
    reason: str
    headers: Mapping[str, str] = field(repr=False)
    content: bytes = field(repr=False)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON (ValueError when it is not)."""
        return json.loads(self.content)


class Stream:
    """An answer being received: its status and headers, then its body line by line."""

    def __init__(self, answer: http.client.HTTPResponse) -> None:
        self.status = answer.status
        self.reason = answer.reason
        self.headers: Mapping[str, str] = _headers(answer)
        self._answer = answer

    def read(self) -> Response:
        return Response(self.status, self.reason, self.headers, _read(self._answer.read))

    def lines(self) -> Iterator[str]:
        """Each line without its line ending, until the body ends."""
        while True:
            raw = _read(self._answer.readline)
            if not raw:
                return
            yield raw.decode("utf-8", "replace").rstrip("\r\n")


class Transport:
    """Requests to one base URL (`https://host[:port][/prefix]`), with headers sent on each."""

    def __init__(self, base_url: str, headers: Mapping[str, str], timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise TransportError(f"{base_url!r} is not an http:// or https:// URL")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path
        self.headers = dict(headers)
        self.timeout = timeout
        # The kept connection, in a box the finalizer closes once this transport is gone.
        self._box: list[http.client.HTTPConnection] = []
        weakref.finalize(self, _close_all, self._box)

    @property
    def _kept(self) -> http.client.HTTPConnection | None:
        return self._box[0] if self._box else None

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json_body: Any = None,
        headers: Mapping[str, str] | None = None,
        safe: bool = True,
    ) -> Response:
        """Send one request and read its answer whole (TransportError when none came)."""
        body = None if json_body is None else json.dumps(json_body).encode()
        sent = {**self.headers, **(headers or {})}
        if body is not None:
            sent["Content-Type"] = "application/json"
        target = self._target(path, params)
        reused = self._kept is not None and safe
        if not safe:
            self.close()
        conn = self._kept if reused and self._kept is not None else self._connect(self.timeout)
        try:
            answer = self._send(conn, method, target, body, sent)
        except _STALE:
            self.close()
            if not reused:
                raise TransportError("the connection was closed before an answer came") from None
            # The kept connection had been closed by the server: the request once more, afresh.
            conn = self._connect(self.timeout)
            try:
                answer = self._send(conn, method, target, body, sent)
            except _STALE:
                raise TransportError("the connection was closed before an answer came") from None
        try:
            response = Response(answer.status, answer.reason, _headers(answer), _read(answer.read))
        except TransportError:
            conn.close()
            if conn is self._kept:
                self.close()
            raise
        if answer.will_close:
            conn.close()
            self.close()
        elif conn is not self._kept:
            self.close()
            self._box.append(conn)
        return response

    @contextlib.contextmanager
    def stream(
        self, method: str, path: str, *, headers: Mapping[str, str], read_timeout: float | None
    ) -> Iterator[Stream]:
        """An answer read as it comes, on a connection of its own; each read waits at most
        `read_timeout` seconds (None: for ever), then raises ReadTimeout."""
        conn = self._connect(self.timeout)
        try:
            answer = self._send(conn, method, self._target(path, None), None, {**self.headers, **headers})
            if conn.sock is not None:
                conn.sock.settimeout(read_timeout)
            yield Stream(answer)
        except _STALE as exc:
            raise TransportError(str(exc) or type(exc).__name__) from None
        finally:
            conn.close()

    def close(self) -> None:
        _close_all(self._box)

    def _target(self, path: str, params: Mapping[str, Any] | None) -> str:
        query = {k: str(v) for k, v in (params or {}).items() if v is not None}
        target = f"{self.prefix}{path}" + (f"?{urlencode(query)}" if query else "")
        if self._proxy() and self.scheme == "http":
            return f"{self.base_url.removesuffix(self.prefix)}{target}"  # a proxy takes the whole URL
        return target

    def _proxy(self) -> str | None:
        """The proxy of this URL's scheme from the environment (none for NO_PROXY hosts)."""
        if not any(k.lower().endswith("_proxy") for k in os.environ):
            return None
        import urllib.request

        if urllib.request.proxy_bypass(self.host):
            return None
        return urllib.request.getproxies().get(self.scheme)

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        proxy = self._proxy()
        host, port = self.host, self.port
        if proxy:
            proxied = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            host, port = proxied.hostname or host, proxied.port or 80
        conn: http.client.HTTPConnection
        if self.scheme == "https":
            import ssl

            conn = http.client.HTTPSConnection(
                host, port, timeout=timeout, context=ssl.create_default_context()
            )
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        if proxy and self.scheme == "https":
            conn.set_tunnel(self.host, self.port)
        return conn

    def _send(
        self,
        conn: http.client.HTTPConnection,
        method: str,
        target: str,
        body: bytes | None,
        headers: Mapping[str, str],
    ) -> http.client.HTTPResponse:
        try:
            conn.request(method, target, body=body, headers=dict(headers))
            return conn.getresponse()
        except _STALE:
            conn.close()
            raise
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise TransportError(_why(exc)) from None


def _close_all(box: list[http.client.HTTPConnection]) -> None:
    while box:
        box.pop().close()


def _headers(answer: http.client.HTTPResponse) -> Mapping[str, str]:
    """The answer's headers, looked up by name whatever its case."""
    return {name.lower(): value for name, value in answer.getheaders()}


def _read(read: Any) -> bytes:
    try:
        data: bytes = read()
    except TimeoutError:
        raise ReadTimeout("no answer") from None
    except (OSError, http.client.HTTPException) as exc:
        raise TransportError(_why(exc)) from None
    return data


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
