"""``coalescer listen`` as a real process behind a TCP proxy to the real RabbitMQ: a connection
cut every fraction of a second during a backlog, and a connection left half-open, both end in a
reconnect, with every event applied and none dead-lettered."""

# The broker and prefix fixtures are shared with test_pulse.py by importing them, which pytest
# supports and ruff takes for redefinitions.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import orjson
import pytest

from coalescer.store import Store
from tests.conftest import make_message
from tests.integration.test_pulse import (  # noqa: F401  (fixtures)
    Broker,
    bind_queue,
    broker,
    eventually,
    ids,
    prefix,
    primary_key,
    routes,
)
from tests.tcp_proxy import TcpProxy


class Listen:
    """A ``coalescer listen`` process logging JSON lines (to stderr, as in production)."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.out, self.err = workdir / "listen.out", workdir / "listen.err"
        argv = [sys.executable, "-m", "coalescer.cli", "listen", "--declare-exchanges"]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err)

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def lines(self) -> list[dict[str, Any]]:
        """The log, every line of which must be a JSON object (but the last while it is being
        written: a line is whole once its newline is)."""
        found = []
        text = self.stderr()
        for line in text[: text.rfind("\n") + 1].splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                raise AssertionError(f"a line that is not JSON in the log: {line!r}") from None
        return found

    def said(self, text: str) -> int:
        return sum(text in line["message"] for line in self.lines())

    async def consuming(self, times: int = 1) -> None:
        async def ready() -> bool:
            assert self.proc.poll() is None, self.stderr()
            return self.said("consuming queue/") >= times

        await eventually(ready, within=90, what="listen to consume")

    async def stop(self) -> int:
        """SIGTERM, and the exit code (waited for without blocking the proxy's event loop)."""
        self.proc.send_signal(signal.SIGTERM)

        async def exited() -> bool:
            return self.proc.poll() is not None

        await eventually(exited, what="listen to exit")
        return int(self.proc.returncode)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
async def proxy(amqp_url: str) -> AsyncIterator[TcpProxy]:
    parts = urlsplit(amqp_url)
    async with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672) as p:
        yield p


@pytest.fixture
def processes() -> Iterator[list[Listen]]:
    started: list[Listen] = []
    yield started
    for p in started:
        p.kill()


def through(amqp_url: str, proxy: TcpProxy) -> str:
    """``amqp_url`` with its host and port replaced by the proxy's."""
    parts = urlsplit(amqp_url)
    netloc = parts.netloc.rsplit("@", 1)
    address = f"127.0.0.1:{proxy.port}"
    return parts._replace(netloc=f"{netloc[0]}@{address}" if len(netloc) == 2 else address).geturl()


