"""The replay is honest: a small history run end to end (the queue emulator, ``coalescer
listen`` and ``serve``, two real ``coalescer worker`` processes) and the same history, read back
from the queue, replayed under the same protocol with the same two workers: the same tasks run,
and each superseded task is superseded by the same task.

The history is chosen so that the outcome does not hang on which of two simultaneous claims
wins: a burst of three keys lands while no worker runs; one key's tasks run for seconds, the
others' for a fraction of a second, so that one worker is busy while the other drains the rest.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
import taskcluster

from coalescer.replay import sources
from coalescer.replay.pool import State
from coalescer.replay.runner import Config, replay
from coalescer.store import Store
from tests.integration.test_e2e import (  # noqa: F401  (the fixture)
    Processes,
    _true,
    eventually,
    loop_environment,
    pulse_queue,
)
from tests.ports import free_port

pytestmark = pytest.mark.integration

QUEUE = "honest/worker"
#: Seconds each key's tasks run: one long, so that the other worker takes the rest.
KEYS = {"build.linux": 3.0, "build.mac": 0.2, "test.unit": 0.2}
PER_KEY = 4


async def test_replay_equals_the_end_to_end_run(
    redis_client: aioredis.Redis,
    redis_url: str,
    store: Store,
    amqp_url: str,
    pulse_queue: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    queue_port, web_port = free_port(), free_port()
    root, service = f"http://127.0.0.1:{queue_port}", f"http://127.0.0.1:{web_port}"
    prefix = f"coalesce.honest{uuid.uuid4().hex[:8]}"
    env = loop_environment(redis_url, amqp_url, pulse_queue, prefix, root, "honest-worker")
    procs = Processes(env, tmp_path)
    try:
        queue, group, tasks = await run_end_to_end(procs, root, service, prefix, amqp_url)
        lived = await asyncio.to_thread(results, queue, root, tasks)
        history = await asyncio.to_thread(
            sources.from_task_groups,
            queue,
            [group],
            prefix=prefix,
            rank_tag="push",
            workers={QUEUE: 2},
        )
    finally:
        procs.stop()
    assert len(history.tasks) == len(tasks)
    [outcome] = await replay(history, [Config.parse("on-claim")], store)
    replayed: dict[str, str | None] = {}
    for i, task in enumerate(history.tasks):
        state, by = outcome.state[i], outcome.by[i]
        assert state in (State.COMPLETED, State.SUPERSEDED), (task.task_id, state)
        replayed[task.task_id] = history.tasks[by].task_id if state == State.SUPERSEDED else None
    # Superseding happened, and the replay tells exactly what the real run did.
    assert sum(by is None for by in lived.values()) == len(KEYS)
    assert replayed == lived


async def run_end_to_end(
    procs: Processes, root: str, service: str, prefix: str, amqp_url: str
) -> tuple[taskcluster.Queue, str, list[str]]:
    queue_port, web_port = int(root.rsplit(":", 1)[1]), int(service.rsplit(":", 1)[1])
    procs.start("listen", "listen", "--declare-exchanges")
    procs.start("serve", "serve", "--port", str(web_port))
    async with httpx.AsyncClient(timeout=10) as http:

        async def answers(url: str) -> bool:
            try:
                return (await http.get(url)).status_code < 500
            except httpx.TransportError:
                return False

        await eventually(lambda: answers(f"{service}/__lbheartbeat__"), procs, 30, "serve")
        await eventually(
            lambda: _true("consuming queue/" in procs.output("listen")), procs, 30, "listen"
        )
        procs.start(
            "emulator", "emulator", "--port", str(queue_port), "--legacy", "--pulse-url", amqp_url
        )
        await eventually(lambda: answers(f"{root}/api/queue/v1/ping"), procs, 30, "emulator")
        queue = taskcluster.Queue(
            {"rootUrl": root, "credentials": {"clientId": "honest", "accessToken": "x"}}
        )
        # One creation time for the whole burst, and task ids in creation order: the replay
        # orders tasks of one instant by id, the queue by creation.
        ids = sorted(taskcluster.slugid.nice() for _ in range(PER_KEY * len(KEYS)))
        group = ids[0]
        created = taskcluster.stringDate(taskcluster.fromNow("0 seconds"))
        tasks = iter(ids)
        for push in range(PER_KEY):
            for key, seconds in KEYS.items():
                task_id = next(tasks)
                queue.createTask(
                    task_id, definition(key, push, prefix, service, created, group, seconds)
                )

        async def indexed() -> bool:
            listed = 0
            for key in KEYS:
                body = (await http.get(f"{service}/{key.replace('.', '/')}")).json()
                listed += len(body.get("pending", []))
            return listed == len(ids)

        await eventually(indexed, procs, 30, "the service to index the burst")
        for name in ("w1", "w2"):
            procs.start(
                name,
                "worker",
                "--task-queue-id",
                QUEUE,
                "--worker-group",
                "honest",
                "--worker-id",
                name,
                "--superseder-allow",
                f"{service}/",
            )

        def all_resolved() -> bool:
            return all(
                queue.status(t)["status"]["state"] in ("completed", "failed", "exception")
                for t in ids
            )

        await eventually(lambda: asyncio.to_thread(all_resolved), procs, 60, "every task resolved")
    return queue, group, ids


def results(queue: taskcluster.Queue, root: str, tasks: list[str]) -> dict[str, str | None]:
    """Each task: ``None`` if it ran, else the task that superseded it (its artifact)."""
    out: dict[str, str | None] = {}
    for task_id in tasks:
        [run] = queue.status(task_id)["status"]["runs"]
        if run["reasonResolved"] == "completed":
            out[task_id] = None
        else:
            assert run["reasonResolved"] == "superseded", (task_id, run)
            blob = f"{root}/emulator/v1/blobs/{task_id}/0/public/superseded-by.json"
            out[task_id] = httpx.get(blob).raise_for_status().json()["taskId"]
    return out


def definition(
    key: str, push: int, prefix: str, service: str, created: str, group: str, seconds: float
) -> dict[str, Any]:
    return {
        "taskQueueId": QUEUE,
        "taskGroupId": group,
        "created": created,
        "deadline": taskcluster.stringDate(taskcluster.fromNow("1 hour")),
        "routes": [f"{prefix}.{key}"],
        "tags": {"push": str(push)},
        "payload": {
            "command": ["sh", "-c", f'echo "ran $TASK_ID"; sleep {seconds}'],
            "maxRunTime": 60,
            "supersederUrl": f"{service}/{key.replace('.', '/')}",
        },
        "metadata": {
            "name": key,
            "description": "honest",
            "owner": "e@example.com",
            "source": service,
        },
    }
