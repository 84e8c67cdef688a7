"""Ingest throughput: events/s from RabbitMQ into Redis, per ``coalescer listen`` process.

Declares and binds a fresh queue (as ``listen`` would), publishes N real-shaped messages to the
queue's real exchanges (pending, running, completed for N/3 tasks over 100 coalescing keys),
then starts P ``coalescer listen`` processes on that backlog and times them until every message
is handled (the ``total_msgs_handled`` counter). The clock starts when the first process says
it is consuming, so interpreter start-up is not counted. Needs an empty Redis database (it is
flushed afterwards) and a RabbitMQ; bounded to about a minute.

    .venv/bin/python scripts/with_services.py .venv/bin/python bench/pulse.py \\
        [--messages 20000] [--processes 1] [--prefetch 64] [--batch N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test suite's message builders

import backlog  # bench/backlog.py

from coalescer.ingest.topology import bindings, dead_letter_names, queue_arguments

LIMIT_S = 50.0


async def publish(channel: Any, prefix: str, n: int) -> float:
    """Publish ``n`` messages with confirms; returns the time it took."""
    exchanges = {
        name: await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)
        for name, _ in bindings(prefix)
    }
    return await backlog.publish(lambda m: exchanges[m["exchange"]], backlog.messages(prefix, n))


def start_listen(env: dict[str, str], extra: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "coalescer.cli", "listen", *extra],
            env=env,
            stdout=out,
            stderr=out,
        )


async def handled(client: aioredis.Redis) -> int:
    return int(await client.hget("co:stats", "total_msgs_handled") or 0)


async def main(args: argparse.Namespace) -> int:
    redis_url = os.environ.get("COALESCER_TEST_REDIS_URL") or os.environ.get("REDIS_URL")
    amqp_url = os.environ.get("COALESCER_TEST_AMQP_URL") or os.environ.get("PULSE_URL")
    if not redis_url or not amqp_url:
        sys.exit("run under scripts/with_services.py, or set REDIS_URL and PULSE_URL")
    client = aioredis.Redis.from_url(redis_url)
    if await client.dbsize():
        await client.aclose()
        sys.exit(f"refusing to use {redis_url}: it is not empty")
    prefix = f"coalesce.bench{uuid.uuid4().hex[:8]}"
    queue = f"queue/guest/coalescer-bench-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(amqp_url)
    channel = await connection.channel()
    procs: list[subprocess.Popen[bytes]] = []
    logs = Path(tempfile.mkdtemp(prefix="coalescer-bench-"))
    try:
        max_length = 10 * args.messages
        declared = await channel.declare_queue(
            queue, durable=True, arguments=queue_arguments(queue, max_length)
        )
        for exchange, pattern in bindings(prefix):
            await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
            await declared.bind(exchange, pattern)
        took = await publish(channel, prefix, args.messages)
        print(f"published {args.messages} messages in {took:.2f} s ({args.messages / took:,.0f}/s)")

        env = {k: v for k, v in os.environ.items() if not k.startswith(("COALESCER_", "PULSE_"))}
        env.update(
            REDIS_URL=redis_url,
            PULSE_URL=amqp_url,
            PULSE_QUEUE=queue,
            COALESCER_ROUTE_PREFIX=prefix,
            COALESCER_PULSE_PREFETCH=str(args.prefetch),
            COALESCER_PULSE_MAX_LENGTH=str(max_length),
            COALESCER_LOG_FORMAT="text",
            COALESCER_LOG_LEVEL="WARNING",
        )
        extra = ["--batch", str(args.batch)] if args.batch else []
        procs += [start_listen(env, extra, logs / f"listen-{i}.log") for i in range(args.processes)]
        give_up = time.monotonic() + LIMIT_S
        while await handled(client) == 0:
            if time.monotonic() > give_up or any(p.poll() is not None for p in procs):
                sys.exit(f"the consumers did not start; see {logs}")
            await asyncio.sleep(0.001)
        started = time.monotonic()
        while (done := await handled(client)) < args.messages:
            if time.monotonic() > give_up:
                sys.exit(f"gave up after {LIMIT_S:.0f} s with {done}/{args.messages} handled")
            await asyncio.sleep(0.005)
        took = time.monotonic() - started
        stats = {k.decode(): v.decode() for k, v in (await client.hgetall("co:stats")).items()}
        memory = (await client.info("memory"))["used_memory"]
        rate = args.messages / took
        print(
            f"consumed {args.messages} events in {took:.2f} s with {args.processes} "
            f"process(es), prefetch {args.prefetch}, batch {args.batch or args.prefetch // 2}: "
            f"{rate:,.0f} events/s ({rate / args.processes:,.0f} per process)"
        )
        print(f"outcomes: { {k: v for k, v in sorted(stats.items())} }")
        print(f"redis used_memory after: {memory / 1e6:.1f} MB")
        return 0
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        dead_exchange, dead_queue = dead_letter_names(queue)
        await channel.queue_delete(queue)
        await channel.queue_delete(dead_queue)
        await channel.exchange_delete(dead_exchange)
        await connection.close()
        await client.flushdb()
        await client.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--prefetch", type=int, default=64)
    parser.add_argument("--batch", type=int, default=0, help="default: half the prefetch")
    sys.exit(asyncio.run(main(parser.parse_args())))