def environ(url: str, redis_url: str, queue: str, prefix: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COALESCER_", "PULSE_"))}
    env.update(
        REDIS_URL=redis_url,
        PULSE_URL=url,
        PULSE_QUEUE=queue,
        COALESCER_ROUTE_PREFIX=prefix,
        COALESCER_LOG_FORMAT="json",
        **extra,
    )
    return env


async def publish_fast(broker: Broker, messages: list[dict[str, Any]]) -> None:
    """Publish without confirms (a backlog of tens of thousands in seconds); the caller waits
    for the queue to hold them."""
    channel = await broker.connection.channel(publisher_confirms=False)
    try:
        exchanges: dict[str, aio_pika.abc.AbstractExchange] = {}
        for m in messages:
            if (exchange := exchanges.get(m["exchange"])) is None:
                exchange = exchanges[m["exchange"]] = await channel.get_exchange(m["exchange"])
            await exchange.publish(
                aio_pika.Message(
                    body=orjson.dumps(m["payload"]),
                    headers={"CC": list(m["CC"])},
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=primary_key(m),
            )
    finally:
        await channel.close()


async def pending_count(store: Store) -> int:
    return (await store.pending_counts(["k"]))["k"]


@pytest.mark.timeout(600)  # 50,000 events and 40 reconnects: about 2 minutes on a busy machine
async def test_a_connection_cut_every_fraction_of_a_second_ends_in_a_reconnect_each_time(
    amqp_url: str,
    redis_url: str,
    store: Store,
    broker: Broker,
    prefix: str,
    proxy: TcpProxy,
    tmp_path: Path,
    processes: list[Listen],
) -> None:
    backlog, more, cuts = 20_000, 30_000, 40
    messages = [make_message(t, routes=routes(prefix, "k")) for t in ids(backlog + more)]
    await bind_queue(broker, prefix)
    await publish_fast(broker, messages[:backlog])

    async def queued() -> bool:
        return await broker.depth() == backlog

    await eventually(queued, what="the backlog in the queue")
    listen = Listen(environ(through(amqp_url, proxy), redis_url, broker.queue, prefix), tmp_path)
    processes.append(listen)
    await listen.consuming()
    # More events arrive all along the churn, so that cuts keep meeting deliveries and acks.
    publishing = asyncio.create_task(publish_fast(broker, messages[backlog:]))
    rng = random.Random(22)
    started = time.monotonic()
    while proxy.cuts < cuts:
        # Each cut falls on a connection that consumes (a busy machine may take longer to open
        # the next one than the cadence: a cut with no connection open would test nothing),
        await listen.consuming(times=proxy.cuts + 1)
        # 0.3-0.4 s into it: the fault's own rhythm, not a wait for something.
        await asyncio.sleep(rng.uniform(0.3, 0.4))
        assert proxy.cut() == 1, f"not one connection open after {proxy.cuts} cuts"
        assert listen.proc.poll() is None, f"exited after {proxy.cuts} cuts: {listen.stderr()}"
    churn = time.monotonic() - started
    await publishing
    # The last cut is answered too before the stop (a stop that meets a connection just lost
    # rightly says nothing of it: every event may be applied by then).
    await listen.consuming(times=cuts + 1)

    async def all_applied() -> bool:
        assert listen.proc.poll() is None, listen.stderr()
        return await pending_count(store) == len(messages)

    await eventually(all_applied, within=60, what="every event applied after the churn")
    assert await broker.dead() == []
    assert await listen.stop() == 0, listen.stderr()
    # Each connection lost is said once, as a JSON line, and followed by a reconnect.
    lost = listen.said("lost the connection to")
    assert lost == cuts, (lost, proxy.cuts, listen.stderr()[-3000:])
    assert listen.said("reconnected to the broker") >= lost
    assert not [line for line in listen.lines() if line["level"] in ("error", "critical")]
    assert listen.out.read_text() == ""
    print(f"{proxy.cuts} cuts in {churn:.1f} s, {lost} connections lost, {proxy.accepted} opened")


async def test_a_connection_dropped_while_declaring_the_queue_is_opened_again(
    amqp_url: str,
    redis_url: str,
    store: Store,
    broker: Broker,
    prefix: str,
    proxy: TcpProxy,
    tmp_path: Path,
    processes: list[Listen],
) -> None:
    # About 700 bytes from the broker is past the handshake and before the queue is declared.
    proxy.cut_early(after=700, connections=2)
    listen = Listen(environ(through(amqp_url, proxy), redis_url, broker.queue, prefix), tmp_path)
    processes.append(listen)
    await listen.consuming()
    assert listen.said("while declaring") == 2, listen.stderr()
    tasks = ids(50)
    await broker.publish_all([make_message(t, routes=routes(prefix, "k")) for t in tasks])

    async def applied() -> bool:
        return await pending_count(store) == len(tasks)

    await eventually(applied, what="the events applied")
    assert await listen.stop() == 0, listen.stderr()
    assert listen.out.read_text() == ""


async def test_a_half_open_connection_is_found_dead_within_a_minute_by_default(
    amqp_url: str,
    redis_url: str,
    store: Store,
    broker: Broker,
    prefix: str,
    proxy: TcpProxy,
    tmp_path: Path,
    processes: list[Listen],
) -> None:
    assert "heartbeat" not in amqp_url  # the default heartbeat is the one tested
    first, then = ids(100), ids(100)
    listen = Listen(environ(through(amqp_url, proxy), redis_url, broker.queue, prefix), tmp_path)
    processes.append(listen)
    await listen.consuming()
    await broker.publish_all([make_message(t, routes=routes(prefix, "k")) for t in first])

    async def applied(n: int) -> bool:
        assert listen.proc.poll() is None, listen.stderr()
        return await pending_count(store) == n

    await eventually(lambda: applied(len(first)), what="the first events applied")
    # The connection stays open at both ends and carries nothing more: the broker's host is
    # gone, or a middlebox forgot the connection.
    assert proxy.freeze() == 1
    frozen = time.monotonic()
    # Published to the frozen connection's consumer (it has room under its prefetch limit) or
    # to the next: either way they must be applied within a minute.
    await broker.publish_all([make_message(t, routes=routes(prefix, "k")) for t in then])
    await eventually(lambda: applied(len(first) + len(then)), within=65, what="ingest to resume")
    took = time.monotonic() - frozen
    assert took < 60
    lost = [line for line in listen.lines() if "lost the connection" in line["message"]]
    assert len(lost) == 1 and "heartbeat" in lost[0]["message"], lost
    assert await broker.dead() == []
    assert await listen.stop() == 0, listen.stderr()
    print(f"ingest resumed {took:.1f} s after the connection froze ({lost[0]['message']})")
