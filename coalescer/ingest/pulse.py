"""The Pulse (AMQP 0-9-1) consumer: queue events from RabbitMQ into the index.

Topology, all declared by us except the queue's exchanges (Pulse owns those)::

    exchange/taskcluster-queue/v1/task-{pending,running,completed,failed,exception}
        │ bound with route.<prefix>.#  (the CC header Taskcluster adds per task route)
        ▼
    queue/<user>/coalescer      durable, x-max-length + reject-publish, prefetch-limited
        │ basic.reject(requeue=False): a message that can never be applied
        ▼
    exchange/<user>/coalescer/dead ──▶ queue/<user>/coalescer/dead

Deliveries are applied in batches (up to ``batch_size``, or what arrived within ``batch_wait``
seconds), one :meth:`Store.apply` round trip per batch, and acknowledged only after that write,
with one ``multiple`` ack; the next batch is decoded while one is written. Redis being down
holds the batch and retries it; nothing is acked meanwhile, so the prefetch limit stops the
flow. A lost connection is reopened and the queue consumed again (:mod:`~coalescer.ingest.amqp`);
deliveries of the lost channel cannot be acked and come back from the broker, which is harmless
because applying an event twice changes nothing. The queue is never deleted: events published
while we are down wait for us.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import orjson

from coalescer.backoff import Backoff
from coalescer.errors import ConfigError, InvalidEvent, StoreUnavailable
from coalescer.health import Supervisor
from coalescer.ingest import amqp, topology
from coalescer.ingest.amqp import Delivery
from coalescer.ingest.events import Message, to_event
from coalescer.ingest.record import Recorder
from coalescer.logs import Throttled
from coalescer.model import TaskEvent
from coalescer.observe import HELD, Observer, store_failed
from coalescer.settings import Settings, redact_url
from coalescer.store import Store
from coalescer.store.census import Limits

if TYPE_CHECKING:
    from coalescer.ingest.verify import Verifier

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Outcomes of a delivery that is set aside in the dead-letter queue instead of acknowledged.
SET_ASIDE = frozenset({"invalid", "dead-lettered"})


def decode(delivery: Delivery) -> Message:
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
        verifier: Verifier | None = None,
    ) -> None:
        if settings.pulse_url is None:
            raise ConfigError("PULSE_URL is not set: nothing to listen to")
        self.url = settings.pulse_url.reveal()
        self.settings = settings
        self._limits = Limits(settings.max_keys, settings.max_tasks)
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
        #: Checks events of runs scheduled before the store was emptied against the queue.
        self.verifier = verifier
        self.bindings = topology.bindings(settings.route_prefix, settings.taskcluster_root_url)
        self.session: amqp.Session | None = None
        #: Set once the queue is bound and consumed: what is published from then on arrives.
        self.consuming = asyncio.Event()
        #: Deliveries not yet in a batch; never more than the prefetch limit.
        self._inbox: deque[Delivery] = deque()
        self._arrived = asyncio.Event()  # the inbox holds something (a batch, when collecting)
        self._wanted = 1  # how many deliveries wake the pump
        self._tag = ""  # the consumer tag on the current session
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
        self._inbox.clear()  # a restart after a crash begins afresh
        self._draining = False
        pump = asyncio.create_task(self._pump())
        stopped = asyncio.create_task(stop.wait())
        try:
            await self._serve(pump, stopped)
            await self._drain(pump)
        finally:
            stopped.cancel()
            pump.cancel()
            if self.session is not None:
                await self.session.wait_closed()
                self.session = None
            log.info("stopped consuming %s", self.queue)

    async def _serve(self, pump: asyncio.Task[None], stopped: asyncio.Task[bool]) -> None:
        """Consume, and consume again on a new connection when one is lost, until stopped."""
        lost = False
        while not stopped.done():
            try:
                self.session = await self._open()
            except amqp.Unavailable as exc:
                log.warning(
                    "broker at %s unreachable (%s); retrying in %.0f s",
                    redact_url(self.url),
                    exc,
                    self.reconnect_interval,
                )
                await asyncio.wait({pump, stopped}, timeout=self.reconnect_interval)
            else:
                if lost:
                    log.info("reconnected to the broker; consuming again")
                self.consuming.set()
                log.info(
                    "consuming %s (prefetch %d, batches of %d)",
                    self.queue,
                    self.prefetch,
                    self.batch_size,
                )
                closed = self.session.closed
                waits: set[asyncio.Future[Any]] = {pump, stopped, closed}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if closed.done() and not stopped.done():
                    lost = True
                    log.warning(
                        "lost the connection to %s (%s); reconnecting",
                        redact_url(self.url),
                        amqp.reason(closed.result()),
                    )
                    await self.session.wait_closed()
                    self.session = None
            if pump.done():
                pump.result()  # the pump only ends by crashing before stop: say why

    async def _open(self) -> amqp.Session:
        session = await amqp.Session.open(
            self.url, name=self.connection_name, prefetch=self.prefetch
        )
        try:
            # Declared again on every connection: a broker restarted empty has lost them.
            await session.declare(
                self.queue, topology.queue_arguments(self.queue, self.settings.pulse_max_length)
            )
            for exchange, pattern in self.bindings:
                await session.bind(self.queue, exchange, pattern)
            self._tag = await session.consume(self.queue, self._deliver)
        except BaseException:
            await session.wait_closed()
            raise
        return session

    def _deliver(self, delivery: Delivery) -> None:
        self._inbox.append(delivery)
        if len(self._inbox) >= self._wanted:
            self._arrived.set()

    async def _drain(self, pump: asyncio.Task[None]) -> None:
        if self.session is not None:
            try:
                await asyncio.wait_for(self.session.cancel(self._tag), self.drain_timeout)
            except (amqp.Unavailable, amqp.Error, TimeoutError) as exc:
                log.debug("could not cancel the consumer (%s); closing the connection will", exc)
        self._draining = True
        self._arrived.set()
        try:
            await asyncio.wait_for(pump, self.drain_timeout)
        except TimeoutError:
            # Unacknowledged deliveries go back to the queue when the connection closes.
            log.warning(
                "drain took over %.0f s: leaving the rest to the broker", self.drain_timeout
            )

    # -- batches ----------------------------------------------------------------------------
    async def _pump(self) -> None:
        """Collect and decode each batch while the one before it is written: batches are still
        applied and settled one at a time, in order, so a ``multiple`` ack never covers a
        delivery that is not applied yet."""
        writing: asyncio.Task[list[str]] | None = None
        collecting: asyncio.Task[list[Delivery] | None] | None = None
        try:
            while True:
                collecting = asyncio.create_task(self._collect())
                if writing is not None:
                    # A write that fails ends the pump now, not when the next batch comes.
                    await asyncio.wait({collecting, writing}, return_when=asyncio.FIRST_COMPLETED)
                    if writing.done():
                        writing.result()
                if (batch := await collecting) is None:
                    break
                decoded = self._decode(batch)
                if writing is not None:
                    await writing
                writing = asyncio.create_task(self._write(decoded))
            if writing is not None:
                await writing
        finally:
            for task in (collecting, writing):
                if task is not None:
                    task.cancel()

    async def _collect(self) -> list[Delivery] | None:
        """The next batch: what is waiting, plus what arrives within ``batch_wait``, up to
        ``batch_size``; ``None`` once draining and nothing is left."""
        while not self._inbox:
            if self._draining:
                return None
            self._wanted = 1
            self._arrived.clear()
            await self._arrived.wait()
        if len(self._inbox) < self.batch_size and not self._draining:
            self._wanted = self.batch_size
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), self.batch_wait)
        inbox = self._inbox
        return [inbox.popleft() for _ in range(min(len(inbox), self.batch_size))]

    def _decode(self, batch: Sequence[Delivery]) -> _Decoded:
        """A batch's events, and the outcome of each delivery that has none (invalid, or
        nothing for the index)."""
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
        return _Decoded(batch, outcomes, events, messages, slots)

    async def _write(self, decoded: _Decoded) -> list[str]:
        """Apply a decoded batch in one round trip, then settle each delivery with the broker
        and count the outcomes."""
        batch, outcomes, events, messages, slots = decoded
        for i, outcome in zip(slots, await self._apply(events) if events else [], strict=True):
            outcomes[i] = outcome
        if (verifier := self.verifier) is not None:
            applied = [ev for ev, i in zip(events, slots, strict=True) if outcomes[i] == "applied"]
            # Held as the events were: applied and not checked, a stale state could stay.
            await self._held(lambda: verifier.check(applied, limits=self._limits), len(applied))
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
        async def apply() -> list[str]:
            return list(
                await self.store.apply(events, policy=self.settings.policy, limits=self._limits)
            )

        return await self._held(apply, len(events))

    async def _held(self, write: Callable[[], Awaitable[_T]], events: int) -> _T:
        """``write()``, held and retried with back-off while the store is unavailable."""
        backoff = Backoff(0.2, maximum=30.0)
        try:
            while True:
                try:
                    return await write()
                except StoreUnavailable as exc:
                    store_failed(exc)
                    HELD.set(events)
                    delay = backoff.next()
                    self._held_log.log(
                        logging.WARNING,
                        "store unavailable (%s); holding %d events, retrying in %.1f s: %s",
                        exc.reason,
                        events,
                        delay,
                        exc,
                    )
                    await asyncio.sleep(delay)
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

    async def _settle(self, batch: Sequence[Delivery], outcomes: Sequence[str]) -> None:
        """Reject what is set aside, one by one, then ack the rest with one ``multiple`` ack per
        session: it covers every earlier delivery, and those are all settled by now. A delivery
        of a session that is over is delivered again by the broker, which changes nothing."""
        last: dict[int, Delivery] = {}
        for delivery, outcome in zip(batch, outcomes, strict=True):
            if outcome in SET_ASIDE:
                try:  # to the dead-letter exchange
                    delivery.reject()
                except amqp.Unavailable as exc:
                    _unsettled(exc)
            else:
                last[id(delivery.session)] = delivery
        for delivery in last.values():
            try:
                delivery.ack(multiple=True)
            except amqp.Unavailable as exc:
                _unsettled(exc)


class _Decoded(NamedTuple):
    """A batch of deliveries, decoded: ``outcomes[i]`` of ``batch[i]`` (``ignored`` until its
    event, ``events[j]`` from ``messages[j]``, of delivery ``slots[j]``, is applied)."""

    batch: Sequence[Delivery]
    outcomes: list[str]
    events: list[TaskEvent]
    messages: list[Message]
    slots: list[int]


def _unsettled(exc: amqp.Unavailable) -> None:
    # The session a delivery came on is over (and, if it had not closed yet, now ends, so the
    # consumer reconnects): the broker delivers it again, and applying an event again changes
    # nothing.
    log.info("could not settle a delivery (%s); it will be redelivered", exc)


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
        verifier: Verifier | None = None,
    ) -> Listener:
        # A one-machine setup (the emulator's bare RabbitMQ) may lack the exchanges; on Pulse
        # they exist, so nothing is ever declared there.
        consumer = Consumer(
            settings,
            store,
            observer,
            declare_exchanges=True,
            recorder=recorder,
            verifier=verifier,
        )
        return cls(consumer, supervisor)

    async def _run(self) -> None:
        await self.consumer.run(self._stop)

    async def stop(self) -> None:
        """Drain and stop (bounded by the consumer's drain timeout)."""
        self._stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
