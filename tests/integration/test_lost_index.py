"""Redis restarts empty under a running service: the superseding answers fall back to
``[taskId]``, and ``coalescer reconcile --rebuild`` (a real process) brings them back as they were.

Real processes throughout: a redis-server started by the test, the web service (``coalescer
serve``) on it, the queue emulator POSTing its task events to the service's ingest endpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from coalescer.emulator.harness import TEST_OPTIONS, QueueEmulator
from coalescer.emulator.runtime import EmulatorOptions
from coalescer.store import keys
from tests.ports import free_port
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

TOKEN = "lost-index-token"
KEYS = ("lost.a", "lost.b", "lost.c")
QUEUES = ("emulator-test/worker", "emulator-test/other")
PER_KEY = 4


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


def environment(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COALESCER_", "TASKCLUSTER_", "PULSE_", "REDIS_"))
    }
    return {**env, "COALESCER_LOG_FORMAT": "text", **extra}


@pytest.fixture
def service(redis_server: RedisServer, tmp_path: Path) -> Iterator[str]:
    """``coalescer serve`` on the test's redis-server; its URL."""
    port = free_port()
    env = environment(REDIS_URL=redis_server.url, COALESCER_INGEST_TOKEN=TOKEN)
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "coalescer.cli", "serve", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def queue_emulator_options(service: str) -> EmulatorOptions:
    return dataclasses.replace(TEST_OPTIONS, publish_to=f"{service}/v1/events", ingest_token=TOKEN)


async def eventually(check: Callable[[], Awaitable[bool]], what: str, within: float = 30) -> None:
    give_up = time.monotonic() + within
    while not await check():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {within:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


async def test_an_emptied_store_is_rebuilt_from_the_queue_with_the_same_answers(
    queue_emulator: QueueEmulator, service: str, redis_server: RedisServer, http: httpx.AsyncClient
) -> None:
    em = queue_emulator

    async def up() -> bool:
        try:
            return (await http.get(f"{service}/__lbheartbeat__")).status_code == 200
        except httpx.TransportError:
            return False

    await eventually(up, "the service to start")
    # Pushes interleave across keys and task queues; one task of each key starts running.
    created: dict[str, list[str]] = {key: [] for key in KEYS}
    for push in range(PER_KEY):
        for n, key in enumerate(KEYS):
            queue_id = QUEUES[(push + n) % 2]
            created[key].append(em.create_task(routes=[f"coalesce.v1.{key}"], taskQueueId=queue_id))
        em.clock.advance(1)
    for key in KEYS:
        em.queue().claimTask(created[key][1], 0, {"workerGroup": "wg", "workerId": "wi"})
    asked = {key: created[key][-1] for key in KEYS}
    expected = {key: [t for i, t in enumerate(created[key]) if i != 1] for key in KEYS}

    async def answers() -> dict[str, list[str] | int]:
        out: dict[str, list[str] | int] = {}
        for key, task_id in asked.items():
            got = await http.get(f"{service}/{key.replace('.', '/')}", params={"taskId": task_id})
            out[key] = got.json()["supersedes"] if got.status_code == 200 else got.status_code
        return out

    async def answering(wanted: dict[str, list[str]]) -> bool:
        return await answers() == wanted

    await eventually(lambda: answering(expected), "the service to index the tasks")
    before = await answers()

    redis_server.restart_empty()
    alone = {key: [task_id] for key, task_id in asked.items()}
    await eventually(lambda: answering(alone), "the answers to fall back to [taskId]")

    env = environment(REDIS_URL=redis_server.url, TASKCLUSTER_ROOT_URL=em.root_url)
    run = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "coalescer.cli", "reconcile", "--rebuild"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    tasks = len(KEYS) * PER_KEY
    assert run.stdout.startswith(f"rebuilt {tasks} tasks under {len(KEYS)} keys"), run.stdout
    assert f"{tasks} indexed" in run.stdout
    assert await answers() == before == expected
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        assert (await client.hgetall(keys.INDEX_STATE))[b"state"] == b"ok"
    finally:
        await client.aclose()
