"""What the store's faults cost, counted: events lost and dead-lettered, time to recover, and
how fast a query fails while Redis is frozen. Each fault is injected into a ``redis-server`` of
the script's own; RabbitMQ is the one ``COALESCER_TEST_AMQP_URL`` names. Bounded to a minute.

    .venv/bin/python scripts/with_services.py .venv/bin/python bench/faults.py [--events 3000]

1. Redis full (``maxmemory`` reached, ``noeviction``) under ``listen``: events published while
   it is full are held unacknowledged; memory returns; time until every one is applied.
2. Redis full under HTTP ingest: 5 requests of 500 events answered 503; memory returns; the
   client retries; events applied exactly once.
3. Redis frozen (SIGSTOP): time to a 503 for a query, against the worker's 5 s timeout.
4. Redis killed and restarted empty under ``listen``: events published meanwhile, all applied.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import taskcluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test suite's helpers

from coalescer.ingest.pulse import Consumer
from coalescer.observe import Observer
from coalescer.settings import Settings
from coalescer.store import Store, open_store
from coalescer.web.app import create_app
from tests.conftest import make_message
from tests.integration.test_pulse import Broker, bind_queue
from tests.redis_server import redis_server

AMQP_URL = os.environ.get("COALESCER_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
AUTH = {"Authorization": "Bearer bench"}


def ids(n: int) -> list[str]:
    return [taskcluster.slugid.nice() for _ in range(n)]


async def until(check: Any, within: float = 60.0) -> float:
    """Seconds until ``check()`` is true (polled every 20 ms); fails after ``within``."""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > within:
            raise SystemExit(f"not done within {within:.0f} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def indexed(store: Store, tasks: dict[str, list[str]]) -> int:
    found = 0
    for key, batch in tasks.items():
        found += len(await store.known(key, batch))
    return found


async def pulse_fault(n: int, fault: str) -> dict[str, Any]:
    prefix = f"coalesce.b{uuid.uuid4().hex[:10]}"
    connection = await aio_pika.connect(AMQP_URL)
    broker = Broker(connection, prefix)
    await broker.setup()
    await bind_queue(broker, prefix)
    tasks = {f"k{i}": ids(n // 50) for i in range(50)}
    messages = [
        make_message(t, routes=(f"{prefix}.{key}",)) for key, batch in tasks.items() for t in batch
    ]
    settings = Settings.from_environ(
        {"PULSE_URL": AMQP_URL, "PULSE_QUEUE": broker.queue, "COALESCER_ROUTE_PREFIX": prefix}
    )
    try:
        with redis_server() as redis:
            store = await open_store(redis.url, grace_seconds=3600)
            consumer = Consumer(settings, store, Observer(store), declare_exchanges=True)
            stop = asyncio.Event()
            running = asyncio.create_task(consumer.run(stop))
            await consumer.consuming.wait()
            if fault == "full":
                redis.fill()
            else:
                redis.kill()
            await broker.publish_all(messages)
            await asyncio.sleep(2.0)  # the consumer holds what it got meanwhile
            held = await indexed(store, tasks) if fault == "full" else 0
            if fault == "full":
                redis.unfill()
            else:
                redis.start()  # empty
            recovery = await until(lambda: _all(store, tasks, len(messages)))
            stop.set()
            await running
            dead = len(await broker.dead())
            await store.close()
            return {
                "published": len(messages),
                "applied while held": held,
                "lost": len(messages) - await _count_on(redis.url, tasks),
                "dead-lettered": dead,
                "recovery s": recovery,
            }
    finally:
        await broker.cleanup()
        await connection.close()


async def _all(store: Store, tasks: dict[str, list[str]], n: int) -> bool:
    return await indexed(store, tasks) == n


async def _count_on(url: str, tasks: dict[str, list[str]]) -> int:
    store = await open_store(url, grace_seconds=3600)
    try:
        return await indexed(store, tasks)
    finally:
        await store.close()


async def http_full() -> dict[str, Any]:
    with redis_server() as redis:
        store = await open_store(redis.url, grace_seconds=3600)
        app = create_app(
            Settings.from_environ({"REDIS_URL": redis.url, "COALESCER_INGEST_TOKEN": "bench"}),
            store,
        )
        batches = [ids(500) for _ in range(5)]
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
            redis.fill()
            statuses = [
                (
                    await client.post("/v1/events", json=[make_message(t) for t in b], headers=AUTH)
                ).status_code
                for b in batches
            ]
            written = len(await store.known("k", [t for b in batches for t in b]))
            redis.unfill()
            for b in batches:
                await client.post("/v1/events", json=[make_message(t) for t in b], headers=AUTH)
        applied = len(await store.known("k", [t for b in batches for t in b]))
        await store.close()
        return {
            "answers while full": f"{statuses.count(503)} x 503",
            "written while full": written,
            "applied after the retry": applied,
            "lost": 2500 - applied,
        }


async def frozen(rounds: int = 10) -> dict[str, Any]:
    with redis_server() as redis:
        store = await open_store(redis.url, grace_seconds=3600, query_timeout=2.0)
        app = create_app(Settings.from_environ({"REDIS_URL": redis.url}), store)
        task = ids(1)[0]
        transport = httpx.ASGITransport(app)
        waits, codes = [], []
        async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
            await client.get(f"/k?taskId={task}")
            redis.freeze()
            for _ in range(rounds):
                started = time.monotonic()
                codes.append((await client.get(f"/k?taskId={task}")).status_code)
                waits.append(time.monotonic() - started)
            redis.thaw()
        await store.close()
        return {
            "query answers while frozen": f"{codes.count(503)}/{rounds} x 503",
            "median s to the 503": statistics.median(waits),
            "COALESCER_QUERY_TIMEOUT s": 2.0,
        }


def show(title: str, figures: dict[str, Any]) -> None:
    print(f"\n{title}")
    for name, value in figures.items():
        print(f"  {name:<28} {value:.2f}" if isinstance(value, float) else f"  {name:<28} {value}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=3000)
    args = parser.parse_args()
    show("1. Redis full under listen", await pulse_fault(args.events, "full"))
    show("2. Redis full under HTTP ingest", await http_full())
    show("3. Redis frozen (SIGSTOP) under queries", await frozen())
    show("4. Redis killed, restarted empty, under listen", await pulse_fault(args.events, "kill"))


if __name__ == "__main__":
    asyncio.run(main())
