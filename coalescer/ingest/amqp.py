"""One AMQP 0-9-1 session to consume a queue: pika's asyncio connection as a few awaitables.

pika decodes each socket read frame after frame and calls back synchronously per delivery: no
task, queue hop or message object per frame. That is what lets one process take Pulse's
thousands of messages a second (aio-pika and aiormq, which :mod:`~coalescer.ingest.topology`
uses to declare, spend several times more per delivery). A :class:`Session` never reconnects:
when it closes, :attr:`Session.closed` says why, and the consumer opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pika
import pika.channel
import pika.exceptions
import pika.spec
from pika.adapters.asyncio_connection import AsyncioConnection

log = logging.getLogger(__name__)

#: Seconds to wait for the broker to confirm that a connection is closed.
CLOSE_TIMEOUT = 5.0
#: What pika raises or reports when a connection or channel is gone or refused.
Error = pika.exceptions.AMQPError


class Unavailable(Exception):
    """The broker could not be reached, or closed the session."""


class Delivery:
    """A message as delivered: what the consumer needs of it, and where to settle it."""

    __slots__ = ("body", "channel", "exchange", "headers", "routing_key", "tag")

    def __init__(
        self,
        channel: pika.channel.Channel,
        method: pika.spec.Basic.Deliver,
        properties: pika.spec.BasicProperties,
        body: bytes,
    ) -> None:
        self.channel = channel
        self.tag: int = method.delivery_tag
        self.exchange: str = method.exchange or ""
        self.routing_key: str = method.routing_key or ""
        self.headers: dict[str, Any] | None = properties.headers
        self.body = body


def parameters(url: str, name: str) -> pika.ConnectionParameters:
    """Connection parameters for an ``amqp://`` or ``amqps://`` URL, as aio-pika reads it:
    ``amqps`` verifies the broker's certificate (``?cafile=`` for a private CA)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    tls = parts.scheme == "amqps"
    ssl_options = None
    if tls:
        cafile = query.get("cafile", [None])[0]
        ssl_options = pika.SSLOptions(ssl.create_default_context(cafile=cafile), parts.hostname)
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    options: dict[str, Any] = {}
    if "heartbeat" in query:
        options["heartbeat"] = int(query["heartbeat"][0])
    return pika.ConnectionParameters(
        host=parts.hostname or "localhost",
        port=parts.port or (5671 if tls else 5672),
        virtual_host=vhost,
        credentials=pika.PlainCredentials(
            unquote(parts.username or "guest"), unquote(parts.password or "guest")
        ),
        ssl_options=ssl_options,
        client_properties={"connection_name": name},
        connection_attempts=1,
        socket_timeout=10,
        stack_timeout=15,
        **options,
    )


