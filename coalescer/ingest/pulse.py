"""The Pulse (AMQP 0-9-1) consumer: queue events from RabbitMQ into the index.

Topology, all declared by us except the queue's exchanges (Pulse owns those)::

    exchange/taskcluster-queue/v1/task-{pending,running,completed,failed,exception}
        │ bound with route.<prefix>.#  (the CC header Taskcluster adds per task route)
        ▼
    queue/<user>/coalescer      durable, x-max-length + reject-publish, prefetch-limited
        │ basic.reject(requeue=False): a message that can never be applied
        ▼
    exchange/<user>/coalescer/dead ──▶ queue/<user>/coalescer/dead

Deliveries are applied in batches (up to ``batch_size`` or ``batch_wait`` seconds), one
:meth:`Store.apply` round trip per batch, and acknowledged only after that write. Redis being
down holds the batch and retries it; nothing is acked meanwhile, so the prefetch limit stops the
flow. The connection is robust (aio-pika reconnects and re-consumes by itself); deliveries of a
lost channel cannot be acked and come back from the broker, which is harmless because applying
an event twice changes nothing. The queue is never deleted: events published while we are down
wait for us.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import aio_pika
import aiormq.exceptions
import orjson
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection

from coalescer.errors import ConfigError, InvalidEvent, StoreUnavailable
from coalescer.health import Supervisor
from coalescer.ingest import topology
from coalescer.ingest.events import Message, to_event
from coalescer.ingest.record import Recorder
from coalescer.logs import Throttled
from coalescer.model import TaskEvent
from coalescer.observe import HELD, STORE_ERRORS, Observer
from coalescer.settings import Settings
from coalescer.store import Store

log = logging.getLogger(__name__)

#: Outcomes of a delivery that is set aside in the dead-letter queue instead of acknowledged.
SET_ASIDE = frozenset({"invalid", "dead-lettered"})


def decode(delivery: AbstractIncomingMessage) -> Message:
    """A delivery as a :class:`Message`; :class:`InvalidEvent` when its body isn't JSON."""
    try:
        payload = orjson.loads(delivery.body)
    except orjson.JSONDecodeError as exc:
        raise InvalidEvent(f"body is not JSON: {exc}") from exc
    cc = (delivery.headers or {}).get("CC") or []
    routes = [r.decode() if isinstance(r, bytes) else r for r in cc] if isinstance(cc, list) else cc
    return Message.from_json(
        {
            "exchange": delivery.exchange or "",
            "routingKey": delivery.routing_key or "",
            "CC": routes,
            "payload": payload,
        }
    )


