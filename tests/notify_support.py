"""Receivers for the notification tests: a webhook endpoint and an SMTP server, both on loopback,
and an asyncio server for receivers that misbehave (drip, hold, answer too much)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from email import message_from_bytes
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from aiosmtpd.controller import Controller


@dataclass
class Received:
    status: int = 200
    requests: list[tuple[dict[str, str], bytes]] = field(default_factory=list)


@contextmanager
def webhook_receiver(status: int = 200) -> Iterator[tuple[str, Received]]:
    received = Received(status)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            received.requests.append((dict(self.headers.items()), body))
            self.send_response(received.status)
            self.send_header("Content-Length", "0")
            self.end_headers()

    with serving(Handler) as base:
        yield f"{base}/hooks/controlplane", received


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """An HTTP server on a free loopback port, in a thread, for the duration: its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@dataclass
class Mailbox:
    messages: list[Message] = field(default_factory=list)

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.messages.append(message_from_bytes(envelope.content))
        return "250 OK"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def smtp_server() -> Iterator[tuple[int, Mailbox]]:
    mailbox = Mailbox()
    port = free_port()
    controller = Controller(mailbox, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield port, mailbox
    finally:
        controller.stop()


Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def loopback_server(answer: Answer) -> AsyncIterator[str]:
    """An HTTP server on a free loopback port, in the test's event loop, whose every connection
    `answer` handles: its base URL. On exit the connections still open are cancelled."""
    open_tasks: set[asyncio.Task[Any]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        open_tasks.add(task)
        try:
            await answer(reader, writer)
        except ConnectionError:  # the client went away
            pass
        finally:
            open_tasks.discard(task)
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        left = list(open_tasks)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    """One HTTP/1.1 request: its target, its headers (lower-case names) and its body."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    fields = (line.partition(":") for line in head[1:] if line)
    headers = {name.strip().lower(): value.strip() for name, _, value in fields}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return head[0].split(" ")[1], headers, body
