"""A scripted HTTP server on loopback for the CLI's client: each request gets the next answer of
the script (the last one again when the script is spent), and is recorded."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.notify_support import serving


@dataclass(frozen=True)
class Answer:
    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeApi:
    script: list[Answer]
    received: list[Received] = field(default_factory=list)
    url: str = ""


@contextmanager
def fake_api(*script: Answer) -> Iterator[FakeApi]:
    api = FakeApi(list(script))
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            with lock:
                api.received.append(
                    Received(
                        self.command,
                        self.path,
                        {k.lower(): v for k, v in self.headers.items()},
                        json.loads(raw) if raw else None,
                    )
                )
                answer = api.script.pop(0) if len(api.script) > 1 else api.script[0]
            body = b"" if answer.body is None else json.dumps(answer.body).encode()
            self.send_response(answer.status)
            content_type = "application/problem+json" if answer.status >= 400 else "application/json"
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in answer.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PATCH = do_DELETE = _answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with serving(Handler) as api.url:
        yield api
