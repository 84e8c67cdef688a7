"""Delivery of the emulator's Pulse messages: to an AMQP broker and/or a coalescer's ingest.

:meth:`Publisher.publish` only appends to an in-memory outbox (one per sink) and returns, so an
API request never waits for a broker. A background task per sink delivers its outbox in order,
and on a failure retries the same message with exponential backoff: a broker restart or a slow
service delays messages, it does not lose or reorder them. (They are lost if the emulator
process dies: it keeps everything in memory.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import Iterable, MutableSequence, Sequence
from typing import Any, Protocol

import orjson

from coalescer.backoff import Backoff
from coalescer.emulator.messages import Message
from coalescer.settings import redact_url

log = logging.getLogger("coalescer.emulator")


class DeliveryError(Exception):
    """A sink could not deliver a batch now; the outbox tries again later."""


class Sink(Protocol):
    """Somewhere messages go. ``send`` raises on any failure that may pass."""

    name: str
    batch_size: int

    async def send(self, batch: Sequence[Message]) -> None: ...

    async def close(self) -> None: ...


class AmqpSink:
    """Publishes to topic exchanges on an AMQP 0-9-1 broker, as Pulse does.

    Exchanges are declared durable topic exchanges, messages are persistent JSON with the
    task's routes in a ``CC`` header (RabbitMQ's sender-selected distribution), and each publish
    waits for the broker's confirm before the next, so the outbox only drops what was accepted.
    """

    name = "amqp"
    batch_size = 1

    def __init__(self, url: str) -> None:
        self._url = url
        self._connection: Any = None
        self._channel: Any = None
        self._exchanges: dict[str, Any] = {}

    async def _ready(self) -> Any:
        import aio_pika

        if self._channel is None or self._channel.is_closed:
            await self.close()
            self._connection = await aio_pika.connect(self._url, timeout=10)
            self._channel = await self._connection.channel(publisher_confirms=True)
            self._exchanges = {}
        return self._channel

    async def send(self, batch: Sequence[Message]) -> None:
        import aio_pika

        try:
            channel = await self._ready()
            for message in batch:
                exchange = self._exchanges.get(message.exchange)
                if exchange is None:
                    exchange = await channel.declare_exchange(
                        message.exchange, aio_pika.ExchangeType.TOPIC, durable=True
                    )
                    self._exchanges[message.exchange] = exchange
                await exchange.publish(
                    aio_pika.Message(
                        body=orjson.dumps(message.payload),
                        content_type="application/json",
                        content_encoding="utf-8",
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                        headers={"CC": list(message.cc)},
                    ),
                    routing_key=message.routing_key,
                )
        except Exception as exc:  # connection, channel or confirm failure: reconnect and retry
            await self.close()
            reason = repr(exc).replace(self._url, redact_url(self._url))  # no password in logs
            raise DeliveryError(f"AMQP publish failed: {reason}") from exc

    async def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            try:
                await connection.close()
            except Exception:  # already broken; nothing left to release
                log.debug("closing a broken AMQP connection failed", exc_info=True)


class HttpSink:
    """POSTs batches to a coalescer's ``POST /v1/events`` with a bearer token."""

    name = "http"
    batch_size = 100

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 10.0) -> None:
        import httpx

        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._url = url
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout)

    async def send(self, batch: Sequence[Message]) -> None:
        import httpx

        body = orjson.dumps([message.to_json() for message in batch])
        try:
            response = await self._client.post(self._url, content=body)
        except httpx.HTTPError as exc:
            raise DeliveryError(f"POST {self._url} failed: {exc!r}") from exc
        if response.status_code >= 500 or response.status_code in (408, 429):
            raise DeliveryError(f"POST {self._url} answered {response.status_code}")
        if response.status_code >= 400:
            # Never accepted however often it is sent; retrying would wedge every later message.
            log.error(
                "POST %s refused %d messages with %d: %s (dropped)",
                self._url,
                len(batch),
                response.status_code,
                response.text[:500],
            )

    async def close(self) -> None:
        await self._client.aclose()


class _Outbox:
    """The in-order queue of one sink and the task that drains it."""

    def __init__(self, sink: Sink, backoff: float, max_backoff: float) -> None:
        self.sink = sink
        self.pending: collections.deque[Message] = collections.deque()
        self.wakeup = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self._backoff = Backoff(backoff, maximum=max_backoff)
        self.task: asyncio.Task[None] | None = None

    def put(self, messages: Sequence[Message]) -> None:
        self.pending.extend(messages)
        self.idle.clear()
        self.wakeup.set()

    async def run(self) -> None:
        while True:
            if not self.pending:
                self.idle.set()
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            batch = list(itertools.islice(self.pending, self.sink.batch_size))
            try:
                await self.sink.send(batch)
            except DeliveryError as exc:
                delay = self._backoff.next()
                log.warning("%s delivery failed, retrying in %.1fs: %s", self.sink.name, delay, exc)
                await asyncio.sleep(delay)
                continue
            for _ in batch:
                self.pending.popleft()
            self._backoff.reset()


class Publisher:
    """Records every message and hands it to each sink's outbox.

    ``published`` is the record (newest last); pass a bounded ``collections.deque`` to keep only
    recent messages in a long-running emulator.
    """

    def __init__(
        self,
        sinks: Sequence[Sink] = (),
        *,
        published: MutableSequence[dict[str, Any]] | None = None,
        backoff: float = 0.2,
        max_backoff: float = 10.0,
    ) -> None:
        self.published: MutableSequence[dict[str, Any]] = [] if published is None else published
        # Outboxes exist from the start, so nothing published before start() is lost.
        self._outboxes = [_Outbox(sink, backoff, max_backoff) for sink in sinks]

    def publish(self, messages: Iterable[Message]) -> None:
        """Queue ``messages`` for delivery, in order; never blocks."""
        batch = list(messages)
        if not batch:
            return
        self.published.extend(message.to_json() for message in batch)
        for outbox in self._outboxes:
            outbox.put(batch)

    @property
    def backlog(self) -> int:
        """Messages not yet delivered, summed over sinks."""
        return sum(len(outbox.pending) for outbox in self._outboxes)

    async def start(self) -> None:
        """Start one delivery task per sink (inside the running event loop)."""
        for outbox in self._outboxes:
            if outbox.task is None:
                name = f"emulator-{outbox.sink.name}-outbox"
                outbox.task = asyncio.create_task(outbox.run(), name=name)

    async def flush(self, seconds: float) -> bool:
        """Wait until every outbox is empty, or ``seconds``; True if all was delivered."""
        try:
            async with asyncio.timeout(seconds):
                for outbox in self._outboxes:
                    await outbox.idle.wait()
        except TimeoutError:
            return False
        return True

    async def stop(self, flush_timeout: float = 5.0) -> None:
        """Deliver what is queued (within ``flush_timeout``), then stop and close the sinks."""
        if not await self.flush(flush_timeout):
            log.error("stopping with %d undelivered messages", self.backlog)
        for outbox in self._outboxes:
            if outbox.task is not None:
                outbox.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await outbox.task
                outbox.task = None
            await outbox.sink.close()