class Consumer:
    """Consumes one queue until told to stop; several may share a queue (competing consumers).

    ``declare_exchanges`` creates the queue's exchanges when they are missing, for a bare
    RabbitMQ (tests, the emulator); on real Pulse they exist and must not be declared.
    """

    def __init__(
        self,
        settings: Settings,
        store: Store,
        observer: Observer,
        *,
        queue: str | None = None,
        declare_exchanges: bool = False,
        batch_size: int | None = None,
        batch_wait: float = 0.005,
        drain_timeout: float = 10.0,
        reconnect_interval: float = 2.0,
        connection_name: str | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        if settings.pulse_url is None:
            raise ConfigError("PULSE_URL is not set: nothing to listen to")
        self.url = settings.pulse_url.reveal()
        self.settings = settings
        self.store = store
        self.observer = observer
        self.queue = queue or settings.pulse_queue or topology.default_queue(self.url)
        self.declare_exchanges = declare_exchanges
        self.prefetch = settings.pulse_prefetch
        # Half the prefetch: the broker keeps delivering the rest while a batch is written.
        self.batch_size = max(1, min(batch_size or self.prefetch // 2, self.prefetch))
        self.batch_wait = batch_wait
        self.drain_timeout = drain_timeout
        self.reconnect_interval = reconnect_interval
        self.connection_name = connection_name or (
            f"coalescer {socket.gethostname()} pid {os.getpid()}"
        )
        self.recorder = recorder
        self.bindings = topology.bindings(settings.route_prefix, settings.taskcluster_root_url)
        self.connection: AbstractRobustConnection | None = None
        #: Set once the queue is bound and consumed: what is published from then on arrives.
        self.consuming = asyncio.Event()
        self._inbox: asyncio.Queue[AbstractIncomingMessage | None] = asyncio.Queue()
        self._draining = False
        self._held_log = Throttled(log)

    # -- life cycle -------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set, then drain what was delivered and return.

        Raises :class:`ConfigError` for what retrying cannot fix (credentials, permissions, a
        queue declared with other arguments, missing exchanges).
        """
        ready = await topology.prepare(
            self.url,
            self.queue,
            self.bindings,
            max_length=self.settings.pulse_max_length,
            declare_exchanges=self.declare_exchanges,
            connection_name=self.connection_name,
            stop=stop,
        )
        if not ready:
            return
        self._inbox = asyncio.Queue()  # a restart after a crash begins afresh
        self._draining = False
        self.connection = await aio_pika.connect_robust(
            self.url,
            client_properties={"connection_name": self.connection_name},
            reconnect_interval=self.reconnect_interval,
        )
        self.connection.reconnect_callbacks.add(_reconnected)
        try:
            channel = await self.connection.channel()
            await channel.set_qos(prefetch_count=self.prefetch)
            queue = await channel.declare_queue(
                self.queue,
                durable=True,
                arguments=topology.queue_arguments(self.queue, self.settings.pulse_max_length),
            )
            for exchange, pattern in self.bindings:
                await queue.bind(exchange, pattern)
            tag = await queue.consume(self._deliver)
            self.consuming.set()
            log.info(
                "consuming %s (prefetch %d, batches of %d)",
                self.queue,
                self.prefetch,
                self.batch_size,
            )
            pump = asyncio.create_task(self._pump())
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({pump, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if pump.done():
                pump.result()  # the pump only ends by crashing before stop: say why
            await self._drain(queue, tag, pump)
        finally:
            await self.connection.close()
            log.info("stopped consuming %s", self.queue)

    async def _deliver(self, delivery: AbstractIncomingMessage) -> None:
        self._inbox.put_nowait(delivery)

    async def _drain(self, queue: Any, tag: str, pump: asyncio.Task[None]) -> None:
        try:
            await queue.cancel(tag)
        except (aiormq.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
            log.debug("could not cancel the consumer (%s); closing the connection will", exc)
        self._inbox.put_nowait(None)
        try:
            await asyncio.wait_for(pump, self.drain_timeout)
        except TimeoutError:
            # Unacknowledged deliveries go back to the queue when the connection closes.
            log.warning(
                "drain took over %.0f s: leaving the rest to the broker", self.drain_timeout
            )

    # -- batches ----------------------------------------------------------------------------
    async def _pump(self) -> None:
        while (batch := await self._collect()) is not None:
            await self.handle(batch)

    async def _collect(self) -> list[AbstractIncomingMessage] | None:
        """The next batch: what is waiting, plus what arrives within ``batch_wait``."""
        if self._draining:
            rest: list[AbstractIncomingMessage] = []
            while len(rest) < self.batch_size and not self._inbox.empty():
                item = self._inbox.get_nowait()
                if item is not None:
                    rest.append(item)
            return rest or None
        first = await self._inbox.get()
        if first is None:
            self._draining = True
            return await self._collect()
        batch = [first]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.batch_wait
        while len(batch) < self.batch_size:
            if self._inbox.empty():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._inbox.get(), remaining)
                except TimeoutError:
                    break
            else:
                item = self._inbox.get_nowait()
            if item is None:
                self._draining = True
                break
            batch.append(item)
        return batch

    async def handle(self, batch: Sequence[AbstractIncomingMessage]) -> list[str]:
        """Apply a batch in one round trip, then settle each delivery with the broker."""
        outcomes: list[str] = ["ignored"] * len(batch)
        events: list[TaskEvent] = []
        messages: list[Message] = []
        slots: list[int] = []
        for i, delivery in enumerate(batch):
            try:
                message = decode(delivery)
                event = to_event(
                    message,
                    prefix=self.settings.route_prefix,
                    rank_tag=self.settings.rank_tag,
                )
            except InvalidEvent as exc:
                outcomes[i] = "invalid"
                log.warning(
                    "dead-lettering a message from %s (%s): %s",
                    delivery.exchange,
                    delivery.routing_key,
                    exc,
                )
                continue
            except Exception:  # a bug must not wedge the queue: set the message aside
                outcomes[i] = "dead-lettered"
                log.exception(
                    "dead-lettering a message from %s (%s)", delivery.exchange, delivery.routing_key
                )
                continue
            if event is not None:
                events.append(event)
                messages.append(message)
                slots.append(i)
        for i, outcome in zip(slots, await self._apply(events) if events else [], strict=True):
            outcomes[i] = outcome
        if self.recorder is not None:
            self.recorder.record(
                m for m, i in zip(messages, slots, strict=True) if outcomes[i] not in SET_ASIDE
            )
        await self._settle(batch, outcomes)
        # Counting never holds or loses events: the observer keeps what it could not write.
        await self.observer.ingest(
            "pulse",
            outcomes,
            [d.exchange or "" for d in batch],
            applied=[ev for ev, i in zip(events, slots, strict=True) if outcomes[i] == "applied"],
        )
        return outcomes

    async def _apply(self, events: list[TaskEvent]) -> list[str]:
        """``Store.apply``, held and retried for as long as the store cannot take it: a full,
        read-only, frozen or missing Redis is never the events' fault. Only an event that the
        store refuses alone, while it takes other writes, is set aside: never retried forever."""
        try:
            return await self._apply_held(events)
        except Exception:
            if len(events) == 1:
                return [await self._isolated(events[0])]
            log.exception("applying a batch of %d failed; trying each alone", len(events))
            return [await self._isolated(ev) for ev in events]

    async def _apply_held(self, events: Sequence[TaskEvent]) -> list[str]:
        delay = 0.2
        try:
            while True:
                try:
                    return list(await self.store.apply(events, policy=self.settings.policy))
                except StoreUnavailable as exc:
                    STORE_ERRORS.labels(exc.reason).inc()
                    HELD.set(len(events))
                    self._held_log.log(
                        logging.WARNING,
                        "store unavailable (%s); holding %d events, retrying every %.1f s at "
                        "most: %s",
                        exc.reason,
                        len(events),
                        delay,
                        exc,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 30.0)
        finally:
            HELD.set(0)

    async def _isolated(self, event: TaskEvent) -> str:
        """Apply one event that failed in a batch: dead-letter it only when it fails alone and
        the store proves it takes writes (a write probe succeeds)."""
        while True:
            try:
                return (await self._apply_held([event]))[0]
            except Exception as exc:  # StoreRejected, or a bug met by this event
                failure = exc
            try:
                await self.store.probe()
            except StoreUnavailable as exc:
                log.warning("store cannot take writes (%s): holding the event", exc.reason)
                await asyncio.sleep(1.0)
                continue
            log.error(
                "dead-lettering the event of task %s: the store takes writes but refuses it",
                event.task_id,
                exc_info=failure,
            )
            return "dead-lettered"

    async def _settle(
        self, batch: Sequence[AbstractIncomingMessage], outcomes: Sequence[str]
    ) -> None:
        """Reject what is set aside, one by one, then ack the rest with one ``multiple`` ack per
        channel: it covers every earlier delivery, and those are all settled by now."""
        last: dict[int, AbstractIncomingMessage] = {}
        for delivery, outcome in zip(batch, outcomes, strict=True):
            try:
                if outcome in SET_ASIDE:
                    await delivery.reject(requeue=False)  # to the dead-letter exchange
                else:
                    last[id(delivery.channel)] = delivery
            except (aiormq.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
                _unsettled(exc)
        for delivery in last.values():
            try:
                await delivery.ack(multiple=True)
            except (aiormq.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
                _unsettled(exc)


def _reconnected(*_: Any) -> None:
    log.info("reconnected to the broker; consuming again")


def _unsettled(exc: Exception) -> None:
    # The channel a delivery came on is gone: the broker delivers it again, and applying an
    # event again changes nothing.
    log.info("could not settle a delivery (%s); it will be redelivered", type(exc).__name__)


class Listener:
    """A :class:`Consumer` as a background task of another process: ``coalescer serve`` with
    the embedded store, where the web app and the consumer must share one in-process store.
    The supervisor restarts it when it crashes; a setting it cannot work with stops it (the web
    app goes on serving what the index holds, and the heartbeat says why)."""

    def __init__(self, consumer: Consumer, supervisor: Supervisor) -> None:
        self.consumer = consumer
        self._stop = asyncio.Event()
        self._task = supervisor.service("pulse", self._run)

    @classmethod
    def start(
        cls,
        settings: Settings,
        store: Store,
        observer: Observer,
        supervisor: Supervisor,
        recorder: Recorder | None = None,
    ) -> Listener:
        # A one-machine setup (the emulator's bare RabbitMQ) may lack the exchanges; on Pulse
        # they exist, so nothing is ever declared there.
        consumer = Consumer(settings, store, observer, declare_exchanges=True, recorder=recorder)
        return cls(consumer, supervisor)

    async def _run(self) -> None:
        await self.consumer.run(self._stop)

    async def stop(self) -> None:
        """Drain and stop (bounded by the consumer's drain timeout)."""
        self._stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
