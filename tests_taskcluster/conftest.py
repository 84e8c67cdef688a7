"""Fixtures of the real-systems tests: the deployment (from the environment), a Redis of the
run's own, the run's unique names, the real queue, and the product's processes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import pytest
import redis

from tests.redis_server import redis_server
from tests_taskcluster.environment import Deployment, from_environ, problem
from tests_taskcluster.support import Loop, RealQueue, Run


def pytest_configure(config: pytest.Config) -> None:
    message = problem(os.environ)
    if message is not None:
        pytest.exit(message, returncode=2)


@pytest.fixture(scope="session")
def deployment() -> Deployment:
    return from_environ(os.environ)


@pytest.fixture
def redis_url(deployment: Deployment) -> Iterator[str]:
    """``REDIS_URL`` when set (an empty database: it is emptied after each test), else a
    private ``redis-server``."""
    if deployment.redis_url is None:
        with redis_server() as server:
            yield server.url
        return
    client = redis.Redis.from_url(deployment.redis_url)
    try:
        if size := client.dbsize():
            pytest.exit(
                f"refusing to run against REDIS_URL: it holds {size} keys (give an empty "
                "database, or unset REDIS_URL for a private redis-server)",
                returncode=3,
            )
        yield deployment.redis_url
        client.flushdb()
    finally:
        client.close()


@pytest.fixture
async def run(deployment: Deployment) -> AsyncIterator[Run]:
    """The test's own names; its Pulse queues are deleted at the end."""
    this = Run.new(deployment.pulse_user)
    yield this
    connection = await aio_pika.connect(deployment.pulse_url)
    async with connection:
        channel = await connection.channel()
        for queue in (this.pulse_queue, this.pulse_queue + "/dead"):
            with contextlib.suppress(aio_pika.exceptions.ChannelClosed):
                await channel.queue_delete(queue)
        channel = await connection.channel()
        dead_exchange = "exchange/" + this.pulse_queue.removeprefix("queue/") + "/dead"
        with contextlib.suppress(aio_pika.exceptions.ChannelClosed):
            await channel.exchange_delete(dead_exchange)


@pytest.fixture
def queue(deployment: Deployment, run: Run) -> Iterator[RealQueue]:
    real = RealQueue(deployment, run)
    yield real
    real.clean_up()


@pytest.fixture
async def loop(
    deployment: Deployment, run: Run, redis_url: str, tmp_path: Path
) -> AsyncIterator[Loop]:
    """The product's processes; at the end each must stop cleanly, and the consumer (when one
    ran) must have set none of the real queue's messages aside."""
    processes = Loop(deployment, run, redis_url, tmp_path)
    yield processes
    failed = list(processes.stop())
    assert not failed, "\n".join(failed)
    if processes.listened:
        connection = await aio_pika.connect(deployment.pulse_url)
        async with connection:
            channel = await connection.channel()
            dead = await channel.declare_queue(run.pulse_queue + "/dead", passive=True)
            count = dead.declaration_result.message_count
        assert count == 0, f"the consumer set {count} of the queue's messages aside"
