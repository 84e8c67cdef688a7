"""Consume and ack, nothing else: pika's asyncio connection against aio-pika (and aiormq).

Why ``coalescer listen`` consumes through pika (``coalescer/ingest/amqp.py``) while the topology
is declared through aio-pika: this measures the two client libraries alone on the same backlog.
Each round declares a topic exchange and one durable queue per client, all bound with ``#``,
and publishes ``--messages`` real-shaped Pulse messages (body and ``CC`` header, persistent,
with confirms) once, which fills every queue with the same backlog. Each client then drains its
own queue, in an order that rotates from round to round, the way ``listen`` would: prefetch
``--prefetch``, one ``multiple`` ack per half prefetch, each delivery's body and headers read.

* **pika**: :class:`coalescer.ingest.amqp.Session`, the consumer's own session (a synchronous
  callback per delivery);
* **aio-pika**: ``Queue.consume`` with an async callback (what a port of the consumer would
  use); ``IncomingMessage.ack(multiple=True)``;
* **aiormq**: aio-pika's own protocol layer, ``Channel.basic_consume`` (a task per delivery).

All run in this one process on uvloop (as ``listen`` does), one at a time. The clock and the
process's CPU time start when the consumer is registered and stop at the last ack's flush. The
machine is shared, so each line gives the median of ``--rounds`` rounds of messages/s and of
messages per CPU-second (steadier), and the ratio of pika's to each other's. Loopback only, a
few seconds a round; everything it declares is deleted.

    .venv/bin/python scripts/with_services.py .venv/bin/python bench/amqp_clients.py \\
        [--rounds 3] [--messages 20000] [--prefetch 2048]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika
import aiormq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the test suite's message builders

import backlog  # noqa: E402 (bench/backlog.py)

from coalescer.ingest import amqp  # noqa: E402

LIMIT_S = 60.0  # per drain
CLIENTS = ("pika", "aio-pika", "aiormq")

Drain = Callable[[str, str, int, int], Awaitable[tuple[float, float]]]


class Clock:
    """Wall-clock and process CPU seconds from :meth:`start` to :meth:`stop`."""

    def start(self) -> None:
        self.wall, self.cpu = time.monotonic(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.monotonic() - self.wall, time.process_time() - self.cpu


def touch(body: bytes, headers: Any) -> None:
    # What the consumer reads of every delivery (pulse.decode): the body and the CC header.
    if not body or not (headers or {}).get("CC"):
        raise AssertionError("a delivery without its body or CC header")


async def drain_pika(url: str, queue: str, n: int, prefetch: int) -> tuple[float, float]:
    session = await amqp.Session.open(url, name="bench pika", prefetch=prefetch)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    batch = prefetch // 2
    seen = 0

    def deliver(delivery: amqp.Delivery) -> None:
        nonlocal seen
        touch(delivery.body, delivery.headers)
        seen += 1
        if seen % batch == 0 or seen == n:
            delivery.ack(multiple=True)
        if seen == n and not done.done():
            done.set_result(None)

    clock = Clock()
    clock.start()
    try:
        await session.consume(queue, deliver)
        await asyncio.wait_for(done, LIMIT_S)
        return clock.stop()
    finally:
        await session.wait_closed()


async def drain_aio_pika(url: str, queue: str, n: int, prefetch: int) -> tuple[float, float]:
    connection = await aio_pika.connect(url)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    batch = prefetch // 2
    seen = 0

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal seen
        touch(message.body, message.headers)
        seen += 1
        if seen % batch == 0 or seen == n:
            await message.ack(multiple=True)
            if seen == n and not done.done():
                done.set_result(None)

    clock = Clock()
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        declared = await channel.declare_queue(queue, passive=True)
        clock.start()
        await declared.consume(on_message)
        await asyncio.wait_for(done, LIMIT_S)
        return clock.stop()
    finally:
        await connection.close()


async def drain_aiormq(url: str, queue: str, n: int, prefetch: int) -> tuple[float, float]:
    connection = await aiormq.connect(url)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    batch = prefetch // 2
    seen = 0
    clock = Clock()
    try:
        channel = await connection.channel()
        await channel.basic_qos(prefetch_count=prefetch)

        async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
            nonlocal seen
            touch(message.body, message.header.properties.headers)
            seen += 1
            if seen % batch == 0 or seen == n:
                assert message.delivery_tag is not None
                await channel.basic_ack(message.delivery_tag, multiple=True)
                if seen == n and not done.done():
                    done.set_result(None)

        clock.start()
        await channel.basic_consume(queue, on_message)
        await asyncio.wait_for(done, LIMIT_S)
        return clock.stop()
    finally:
        await connection.close()


DRAINS: dict[str, Drain] = {
    "pika": drain_pika,
    "aio-pika": drain_aio_pika,
    "aiormq": drain_aiormq,
}


async def fill(channel: aio_pika.abc.AbstractChannel, exchange_name: str, n: int) -> float:
    exchange = await channel.get_exchange(exchange_name)
    return await backlog.publish(lambda _: exchange, backlog.messages("coalesce.bench", n))


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg()[:1])


async def main(args: argparse.Namespace) -> int:
    url = os.environ.get("COALESCER_TEST_AMQP_URL") or os.environ.get("PULSE_URL")
    if not url:
        sys.exit("run under scripts/with_services.py, or set PULSE_URL")
    tag = uuid.uuid4().hex[:8]
    exchange = f"exchange/guest/bench-amqp-clients-{tag}"
    queues = {client: f"queue/guest/bench-amqp-clients-{tag}-{client}" for client in CLIENTS}
    connection = await aio_pika.connect(url)
    channel = await connection.channel()
    rates: dict[str, list[float]] = {c: [] for c in CLIENTS}
    per_cpu: dict[str, list[float]] = {c: [] for c in CLIENTS}
    print(f"{args.messages} messages a round, prefetch {args.prefetch}, load {load()} at start")
    try:
        await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, auto_delete=False)
        for name in queues.values():
            declared = await channel.declare_queue(name, durable=True)
            await declared.bind(exchange, "#")
        for r in range(args.rounds):
            took = await fill(channel, exchange, args.messages)
            order = CLIENTS[r % len(CLIENTS) :] + CLIENTS[: r % len(CLIENTS)]
            line = [f"round {r + 1}: published in {took:.1f} s;"]
            for client in order:
                wall, cpu = await DRAINS[client](url, queues[client], args.messages, args.prefetch)
                rates[client].append(args.messages / wall)
                per_cpu[client].append(args.messages / cpu)
                line.append(f"{client} {args.messages / wall:,.0f}/s")
            print(" ".join(line), flush=True)
            for name in queues.values():  # a client that stopped early leaves no remainder
                await (await channel.get_queue(name)).purge()
        print(f"load {load()} at end; medians of {args.rounds} rounds:")
        base_rate = statistics.median(rates["pika"])
        base_cpu = statistics.median(per_cpu["pika"])
        print(f"{'client':<10} {'messages/s':>11} {'per CPU-s':>10} {'pika, x':>16}")
        for client in CLIENTS:
            rate, cpu = statistics.median(rates[client]), statistics.median(per_cpu[client])
            ratio = f"{base_rate / rate:.2f}, {base_cpu / cpu:.2f}"
            print(f"{client:<10} {rate:>11,.0f} {cpu:>10,.0f} {ratio:>16}")
        return 0
    finally:
        for name in queues.values():
            await channel.queue_delete(name)
        await channel.exchange_delete(exchange)
        await connection.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--prefetch", type=int, default=2048, help="listen's default")
    arguments = parser.parse_args()
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        sys.exit(runner.run(main(arguments)))
