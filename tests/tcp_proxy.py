"""A TCP proxy between a process and a server, that can cut or freeze the connections through it:
a broker connection that drops, or one left half-open (nothing arrives, nothing is closed)."""

from __future__ import annotations

import asyncio
import contextlib


class _Link:
    """One client connection and its connection to the server."""

    def __init__(
        self, client: asyncio.StreamWriter, server: asyncio.StreamWriter, cut_at: int | None
    ) -> None:
        self.writers = (client, server)
        self.frozen = asyncio.Event()
        self.pumps: list[asyncio.Task[None]] = []
        self.cut_at = cut_at  # bytes from the server after which to cut, if any

    def cut(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        for pump in self.pumps:
            pump.cancel()


class TcpProxy:
    """Listens on a free loopback port and forwards each connection to ``host:port``.

    :meth:`cut` closes every connection open now (both sides); :meth:`freeze` stops forwarding
    on them without closing anything. Connections made afterwards are forwarded as usual, except
    the next ones :meth:`cut_early` names.
    """

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.links: set[_Link] = set()
        self.accepted = 0
        self.cuts = 0
        self._early: list[int] = []
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for link in list(self.links):
            link.cut()
        # Bounded: a connection accepted while closing, still opening its way to the server,
        # is in no link yet, and a teardown must never hang on it (one did, for an hour, on a
        # loaded machine).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 10)

    def cut(self) -> int:
        """Close every open connection; how many there were."""
        links = list(self.links)
        for link in links:
            link.cut()
        self.links.clear()
        self.cuts += 1
        return len(links)

    def cut_early(self, after: int, connections: int) -> None:
        """Cut each of the next ``connections`` once ``after`` bytes came from the server."""
        self._early = [after] * connections

    def freeze(self) -> int:
        """Stop forwarding on every open connection, closing none; how many there were."""
        for link in self.links:
            link.frozen.set()
        return len(self.links)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self.accepted += 1
        link = _Link(writer, up_writer, self._early.pop() if self._early else None)
        self.links.add(link)
        link.pumps = [
            asyncio.create_task(self._pump(link, reader, up_writer)),
            asyncio.create_task(self._pump(link, up_reader, writer, counted=True)),
        ]

    async def _pump(
        self,
        link: _Link,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        counted: bool = False,
    ) -> None:
        passed = 0
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if link.frozen.is_set():
                    await asyncio.Event().wait()  # half-open: held until cut or closed
                passed += len(data)
                if counted and link.cut_at is not None and passed >= link.cut_at:
                    self.cuts += 1
                    break
                writer.write(data)
                await writer.drain()
        link.cut()  # one side closed: close the other
        self.links.discard(link)
