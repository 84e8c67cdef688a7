"""The Pulse consumer against the real RabbitMQ and Redis: messages published to the queue's real
exchanges, with real primary routing keys and CC headers, reach the index.

Exchange names are shared by every test (they are the real ones), so each test binds its own
route prefix, ``coalesce.t<uuid>``, and its own queue, deleted afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, cast
from urllib.parse import urlparse

import aio_pika
import orjson
import pytest
import taskcluster

from coalescer.errors import ConfigError, StoreUnavailable
from coalescer.ingest.pulse import Consumer
from coalescer.ingest.topology import bindings, dead_letter_names, queue_arguments
from coalescer.ingest.verify import Verifier
from coalescer.model import TaskEvent
from coalescer.observe import Observer
from coalescer.settings import Settings
from coalescer.store import Store, open_store
from tests.conftest import AMQP_URL, make_message
from tests.redis_server import RedisServer, redis_server

_EVENTS = taskcluster.QueueEvents({"rootUrl": "https://tc.example.com"})
_METHODS = {
    "task-pending": "taskPending",
    "task-running": "taskRunning",
    "task-completed": "taskCompleted",
    "task-failed": "taskFailed",
    "task-exception": "taskException",
}


def ids(n: int) -> list[str]:
    return [taskcluster.slugid.nice() for _ in range(n)]


def at(second: int) -> str:
    return time.strftime("2030-01-01T%H:%M:%S.000Z", time.gmtime(second))


def primary_key(message: dict[str, Any]) -> str:
    """The primary routing key Taskcluster publishes with, built by the official client."""
    payload, status = message["payload"], message["payload"]["status"]
    ref = getattr(_EVENTS, _METHODS[message["exchange"].rsplit("/", 1)[1]])(
        taskId=status["taskId"],
        runId=payload.get("runId", "_"),
        workerGroup=payload.get("workerGroup", "_"),
        workerId=payload.get("workerId", "_"),
        provisionerId=status["provisionerId"],
        workerType=status["workerType"],
        schedulerId=status["schedulerId"],
        taskGroupId=status["taskGroupId"],
        reserved="_",
    )
    key = str(ref["routingKeyPattern"])
    assert "*" not in key and "#" not in key
    return key


class Broker:
    """The test's side of RabbitMQ: publishes as the queue service does, and looks at queues."""

    def __init__(self, connection: aio_pika.abc.AbstractConnection, prefix: str) -> None:
        self.connection = connection
        self.prefix = prefix
        self.queue = f"queue/guest/coalescer-test-{uuid.uuid4().hex[:12]}"
        self.exchanges: dict[str, aio_pika.abc.AbstractExchange] = {}

    async def setup(self) -> None:
        self.channel = await self.connection.channel()  # publisher confirms: a publish is sent
        for exchange, _ in bindings(self.prefix):
            self.exchanges[exchange] = await self.channel.declare_exchange(
                exchange, aio_pika.ExchangeType.TOPIC, durable=True
            )

    async def publish(self, message: dict[str, Any], *, body: bytes | None = None) -> None:
        await self.exchanges[message["exchange"]].publish(
            aio_pika.Message(
                body=orjson.dumps(message["payload"]) if body is None else body,
                headers={"CC": list(message["CC"])},
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=primary_key(message),
        )

    async def publish_all(self, messages: list[dict[str, Any]]) -> None:
        for start in range(0, len(messages), 200):  # confirms awaited 200 at a time
            await asyncio.gather(*(self.publish(m) for m in messages[start : start + 200]))

    async def depth(self, queue: str | None = None) -> int:
        """Messages ready in ``queue`` (unacknowledged ones are not counted)."""
        async with self.connection.channel() as channel:
            declared = await channel.declare_queue(queue or self.queue, passive=True)
            count = declared.declaration_result.message_count
            return int(count or 0)

    async def dead(self) -> list[aio_pika.abc.AbstractIncomingMessage]:
        found = []
        async with self.connection.channel() as channel:
            queue = await channel.declare_queue(dead_letter_names(self.queue)[1], passive=True)
            while (got := await queue.get(no_ack=True, fail=False, timeout=5)) is not None:
                found.append(got)
        return found

    async def cleanup(self) -> None:
        async with self.connection.channel() as channel:
            dead_exchange, dead_queue = dead_letter_names(self.queue)
            await channel.queue_delete(self.queue)
            await channel.queue_delete(dead_queue)
            await channel.exchange_delete(dead_exchange)


async def bind_queue(broker: Broker, prefix: str) -> None:
    """Declare and bind the queue as ``listen`` would, so messages wait in it before it runs."""
    max_length = Settings().pulse_max_length
    async with broker.connection.channel() as channel:
        queue = await channel.declare_queue(
            broker.queue, durable=True, arguments=queue_arguments(broker.queue, max_length)
        )
        for exchange, pattern in bindings(prefix):
            await queue.bind(exchange, pattern)


def routes(prefix: str, *keys: str) -> tuple[str, ...]:
    return tuple(f"{prefix}.{k}" for k in keys)


@pytest.fixture
def prefix() -> str:
    return f"coalesce.t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def broker(amqp_url: str, prefix: str) -> AsyncIterator[Broker]:
    connection = await aio_pika.connect(amqp_url)
    b = Broker(connection, prefix)
    await b.setup()
    yield b
    await b.cleanup()
    await connection.close()


@pytest.fixture
def pulse_settings(redis_url: str, amqp_url: str, prefix: str, broker: Broker) -> Settings:
    return Settings.from_environ(
        {
            "REDIS_URL": redis_url,
            "PULSE_URL": amqp_url,
            "PULSE_QUEUE": broker.queue,
            "COALESCER_ROUTE_PREFIX": prefix,
            "COALESCER_PULSE_PREFETCH": "32",
        }
    )


@contextlib.asynccontextmanager
async def consuming(consumer: Consumer) -> AsyncIterator[Consumer]:
    """Run ``consumer`` while the block runs; it must still be running at the end."""
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await eventually(lambda: _ready(consumer, task), what="the consumer to start")
        yield consumer
        assert not task.done(), task
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def _ready(consumer: Consumer, task: asyncio.Task[None]) -> bool:
    if task.done():
        task.result()
    return consumer.consuming.is_set()


async def eventually(
    check: Callable[[], Awaitable[bool]], *, within: float = 30.0, what: str = "a condition"
) -> None:
    """Poll ``check`` until it is true; fail after ``within`` seconds."""
    give_up = time.monotonic() + within
    while not await check():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {within:.0f} s waiting for {what}")
        await asyncio.sleep(0.02)


def make_consumer(settings: Settings, store: Store, **options: Any) -> Consumer:
    options.setdefault("declare_exchanges", True)
    options.setdefault("reconnect_interval", 0.5)
    return Consumer(settings, store, Observer(store), **options)


async def pending(store: Store, key: str) -> list[str]:
    return [
        t.task_id for t in await store.pending(key, now_ms=int(time.time() * 1000), limit=10_000)
    ]


def close_connection(name: str) -> int:
    """Close, from the broker's side, every connection whose name starts with ``name``; only
    those: other tests share this broker."""
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    listing = subprocess.run(
        [ctl, "-q", "list_connections", "pid", "client_properties"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if listing.returncode != 0:
        pytest.fail(f"rabbitmqctl cannot list connections: {listing.stderr.strip()}")
    closed = 0
    for line in listing.stdout.splitlines()[1:]:
        pid, _, props = line.partition("\t")
        if '{"connection_name","' + name in props:
            subprocess.run([ctl, "-q", "close_connection", pid, "test cut"], check=True, timeout=30)
            closed += 1
    return closed


#: Cutting a connection from the broker's side runs rabbitmqctl on this machine, which reaches
#: only a broker that runs here (as `make test` arranges); a test broker on another host
#: (COALESCER_TEST_AMQP_URL) cannot be cut this way, and only then are these tests skipped.
needs_rabbitmqctl = pytest.mark.skipif(
    urlparse(AMQP_URL).hostname not in ("127.0.0.1", "localhost", "::1"),
    reason="the test broker is on another host: rabbitmqctl here cannot close its connections",
)


# -- tests ----------------------------------------------------------------------------------------
async def test_messages_on_the_real_exchanges_reach_the_index(
    pulse_settings: Settings, store: Store, broker: Broker, prefix: str
) -> None:
    a, b, c, d = ids(4)
    async with consuming(make_consumer(pulse_settings, store)):
        await broker.publish_all(
            [
                make_message(a, routes=routes(prefix, "x"), scheduled=at(2)),
                make_message(b, routes=(*routes(prefix, "x", "y"), "index.other"), scheduled=at(1)),
                make_message(c, "running", routes=routes(prefix, "y")),
                # Not CC'ed to our prefix: never delivered to our queue.
                make_message(d, routes=("coalesce.v1.x",)),
            ]
        )
        await eventually(lambda: _handled(store, 3), what="three messages handled")
        assert await pending(store, "x") == [b, a]
        assert await pending(store, "y") == [b]
    stats = await store.stats()
    assert stats["events_applied"] == "3" and stats["total_msgs_handled"] == "3"
    assert await broker.depth() == 0


class Checked:
    """A verifier that keeps what it was given to check (``coalescer.ingest.verify``)."""

    def __init__(self) -> None:
        self.events: list[TaskEvent] = []

    async def check(self, applied: Sequence[TaskEvent], *, limits: Any = None) -> int:
        self.events += applied
        return 0


async def test_what_the_consumer_applied_is_checked_against_the_queue(
    pulse_settings: Settings, store: Store, broker: Broker, prefix: str
) -> None:
    a, b = ids(2)
    checked = Checked()
    consumer = make_consumer(pulse_settings, store, verifier=cast(Verifier, checked))
    first = make_message(a, routes=routes(prefix, "x"), scheduled=at(1))
    async with consuming(consumer):
        await broker.publish_all([first, make_message(b, routes=routes(prefix, "x"))])
        await eventually(lambda: _handled(store, 2), what="two messages handled")
        await broker.publish_all([first])  # stale: applied nowhere, nothing to check
        await eventually(lambda: _handled(store, 3), what="the duplicate handled")
    assert sorted(e.task_id for e in checked.events) == sorted([a, b])


async def _equals(got: Awaitable[Any], expected: Any) -> bool:
    return await got == expected


async def test_duplicates_and_reordering_change_nothing(
    pulse_settings: Settings, store: Store, broker: Broker, prefix: str
) -> None:
    rng = random.Random(7)
    tasks = ids(30)
    messages, expected = [], []
    for i, task in enumerate(tasks):
        r = routes(prefix, "k")
        life = [make_message(task, routes=r, scheduled=at(i))]
        kind = i % 3
        if kind >= 1:  # runs, then resolves
            life.append(make_message(task, "running", routes=r, scheduled=at(i)))
            life.append(make_message(task, "completed", routes=r, scheduled=at(i)))
        if kind == 2:  # ... with exception worker-shutdown, and is retried: pending again
            life[-1] = make_message(
                task, "exception", routes=r, scheduled=at(i), reason="worker-shutdown"
            )
            life.append(make_message(task, "pending", run_id=1, routes=r, scheduled=at(i)))
        if kind != 1:
            expected.append(task)
        messages += life + rng.sample(life, k=len(life) // 2 + 1)  # and duplicates
    rng.shuffle(messages)
    async with consuming(make_consumer(pulse_settings, store)):
        await broker.publish_all(messages)
        await eventually(lambda: _handled(store, len(messages)), what="every message handled")
    assert await pending(store, "k") == expected  # oldest first, retried tasks in place
    stats = await store.stats()
    assert int(stats["events_applied"]) + int(stats["events_stale"]) == len(messages)


async def _handled(store: Store, n: int) -> bool:
    return int((await store.stats()).get("total_msgs_handled", 0)) >= n


async def test_a_poison_message_is_dead_lettered_and_the_consumer_goes_on(
    pulse_settings: Settings, store: Store, broker: Broker, prefix: str
) -> None:
    a, b, c = ids(3)
    bad_schema = make_message(b, routes=routes(prefix, "k"))
    del bad_schema["payload"]["status"]["deadline"]
    async with consuming(make_consumer(pulse_settings, store)):
        await broker.publish(make_message(a, routes=routes(prefix, "k")), body=b"{not json")
        await broker.publish(bad_schema)
        await broker.publish(make_message(c, routes=routes(prefix, "k")))
        await eventually(lambda: _equals(pending(store, "k"), [c]), what="the good message")
        await eventually(lambda: _handled(store, 3), what="all three handled")
    dead = await broker.dead()
    assert len(dead) == 2
    assert {m.headers["x-death"][0]["reason"] for m in dead} == {"rejected"}  # type: ignore[index]
    assert dead[0].body == b"{not json" and list(dead[0].headers["CC"]) == [f"route.{prefix}.k"]  # type: ignore[arg-type]
    stats = await store.stats()
    assert (stats["events_invalid"], stats["events_applied"]) == ("2", "1")
    assert await broker.depth() == 0


async def test_the_next_batch_is_decoded_while_one_is_written_and_writes_never_overlap(
    pulse_settings: Settings, store: Store, broker: Broker, prefix: str
) -> None:
    tasks = ids(320)
    consumer = make_consumer(pulse_settings, store, batch_size=16)  # half the prefetch
    writes_in_flight, most_in_flight, decoded_during_a_write = 0, 0, 0
    slow_apply, plain_decode = store.apply, consumer._decode

    async def apply(*args: Any, **kwargs: Any) -> Any:
        nonlocal writes_in_flight, most_in_flight
        writes_in_flight += 1
        most_in_flight = max(most_in_flight, writes_in_flight)
        try:
            await asyncio.sleep(0.05)  # a slow store: the broker keeps delivering meanwhile
            return await slow_apply(*args, **kwargs)
        finally:
            writes_in_flight -= 1

    def decode(batch: Any) -> Any:
        nonlocal decoded_during_a_write
        decoded_during_a_write += writes_in_flight
        return plain_decode(batch)

    store.apply = apply  # type: ignore[method-assign]
    consumer._decode = decode  # type: ignore[method-assign]
    async with consuming(consumer):
        await broker.publish_all([make_message(t, routes=routes(prefix, "k")) for t in tasks])
        await eventually(lambda: _count(store, "k", len(tasks)), what="every event applied")
        await eventually(lambda: _handled(store, len(tasks)), what="every event counted")
    assert most_in_flight == 1  # batches are applied, and acknowledged, one after another
    assert decoded_during_a_write > 0
    assert await broker.depth() == 0


async def test_a_write_that_fails_stops_the_consumer_at_once_not_at_the_next_batch(
    pulse_settings: Settings, store: Store, broker: Broker, prefix: str
) -> None:
    consumer = make_consumer(pulse_settings, store)

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug while counting")

    consumer.observer.ingest = broken  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await eventually(lambda: _ready(consumer, task), what="the consumer to start")
        await broker.publish(make_message(ids(1)[0], routes=routes(prefix, "k")))
        # Nothing else is published: the pump must not wait for another batch to say so.
        with pytest.raises(RuntimeError, match="a bug while counting"):
            await asyncio.wait_for(task, 10)
    finally:
        stop.set()
        if not task.done():
            task.cancel()


@needs_rabbitmqctl
async def test_a_connection_cut_mid_stream_loses_no_event(
    pulse_settings: Settings, store: Store, broker: Broker, prefix: str
) -> None:
    tasks = ids(1200)
    messages = [make_message(t, routes=routes(prefix, "k")) for t in tasks]
    name = f"cut-test {uuid.uuid4().hex}"
    async with consuming(make_consumer(pulse_settings, store, connection_name=name)):
        await broker.publish_all(messages[:600])
        await eventually(lambda: _handled(store, 50), what="the stream to start")
        assert await asyncio.to_thread(close_connection, name) == 1
        await broker.publish_all(messages[600:])  # only a reconnected consumer gets these
        await eventually(lambda: _count(store, "k", len(tasks)), what="every event applied")
    assert sorted(await pending(store, "k")) == sorted(tasks)
    assert await broker.depth() == 0


async def _count(store: Store, key: str, n: int) -> bool:
    return len(await pending(store, key)) == n


async def test_redis_down_holds_deliveries_and_applies_them_when_it_is_back(
    pulse_settings: Settings, broker: Broker, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    redis = RedisServer()
    redis.start()
    store = await open_store(redis.url, grace_seconds=3600)
    try:
        first, later = ids(5), ids(5)
        async with consuming(make_consumer(pulse_settings, store)):
            await broker.publish_all([make_message(t, routes=routes(prefix, "k")) for t in first])
            await eventually(lambda: _count(store, "k", 5), what="the first events")
            redis.kill()
            await broker.publish_all([make_message(t, routes=routes(prefix, "k")) for t in later])
            await eventually(lambda: _async("; holding" in caplog.text), what="a retry")
            assert await broker.depth() == 0  # delivered, held unacknowledged: not lost
            redis.start()  # empty: it kept nothing on disk
            await eventually(
                lambda: _equals(_sorted(_once_back(pending(store, "k"))), sorted(later)),
                what="the held events",
            )
        assert await broker.depth() == 0 and await broker.dead() == []
    finally:
        await store.close()
        redis.stop()


async def test_a_full_redis_holds_deliveries_and_dead_letters_none(
    pulse_settings: Settings, broker: Broker, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """OOM is the store's condition, never the events' fault: nothing is dead-lettered, the
    consumer keeps running, and every event is applied once Redis has room again."""
    with redis_server() as redis:
        store = await open_store(redis.url, grace_seconds=3600)
        try:
            tasks = {key: ids(6) for key in ("a", "b", "c", "d", "e")}  # 30 events
            async with consuming(make_consumer(pulse_settings, store)) as consumer:
                redis.fill()
                await broker.publish_all(
                    [
                        make_message(t, routes=routes(prefix, key))
                        for key, batch in tasks.items()
                        for t in batch
                    ]
                )
                await eventually(lambda: _async("(full); holding" in caplog.text), what="a hold")
                assert await broker.depth() == 0  # delivered, held unacknowledged
                redis.unfill()
                for key, batch in tasks.items():
                    await eventually(
                        lambda b=batch, k=key: _equals(_sorted(pending(store, k)), sorted(b)),
                        what=f"the held events of {key}",
                    )
                assert consumer.consuming.is_set()
            assert await broker.depth() == 0 and await broker.dead() == []
            assert "dead-lettering" not in caplog.text
        finally:
            await store.close()


async def _async(value: bool) -> bool:
    return value


async def _sorted(got: Awaitable[list[str]]) -> list[str]:
    return sorted(await got)


async def _once_back(got: Awaitable[list[str]]) -> list[str]:
    """The test's own read, while Redis comes back: a connection the restart closed is
    unavailable once, and the next poll reads again."""
    try:
        return await got
    except StoreUnavailable:
        return []


async def test_a_full_queue_refuses_new_messages_instead_of_dropping_old_ones(
    amqp_url: str, redis_url: str, broker: Broker, prefix: str
) -> None:
    async with broker.connection.channel() as channel:
        queue = await channel.declare_queue(
            broker.queue, durable=True, arguments=queue_arguments(broker.queue, 3)
        )
        for exchange, pattern in bindings(prefix):
            await queue.bind(exchange, pattern)
    tasks = ids(4)
    for task in tasks[:3]:
        await broker.publish(make_message(task, routes=routes(prefix, "k")))
    with pytest.raises(aio_pika.exceptions.DeliveryError):
        await broker.publish(make_message(tasks[3], routes=routes(prefix, "k")))
    assert await broker.depth() == 3


async def test_a_queue_declared_with_other_arguments_is_a_clear_error(
    pulse_settings: Settings, store: Store, broker: Broker
) -> None:
    async with broker.connection.channel() as channel:
        await channel.declare_queue(
            broker.queue, durable=True, arguments=queue_arguments(broker.queue, 7)
        )
    with pytest.raises(ConfigError, match="COALESCER_PULSE_MAX_LENGTH"):
        await make_consumer(pulse_settings, store).run(asyncio.Event())


async def test_serve_with_the_embedded_store_consumes_pulse_itself(
    amqp_url: str, broker: Broker, prefix: str
) -> None:
    from coalescer.web.app import create_app

    settings = Settings.from_environ(
        {"PULSE_URL": amqp_url, "PULSE_QUEUE": broker.queue, "COALESCER_ROUTE_PREFIX": prefix}
    )
    await bind_queue(broker, prefix)  # so that what is published now waits for the app
    a, b = ids(2)
    await broker.publish_all(
        [
            make_message(a, routes=routes(prefix, "k"), scheduled=at(2)),
            make_message(b, routes=routes(prefix, "k"), scheduled=at(1)),
        ]
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        store: Store = app.state.store
        assert store.embedded
        await eventually(lambda: _equals(pending(store, "k"), [b, a]), what="the app to consume")
    assert await broker.depth() == 0
