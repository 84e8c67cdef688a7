"""One AMQP 0-9-1 session to consume a queue: pika's asyncio connection as a few awaitables.

pika decodes each socket read frame after frame and calls back synchronously per delivery: no
task, queue hop or message object per frame. That is what lets one process take Pulse's
thousands of messages a second (aio-pika and aiormq, which :mod:`~coalescer.ingest.topology`
uses to declare, spend three to four times the CPU per delivery: ``bench/amqp_clients.py``, and
docs/architecture.md's "One library per job"). A :class:`Session` never reconnects:
when it closes, :attr:`Session.closed` says why, and the consumer opens a new one.

Whatever fails while writing to a connection ends its session, whatever the error: a dying
connection does not always fail with pika's own errors. Under uvloop, an error on the socket
(the broker's side reset) can close the loop's watch of it without telling pika, which then
takes the connection for open: it never reads from it again, and its next write raises
``RuntimeError``. Such a session is given up at once, without waiting for a goodbye the broker
will never send; the heartbeat (:data:`DEFAULT_HEARTBEAT`) finds a connection that dies
silently.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
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
#: The AMQP heartbeat, in seconds, when ``PULSE_URL`` names none (``?heartbeat=N``; 0 turns it
#: off). A connection that carries nothing, heartbeats included, is closed by pika after
#: ``heartbeat + 5`` to ``2 * (heartbeat + 5)`` seconds, and by RabbitMQ after two to three
#: heartbeats, which gives back what it had delivered on it: a broker that vanished, or a
#: connection left half-open, is found within 30 s, and what was delivered on it is delivered
#: again. (Brokers propose 60 s: three minutes.)
DEFAULT_HEARTBEAT = 10


def heartbeat(url: str) -> int:
    """The AMQP heartbeat for ``url``: its ``?heartbeat=N``, else :data:`DEFAULT_HEARTBEAT`."""
    given = parse_qs(urlsplit(url).query).get("heartbeat")
    return int(given[0]) if given else DEFAULT_HEARTBEAT


class Unavailable(Exception):
    """The broker could not be reached, or closed the session."""


class Delivery:
    """A message as delivered: what the consumer needs of it, and where to settle it."""

    __slots__ = ("body", "exchange", "headers", "routing_key", "session", "tag")

    def __init__(
        self,
        session: Session,
        method: pika.spec.Basic.Deliver,
        properties: pika.spec.BasicProperties,
        body: bytes,
    ) -> None:
        self.session = session
        self.tag: int = method.delivery_tag
        self.exchange: str = method.exchange or ""
        self.routing_key: str = method.routing_key or ""
        self.headers: dict[str, Any] | None = properties.headers
        self.body = body

    def ack(self, *, multiple: bool = False) -> None:
        """Acknowledge this delivery (with ``multiple``, every earlier one of its session too);
        :class:`Unavailable` when its session is over (the broker delivers them again)."""
        channel = self.session.channel
        assert channel is not None
        self.session.send(channel.basic_ack, self.tag, multiple=multiple)

    def reject(self) -> None:
        """Reject this delivery without requeueing it: to the queue's dead-letter exchange."""
        channel = self.session.channel
        assert channel is not None
        self.session.send(channel.basic_reject, self.tag, requeue=False)


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
        heartbeat=heartbeat(url),
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
        self._broken = False  # a write failed: the broker will never confirm a close

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
            session.send(connection.channel, on_open_callback=lambda c: _resolve(channel_opened, c))
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
            deliver(Delivery(self, method, properties, body))

        consumed: asyncio.Future[Any] = self._expect()
        tag: str = self.send(
            self._channel.basic_consume,
            queue,
            on_message,
            callback=lambda frame: _resolve(consumed, frame),
        )
        await consumed
        return tag

    async def cancel(self, tag: str) -> None:
        await self._call(self._channel.basic_cancel, tag)

    def send(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call a pika method that writes to the connection. Whatever it raises ends the
        session (see the module's docstring) and is raised as :class:`Unavailable`."""
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            if not isinstance(exc, Error):  # not pika's word for a closed channel: a dead socket
                self._broken = True
            self._lost(exc)
            raise Unavailable(reason(exc)) from exc

    def close(self) -> None:
        """Close the connection (what is unacknowledged goes back to the queue)."""
        if self.connection.is_closing or self.connection.is_closed:
            return
        try:
            self.connection.close()
        except Exception as exc:  # the socket is gone already: nothing to say goodbye on
            self._broken = True
            log.debug("closing the connection failed (%s)", reason(exc))

    async def wait_closed(self) -> None:
        """:meth:`close`, and wait (a few seconds at most) for the broker to confirm, unless the
        connection is known to be dead (the broker has dropped it, or drops it by heartbeat)."""
        self.close()
        if self._broken:
            return
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
            raise Unavailable(f"the connection is closed ({reason(self.closed.result())})")
        future: asyncio.Future[Any] = self._loop.create_future()
        self._waiting.add(future)
        future.add_done_callback(self._waiting.discard)
        return future

    async def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        reply = self._expect()
        self.send(method, *args, callback=lambda frame: _resolve(reply, frame), **kwargs)
        return await reply

    def _lost(self, exc: BaseException) -> None:
        for future in list(self._waiting):
            if not future.done():
                future.set_exception(Unavailable(reason(exc)))
        if not self.closed.done():
            self.closed.set_result(exc)
        self.close()  # a channel closed by the broker, or a dead socket: start afresh


def reason(exc: BaseException) -> str:
    """Why a session ended, in a few words: pika's errors say what closed; others need their
    type to make sense (``RuntimeError: unable to perform operation on <UVPoll closed=True>``)."""
    if isinstance(exc, Error):
        return str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _resolve(future: asyncio.Future[Any], result: Any) -> None:
    # A reply may come after its waiter gave up (cancelled): nobody needs it then.
    if not future.done():
        future.set_result(result)


def on_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's exception handler for a consumer: pika's heartbeat timer writing to a
    connection whose socket watch uvloop already closed (the write's ``RuntimeError``, as in the
    module's docstring) is a connection lost, said as a warning; the heartbeat then finds the
    connection dead and its session ends. Anything else goes to the loop's default handler."""
    exc = context.get("exception")
    handle = repr(context.get("handle"))
    if isinstance(exc, RuntimeError) and "HeartbeatChecker" in handle:
        log.warning("a heartbeat could not be sent on a connection already gone (%s)", exc)
        return
    loop.default_exception_handler(context)
