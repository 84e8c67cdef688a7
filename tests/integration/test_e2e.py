"""The whole loop in real processes: ``coalescer emulator`` → RabbitMQ → ``coalescer listen`` →
Redis → ``coalescer serve`` ← two ``coalescer worker``s.

A burst of tasks for a few keys lands while no worker runs; then two workers drain the queue.
Every task ends exactly once: either it ran (completed, with its log) or it was superseded by a
newer task of its key that really ran, with the artifacts linking both ways.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import pytest
import redis.asyncio as aioredis
import taskcluster

from tests.ports import free_port

pytestmark = pytest.mark.integration

KEYS = ("build.linux", "build.mac", "test.unit")
PER_KEY = 6
QUEUE = "e2e/worker"


class Processes:
    """Started ``coalescer`` processes, each logging to a file; all stopped at the end."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> None:
        with open(self.logs / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "coalescer.cli", *args],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def output(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} exited:\n{self.output(name)}"

    def stop(self) -> dict[str, int]:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes


async def eventually(
    check: Callable[[], Awaitable[bool]], procs: Processes, within: float, what: str
) -> None:
    give_up = time.monotonic() + within
    while not await check():
        procs.check_alive()
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {within:.0f} s waiting for {what}")
        await asyncio.sleep(0.1)


@pytest.fixture
async def pulse_queue(amqp_url: str) -> AsyncIterator[str]:
    name = f"queue/guest/coalescer-e2e-{uuid.uuid4().hex[:12]}"
    yield name
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(name)


