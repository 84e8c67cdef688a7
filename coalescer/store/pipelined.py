"""A lean, auto-pipelined Redis connection for the query hot path.

redis-py spends more time per command in Python than Redis spends running it, which caps a web
process well below what Starlette can serve. This connection keeps the protocol work in hiredis
(``pack_command`` and ``Reader``) and shares one socket among every concurrent request: commands
issued in the same event-loop iteration leave in a few writes (groups of :data:`FLUSH_EVERY`),
and replies are matched in order (Redis answers a connection's commands in the order it
received them).

Only plain ``redis://`` and ``rediss://`` URLs are handled here; anything else (Unix sockets,
the embedded store) stays on redis-py. Failures surface as
:class:`~coalescer.errors.StoreUnavailable`; a ``NOSCRIPT`` reply as :class:`NoScript`.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Awaitable, Sequence
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlparse

import hiredis

from coalescer.errors import StoreUnavailable

#: Commands that leave together at most. Sending a whole event-loop iteration's commands at
#: once makes their replies come back, and the answers leave, in one burst, and the peers idle
#: in between; groups of 8 let Redis work while the web process goes on (bench/query.py:
#: 15.5k → 19k queries/s on 2 cores, against 17k when every command leaves alone).
FLUSH_EVERY = 8


class NoScript(Exception):
    """Redis does not have the script (restarted or flushed): reload, then retry."""


class ReplyError(Exception):
    """Redis answered a command with an error."""


class _Protocol(asyncio.Protocol):
    def __init__(self, timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.reader = hiredis.Reader(encoding="utf-8")
        self.waiters: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self.outgoing: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.timeout = timeout
        self.timed_out = False
        self._watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            future, _ = self.waiters.popleft()
            if future.done():
                continue
            if isinstance(reply, hiredis.ReplyError):
                text = str(reply)
                future.set_exception(
                    NoScript(text) if text.startswith("NOSCRIPT") else ReplyError(text)
                )
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        failure = (
            StoreUnavailable(f"Redis did not answer within {self.timeout:g} s", reason="timeout")
            if self.timed_out
            else StoreUnavailable(f"Redis connection lost: {exc or 'closed'}")
        )
        while self.waiters:
            future, _ = self.waiters.popleft()
            if not future.done():
                future.set_exception(failure)

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        future = self.loop.create_future()
        self.waiters.append((future, time.monotonic()))
        if not self.outgoing:
            self.loop.call_soon(self._flush)
        self.outgoing.append(packed)
        if len(self.outgoing) >= FLUSH_EVERY:
            self._flush()
        if self._watchdog is None:
            self._watchdog = self.loop.call_later(self.timeout, self._check)
        return future

    def send_many(self, packed: list[bytes]) -> list[asyncio.Future[Any]]:
        """Queue several commands and write them out at once (a batch, not a query)."""
        futures = []
        now = time.monotonic()
        for _ in packed:
            future = self.loop.create_future()
            self.waiters.append((future, now))
            futures.append(future)
        self.outgoing.extend(packed)
        self._flush()
        if self._watchdog is None:
            self._watchdog = self.loop.call_later(self.timeout, self._check)
        return futures

    def _flush(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(b"".join(self.outgoing))
        self.outgoing.clear()

    def _check(self) -> None:
        """Fail everything when the oldest reply is overdue: a stuck server or a dead peer."""
        self._watchdog = None
        if self.closed or not self.waiters:
            return
        overdue = time.monotonic() - self.waiters[0][1] - self.timeout
        if overdue >= 0 and self.transport is not None:
            self.timed_out = True
            self.transport.abort()
            return
        self._watchdog = self.loop.call_later(max(-overdue, 0.05), self._check)


class PipelinedClient:
    """Auto-pipelined commands over one connection, reconnecting on demand."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        parts = urlparse(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        self.ssl = ssl.create_default_context() if parts.scheme == "rediss" else None
        if self.ssl is not None and parse_qs(parts.query).get("ssl_cert_reqs") == ["none"]:
            # As redis-py reads it: e.g. Heroku Redis, whose certificate is self-signed.
            self.ssl.check_hostname = False
            self.ssl.verify_mode = ssl.CERT_NONE
        self.username = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else None
        path = parts.path.strip("/")
        self.db = int(path) if path.isdigit() else 0
        self.timeout = timeout
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None

    @staticmethod
    def supports(url: str) -> bool:
        parts = urlparse(url)
        path = parts.path.strip("/")
        return (
            parts.scheme in ("redis", "rediss")
            and (path == "" or path.isdigit())
            and set(parse_qs(parts.query)) <= {"ssl_cert_reqs"}
        )

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Protocol(self.timeout), self.host, self.port, ssl=self.ssl
                ),
                self.timeout,
            )
        except (OSError, TimeoutError) as exc:
            raise StoreUnavailable(
                f"Redis is unreachable at {self.host}:{self.port}: {exc}"
            ) from exc
        setup: list[tuple[Any, ...]] = []
        if self.password is not None:
            setup.append(
                ("AUTH", self.username, self.password) if self.username else ("AUTH", self.password)
            )
        if self.db:
            setup.append(("SELECT", self.db))
        for command in setup:
            try:
                await protocol.send(hiredis.pack_command(command))
            except ReplyError as exc:
                assert protocol.transport is not None
                protocol.transport.close()
                raise StoreUnavailable(f"Redis refused {command[0]}: {exc}") from exc
        return protocol

    async def _get(self) -> _Protocol:
        if self._protocol is not None and not self._protocol.closed:
            return self._protocol
        if self._connecting is None:  # one connect for every waiting request
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            self._protocol = await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None
        return self._protocol

    def execute(self, *args: Any) -> Awaitable[Any]:
        """Send one command; await the result. A plain function returning the reply's future
        when connected (the common case), saving a coroutine per command."""
        protocol = self._protocol
        if protocol is None or protocol.closed:
            return self._execute_connecting(args)
        return protocol.send(hiredis.pack_command(args))

    async def _execute_connecting(self, args: tuple[Any, ...]) -> Any:
        protocol = await self._get()
        return await protocol.send(hiredis.pack_command(args))

    async def execute_many(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Send ``commands`` in one write; their replies in order, a command that Redis refused
        answered by its error (:class:`ReplyError`, :class:`NoScript`) in its place. Raises
        :class:`StoreUnavailable` when the connection fails."""
        protocol = await self._get()
        futures = protocol.send_many([hiredis.pack_command(tuple(c)) for c in commands])
        replies = await asyncio.gather(*futures, return_exceptions=True)
        for reply in replies:
            if isinstance(reply, StoreUnavailable):
                raise reply
        return replies

    async def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        self._protocol = None
