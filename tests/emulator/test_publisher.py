"""Publishing: in order, without loss on transient failures, to HTTP ingest and to RabbitMQ."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from coalescer.emulator.harness import TEST_OPTIONS, QueueEmulator
from coalescer.emulator.messages import Message
from coalescer.emulator.publisher import DeliveryError, Publisher

from .conftest import CheckedQueue, as_worker, check_message, claim_one, poll

AMQP_URL = os.environ.get("COALESCER_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def _message(n: int) -> Message:
    return Message("exchange/taskcluster-queue/v1/task-pending", f"primary.{n}", (), {"n": n})


class FlakySink:
    """Fails its first ``failures`` sends, then records what it is given."""

    name = "flaky"
    batch_size = 3

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.received: list[int] = []
        self.closed = False

    async def send(self, batch: Sequence[Message]) -> None:
        if self.failures:
            self.failures -= 1
            raise DeliveryError("not now")
        self.received += [m.payload["n"] for m in batch]

    async def close(self) -> None:
        self.closed = True


async def test_the_outbox_retries_and_keeps_order_after_transient_failures() -> None:
    sink = FlakySink(failures=3)
    publisher = Publisher([sink], backoff=0.001, max_backoff=0.005)
    publisher.publish([_message(0), _message(1)])  # before start: kept, not lost
    await publisher.start()
    for n in range(2, 10):
        publisher.publish([_message(n)])
    assert await publisher.flush(5.0)
    await publisher.stop()
    assert sink.received == list(range(10))
    assert [m["payload"]["n"] for m in publisher.published] == list(range(10))
    assert sink.closed and publisher.backlog == 0


class Receiver:
    """A stand-in coalescer ``POST /v1/events`` that fails its first requests with 503."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.events: list[dict[str, Any]] = []
        self.tokens: set[str | None] = set()
        app = Starlette(routes=[Route("/v1/events", self.ingest, methods=["POST"])])
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}/v1/events"
        config = uvicorn.Config(app, log_level="warning", ws="none", http="h11", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]})

    async def ingest(self, request: Request) -> Response:
        self.tokens.add(request.headers.get("authorization"))
        if self.failures:
            self.failures -= 1
            return Response(status_code=503)
        self.events += orjson.loads(await request.body())
        return Response(status_code=204)

    def __enter__(self) -> Receiver:
        self._thread.start()
        poll(lambda: self._server.started)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver(failures=2) as running:
        yield running


def test_messages_reach_a_coalescer_ingest_in_order_despite_failures(receiver: Receiver) -> None:
    options = dataclasses.replace(TEST_OPTIONS, publish_to=receiver.url, ingest_token="s3cret")
    with QueueEmulator(options) as em:
        queue = CheckedQueue(em.queue())
        task_id = em.create_task(routes=["coalesce.v1.key"])
        as_worker(em, claim_one(em, queue, task_id)).reportCompleted(task_id, 0)
        poll(lambda: len(receiver.events) == 5)
        sent = list(em.published)
    assert receiver.events == sent
    assert [e["exchange"].rsplit("/", 1)[1] for e in receiver.events] == [
        "task-defined",
        "task-pending",
        "task-running",
        "task-completed",
        "task-group-resolved",  # the task is its own group, now all resolved
    ]
    assert receiver.tokens == {"Bearer s3cret"}
    assert all(e["CC"] == ["route.coalesce.v1.key"] for e in receiver.events[:-1])
    assert receiver.events[-1]["CC"] == []


def _broker_reachable() -> bool:
    from urllib.parse import urlsplit

    parts = urlsplit(AMQP_URL)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), 2):
            return True
    except OSError:
        return False


@pytest.mark.integration
async def test_messages_reach_rabbitmq_with_exchange_routing_key_and_cc() -> None:
    import aio_pika

    if not _broker_reachable():
        pytest.fail(f"no AMQP broker at {AMQP_URL}: run the tests through scripts/with_services.py")
    route = f"coalesce.v1.emulator-test.{time.monotonic_ns()}"
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(
            "exchange/taskcluster-queue/v1/task-pending", aio_pika.ExchangeType.TOPIC, durable=True
        )
        listener = await channel.declare_queue(exclusive=True, auto_delete=True)
        await listener.bind(exchange, routing_key=f"route.{route}")  # matches only through CC
        options = dataclasses.replace(TEST_OPTIONS, pulse_url=AMQP_URL)
        with QueueEmulator(options) as em:
            task_id = em.create_task(routes=[route])
            async with asyncio.timeout(10):
                async with listener.iterator() as messages:
                    async for delivered in messages:
                        async with delivered.process():
                            break
    finally:
        await connection.close()
    assert delivered.exchange == "exchange/taskcluster-queue/v1/task-pending"
    assert delivered.routing_key == f"primary.{task_id}.0._._.emulator-test.worker.-.{task_id}._"
    assert delivered.headers["CC"] == [f"route.{route}"]
    assert delivered.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert delivered.content_type == "application/json"
    message = {
        "exchange": delivered.exchange,
        "routingKey": delivered.routing_key,
        "CC": delivered.headers["CC"],
        "payload": orjson.loads(delivered.body),
    }
    check_message(message)
    assert message["payload"]["status"]["taskId"] == task_id
