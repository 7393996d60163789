"""A TCP proxy on loopback between a client and PostgreSQL (or any server) that a test repoints,
partitions or makes lie: what a Kubernetes Service does when its endpoint moves, what a network
partition does (bytes held, delivered late once it heals, as TCP retransmits), and an ambiguous
COMMIT (forwarded, its reply dropped, the connection cut)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit


@dataclass
class _Link:
    """One proxied connection: its two ends, and whether the server's next reply is to be dropped."""

    writers: tuple[asyncio.StreamWriter, ...] = ()
    drop_reply: bool = False


class Proxy:
    """Forwards every connection to `target_port`; `repoint` cuts them all and sends new ones elsewhere."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._drop_marker: bytes | None = None
        self.dropped_replies = 0

    def url(self, database_url: str) -> str:
        """`database_url` with its host and port replaced by the proxy's."""
        parts = urlsplit(database_url)
        netloc = parts.netloc.rsplit("@", 1)
        address = f"{self.host}:{self.port}"
        return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{address}" if len(netloc) == 2 else address))

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            client_writer.close()  # nothing behind the Service right now: the client sees a reset
            return
        self._writers |= {client_writer, upstream_writer}
        link = _Link((client_writer, upstream_writer))
        try:
            await asyncio.gather(
                self._pipe(client_reader, upstream_writer, link, upstream=True),
                self._pipe(upstream_reader, client_writer, link, upstream=False),
            )
        finally:
            for writer in (client_writer, upstream_writer):
                self._writers.discard(writer)
                writer.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link, *, upstream: bool
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                await self._flowing.wait()  # a partition holds the bytes until it heals
                if upstream and self._drop_marker is not None and self._drop_marker in data:
                    self._drop_marker = None
                    link.drop_reply = True
                elif not upstream and link.drop_reply:
                    self.dropped_replies += 1
                    for end in link.writers:  # the reply never arrives: the client sees this connection die
                        end.close()
                    return
                writer.write(data)
                await writer.drain()
        writer.close()

    def blackhole(self) -> None:
        """Partition: nothing passes either way (connections stay open, bytes are held)."""
        self._flowing.clear()

    def heal(self) -> None:
        """End the partition: what was held is delivered, late."""
        self._flowing.set()

    def drop_reply_to(self, marker: bytes) -> None:
        """The next client message holding `marker` (say b"COMMIT") reaches the server; the reply
        to it is dropped and that connection cut (once)."""
        self._drop_marker = marker

    def cut(self) -> None:
        """End every connection through the proxy (their clients see the server go away)."""
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    def repoint(self, target_port: int) -> None:
        self.target_port = target_port
        self.cut()

    async def stop(self) -> None:
        self.heal()
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
