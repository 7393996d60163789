"""A TCP proxy on loopback that a test repoints: what a Kubernetes Service does when its endpoint moves."""

from __future__ import annotations

import asyncio
import contextlib


class Proxy:
    """Forwards every connection to `target_port`; `repoint` cuts them all and sends new ones elsewhere."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

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
        try:
            await asyncio.gather(
                self._pipe(client_reader, upstream_writer), self._pipe(upstream_reader, client_writer)
            )
        finally:
            for writer in (client_writer, upstream_writer):
                self._writers.discard(writer)
                writer.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    def cut(self) -> None:
        """End every connection through the proxy (their clients see the server go away)."""
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    def repoint(self, target_port: int) -> None:
        self.target_port = target_port
        self.cut()

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