class Session:
    """A connection and its one channel. Replies to what it asks come as futures; when the
    channel or the connection closes, whatever waits fails with :class:`Unavailable` and
    :attr:`closed` is resolved with the reason."""

    def __init__(self, connection: AsyncioConnection, loop: asyncio.AbstractEventLoop) -> None:
        self.connection = connection
        self.channel: pika.channel.Channel | None = None
        self.closed: asyncio.Future[BaseException] = loop.create_future()
        self._ended: asyncio.Future[None] = loop.create_future()
        self._loop = loop
        self._waiting: set[asyncio.Future[Any]] = set()

    @classmethod
    async def open(cls, url: str, *, name: str, prefetch: int) -> Session:
        """Connect, open a channel and set its prefetch limit; :class:`Unavailable` if not."""
        loop = asyncio.get_running_loop()
        opened: asyncio.Future[None] = loop.create_future()
        session: Session | None = None

        def on_open(_: Any) -> None:
            if not opened.done():
                opened.set_result(None)

        def on_open_error(_: Any, exc: BaseException | str) -> None:
            if not opened.done():
                opened.set_exception(Unavailable(str(exc) or type(exc).__name__))

        def on_close(_: Any, exc: BaseException) -> None:
            if session is not None:
                session._lost(exc)
                _resolve(session._ended, None)

        connection = AsyncioConnection(
            parameters(url, name),
            on_open_callback=on_open,
            on_open_error_callback=on_open_error,
            on_close_callback=on_close,
            custom_ioloop=loop,
        )
        session = cls(connection, loop)
        try:
            await opened
            channel_opened: asyncio.Future[pika.channel.Channel] = session._expect()
            connection.channel(on_open_callback=lambda c: _resolve(channel_opened, c))
            session.channel = await channel_opened
            session.channel.add_on_close_callback(lambda _, exc: session._lost(exc))
            session.channel.add_on_cancel_callback(
                lambda _: session._lost(Unavailable("the broker cancelled the consumer"))
            )
            await session._call(session.channel.basic_qos, prefetch_count=prefetch)
        except BaseException:
            session.close()
            raise
        return session

    async def declare(self, queue: str, arguments: dict[str, Any]) -> None:
        await self._call(
            self._channel.queue_declare, queue=queue, durable=True, arguments=arguments
        )

    async def bind(self, queue: str, exchange: str, pattern: str) -> None:
        await self._call(
            self._channel.queue_bind, queue=queue, exchange=exchange, routing_key=pattern
        )

    async def consume(self, queue: str, deliver: Callable[[Delivery], None]) -> str:
        """Start consuming ``queue``: ``deliver`` is called, synchronously, per delivery."""

        def on_message(
            channel: pika.channel.Channel,
            method: pika.spec.Basic.Deliver,
            properties: pika.spec.BasicProperties,
            body: bytes,
        ) -> None:
            deliver(Delivery(channel, method, properties, body))

        consumed: asyncio.Future[Any] = self._expect()
        with _refused():
            tag: str = self._channel.basic_consume(
                queue, on_message, callback=lambda frame: _resolve(consumed, frame)
            )
        await consumed
        return tag

    async def cancel(self, tag: str) -> None:
        await self._call(self._channel.basic_cancel, tag)

    def close(self) -> None:
        """Close the connection (what is unacknowledged goes back to the queue)."""
        if not (self.connection.is_closing or self.connection.is_closed):
            self.connection.close()

    async def wait_closed(self) -> None:
        """:meth:`close`, and wait (a few seconds at most) for the broker to confirm."""
        self.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._ended), CLOSE_TIMEOUT)
        except TimeoutError:
            log.debug("the connection took over %.0f s to close", CLOSE_TIMEOUT)

    # -- internals --------------------------------------------------------------------------
    @property
    def _channel(self) -> pika.channel.Channel:
        if self.channel is None or not self.channel.is_open:
            raise Unavailable("the channel is closed")
        return self.channel

    def _expect(self) -> asyncio.Future[Any]:
        if self.closed.done():
            raise Unavailable(f"the connection is closed ({self.closed.result()})")
        future: asyncio.Future[Any] = self._loop.create_future()
        self._waiting.add(future)
        future.add_done_callback(self._waiting.discard)
        return future

    async def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        reply = self._expect()
        with _refused():
            method(*args, callback=lambda frame: _resolve(reply, frame), **kwargs)
        return await reply

    def _lost(self, exc: BaseException) -> None:
        for future in list(self._waiting):
            if not future.done():
                future.set_exception(Unavailable(str(exc) or type(exc).__name__))
        if not self.closed.done():
            self.closed.set_result(exc)
        if not (self.connection.is_closing or self.connection.is_closed):
            self.connection.close()  # a channel closed by the broker: start afresh


@contextlib.contextmanager
def _refused() -> Iterator[None]:
    # A channel or connection that closed between two replies: the session is over.
    try:
        yield
    except Error as exc:
        raise Unavailable(str(exc) or type(exc).__name__) from exc


def _resolve(future: asyncio.Future[Any], result: Any) -> None:
    # A reply may come after its waiter gave up (cancelled): nobody needs it then.
    if not future.done():
        future.set_result(result)