def loop_environment(
    redis_url: str, amqp_url: str, pulse_queue: str, prefix: str, root: str, client_id: str
) -> dict[str, str]:
    """The environment of every process of the loop (emulator, listen, serve, workers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COALESCER_", "PULSE_"))}
    env.update(
        REDIS_URL=redis_url,
        PULSE_URL=amqp_url,
        PULSE_QUEUE=pulse_queue,
        COALESCER_ROUTE_PREFIX=prefix,
        COALESCER_RANK_TAG="push",
        COALESCER_LOG_FORMAT="text",
        TASKCLUSTER_ROOT_URL=root,
        TASKCLUSTER_CLIENT_ID=client_id,
        TASKCLUSTER_ACCESS_TOKEN="no-secret",
    )
    return env


async def test_workers_supersede_through_the_real_service(
    redis_client: aioredis.Redis, redis_url: str, amqp_url: str, pulse_queue: str, tmp_path: Path
) -> None:
    queue_port, web_port = free_port(), free_port()
    root, service = f"http://127.0.0.1:{queue_port}", f"http://127.0.0.1:{web_port}"
    prefix = f"coalesce.e2e{uuid.uuid4().hex[:8]}"
    env = loop_environment(redis_url, amqp_url, pulse_queue, prefix, root, "e2e-worker")
    procs = Processes(env, tmp_path)
    try:
        await run_scenario(procs, root, service, prefix, queue_port, web_port, amqp_url)
    finally:
        codes = procs.stop()
    # uvicorn re-raises the SIGTERM it handled once shut down: the servers may end with -15.
    servers = ("serve", "emulator")
    failed = {
        n: (c, procs.output(n)[-3000:])
        for n, c in codes.items()
        if c != 0 and not (n in servers and c == -signal.SIGTERM)
    }
    assert not failed, failed


async def run_scenario(
    procs: Processes,
    root: str,
    service: str,
    prefix: str,
    queue_port: int,
    web_port: int,
    amqp_url: str,
) -> None:
    # The consumer first, so that its queue is bound before the emulator publishes anything.
    procs.start("listen", "listen", "--declare-exchanges")
    procs.start("serve", "serve", "--port", str(web_port))
    async with httpx.AsyncClient(timeout=10) as http:

        async def answers(path: str) -> bool:
            try:
                return (await http.get(f"{path}")).status_code < 500
            except httpx.TransportError:
                return False

        await eventually(lambda: answers(f"{service}/__lbheartbeat__"), procs, 30, "serve")
        await eventually(
            lambda: _true("consuming queue/" in procs.output("listen")), procs, 30, "listen"
        )
        procs.start(
            "emulator",
            "emulator",
            "--port",
            str(queue_port),
            "--legacy",
            "--pulse-url",
            amqp_url,
            "--claim-work-timeout",
            "2",
        )
        await eventually(lambda: answers(f"{root}/api/queue/v1/ping"), procs, 30, "emulator")

        # The burst, while no worker runs; pushes interleave across keys.
        queue = taskcluster.Queue(
            {"rootUrl": root, "credentials": {"clientId": "e2e", "accessToken": "x"}}
        )
        tasks: dict[str, tuple[str, int]] = {}
        for push in range(PER_KEY):
            for key in KEYS:
                task_id = taskcluster.slugid.nice()
                queue.createTask(task_id, definition(key, push, prefix, service))
                tasks[task_id] = (key, push)

        async def indexed() -> bool:
            counts = []
            for key in KEYS:
                newest = next(t for t, kp in tasks.items() if kp == (key, PER_KEY - 1))
                url = f"{service}/{key.replace('.', '/')}"
                body = (await http.get(url, params={"taskId": newest})).json()
                counts.append(len(body["supersedes"]))
            return counts == [PER_KEY] * len(KEYS)

        await eventually(indexed, procs, 30, "the service to index the burst")

        # Now the (scarce) workers.
        for name in ("w1", "w2"):
            procs.start(
                name,
                "worker",
                "--task-queue-id",
                QUEUE,
                "--worker-group",
                "e2e",
                "--worker-id",
                name,
                "--superseder-allow",
                f"{service}/",
            )

        def all_resolved() -> bool:
            return all(
                queue.status(t)["status"]["state"] in ("completed", "failed", "exception")
                for t in tasks
            )

        await eventually(lambda: asyncio.to_thread(all_resolved), procs, 60, "every task resolved")

        ran: dict[str, int] = {}
        superseded: dict[str, dict[str, Any]] = {}
        for task_id in tasks:
            runs = queue.status(task_id)["status"]["runs"]
            assert len(runs) == 1, f"{task_id} has runs {runs}"  # none run twice, none retried
            reason = runs[0]["reasonResolved"]
            if reason == "completed":
                log = await blob(http, root, task_id, "public/logs/live.log")
                assert f"ran {task_id}" in log.decode()
                ran[task_id] = runs[0]["runId"]
            else:
                assert reason == "superseded", (task_id, runs)
                doc = await blob(http, root, task_id, "public/superseded-by.json")
                superseded[task_id] = httpx.Response(200, content=doc).json()
    assert len(ran) + len(superseded) == len(tasks)
    for key in KEYS:  # nothing is newer than a key's newest task: it must have run
        newest = next(t for t, kp in tasks.items() if kp == (key, PER_KEY - 1))
        assert newest in ran
    async with httpx.AsyncClient() as http:
        for task_id, by in superseded.items():
            primary = by["taskId"]
            assert primary in ran and by["runId"] == ran[primary], (task_id, by)
            assert tasks[primary][0] == tasks[task_id][0]  # same key
            assert tasks[primary][1] > tasks[task_id][1]  # only newer supersedes older
            listed = httpx.Response(
                200, content=await blob(http, root, primary, "public/supersedes.json")
            ).json()
            assert {"taskId": task_id, "runId": 0} in listed
    # Superseding happened: fewer runs than tasks, at most one run per key and worker claim.
    assert len(ran) < len(tasks)


def definition(key: str, push: int, prefix: str, service: str) -> dict[str, Any]:
    return {
        "taskQueueId": QUEUE,
        "created": taskcluster.stringDate(taskcluster.fromNow("0 seconds")),
        "deadline": taskcluster.stringDate(taskcluster.fromNow("1 hour")),
        "routes": [f"{prefix}.{key}"],
        "tags": {"push": str(push)},
        "payload": {
            "command": ["sh", "-c", 'echo "ran $TASK_ID"; sleep 0.2'],
            "maxRunTime": 60,
            "supersederUrl": f"{service}/{key.replace('.', '/')}",
        },
        "metadata": {
            "name": key,
            "description": "e2e",
            "owner": "e2e@example.com",
            "source": service,
        },
    }


async def blob(http: httpx.AsyncClient, root: str, task_id: str, name: str) -> bytes:
    response = await http.get(f"{root}/emulator/v1/blobs/{task_id}/0/{name}")
    response.raise_for_status()
    return response.content


async def _true(value: bool) -> bool:
    return value
