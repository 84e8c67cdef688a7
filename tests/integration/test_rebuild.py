"""Rebuilding the index from the queue's listings (``coalescer reconcile --rebuild``), against the
queue emulator through the official client and the real Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis
import taskcluster
import taskcluster.aio
from taskcluster.exceptions import TaskclusterRestFailure

from coalescer.emulator.harness import QueueEmulator
from coalescer.ingest.events import Message, to_event
from coalescer.ingest.rebuild import ListingFailed, rebuild, sources, task_queue_ids
from coalescer.ingest.reconcile import queue_fetcher
from coalescer.store import Store, keys
from coalescer.store.census import Limits

WORKER = {"workerGroup": "wg", "workerId": "wi"}
QUEUE_ID = "emulator-test/worker"
OTHER_QUEUE = "emulator-test/other"


@pytest.fixture
def prefix() -> str:
    return f"coalesce.b{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def queue(queue_emulator: QueueEmulator) -> AsyncIterator[Any]:
    async with taskcluster.aio.createSession() as session:
        yield taskcluster.aio.Queue({"rootUrl": queue_emulator.root_url}, session=session)


async def pending(store: Store, key: str = "k") -> list[str]:
    return [t.task_id for t in await store.pending(key, now_ms=int(time.time() * 1000))]


async def state_of(store: Store, task_id: str, key: str = "k") -> str | None:
    found = (await store.known(key, [task_id])).get(task_id)
    return None if found is None else found.state


def not_found(*_: Any, **__: Any) -> Any:
    """An older queue's answer to an endpoint it lacks."""
    raise TaskclusterRestFailure("not found", superExc=None, status_code=404)


async def test_pending_and_running_tasks_of_every_task_queue_are_indexed(
    queue_emulator: QueueEmulator, store: Store, queue: Any, prefix: str
) -> None:
    em, k = queue_emulator, f"{prefix}.k"
    tasks = []
    for _ in range(3):
        tasks.append(em.create_task(routes=[k]))
        em.clock.advance(1)  # distinct scheduled times: the order is the creation order
    both = em.create_task(routes=[k, f"{prefix}.other"], taskQueueId=OTHER_QUEUE)
    em.create_task(routes=["index.not-coalescing"])
    done = em.create_task(routes=[k])
    em.queue().claimTask(tasks[1], 0, WORKER)
    worker = em.queue(credentials=em.queue().claimTask(done, 0, WORKER)["credentials"])
    worker.reportCompleted(done, 0)

    ids = await task_queue_ids(queue)
    assert sorted(ids) == [OTHER_QUEUE, QUEUE_ID]
    found: list[int] = []
    applied: list[int] = []
    summary = await rebuild(
        store,
        queue,
        sources(ids, []),
        queue_fetcher(queue),
        prefix=prefix,
        batch=2,
        found=found.append,
        progress=applied.append,
    )
    assert (summary.listed, summary.tasks, summary.indexed, summary.failed) == (5, 4, 4, 0)
    assert summary.keys == {"k", "other"} and summary.complete
    assert sum(found) == sum(applied) == 4
    assert await pending(store) == [tasks[0], tasks[2], both]
    assert await pending(store, "other") == [both]
    assert await state_of(store, tasks[1]) == "running"  # known as running: never offered
    assert await state_of(store, done) is None


async def test_a_rebuild_is_held_to_the_index_limits_as_ingest_is(
    queue_emulator: QueueEmulator, store: Store, queue: Any, prefix: str
) -> None:
    em = queue_emulator
    first = em.create_task(routes=[f"{prefix}.a"])
    em.clock.advance(1)
    second = em.create_task(routes=[f"{prefix}.b"])
    summary = await rebuild(
        store,
        queue,
        sources([QUEUE_ID], []),
        queue_fetcher(queue),
        prefix=prefix,
        batch=1,
        concurrency=1,
        limits=Limits(keys=1, tasks=100),
    )
    assert (summary.tasks, summary.indexed, summary.limited) == (2, 1, 1)
    assert "1 past the index's limits" in summary.line() and summary.complete
    held = await pending(store, "a") + await pending(store, "b")
    assert len(held) == 1 and held[0] in (first, second)
    assert len(await store.keys()) == 1


async def test_a_rebuild_alongside_live_events_never_offers_a_task_that_started(
    queue_emulator: QueueEmulator, store: Store, queue: Any, prefix: str
) -> None:
    em = queue_emulator
    tasks = [em.create_task(routes=[f"{prefix}.k"]) for _ in range(3)]
    fetch = queue_fetcher(queue)

    async def racing(task_ids: Sequence[str]) -> Mapping[str, Mapping[str, Any]]:
        statuses = await fetch(task_ids)  # tasks[1] is pending in these
        em.queue().claimTask(tasks[1], 0, WORKER)
        running = to_event(
            Message.from_json(em.messages("task-running", tasks[1])[0]), prefix=prefix
        )
        assert running is not None
        assert await store.apply([running]) == ["applied"]  # the consumer was quicker
        return statuses

    summary = await rebuild(store, queue, sources([QUEUE_ID], []), racing, prefix=prefix)
    assert (summary.indexed, summary.unchanged) == (2, 1)
    assert await pending(store) == [tasks[0], tasks[2]]
    assert await state_of(store, tasks[1]) == "running"

    again = await rebuild(store, queue, sources([QUEUE_ID], []), fetch, prefix=prefix)
    assert (again.tasks, again.indexed, again.unchanged, again.failed) == (3, 0, 3, 0)
    assert await pending(store) == [tasks[0], tasks[2]]


async def test_a_queue_without_the_listings_says_so_and_task_groups_still_work(
    queue_emulator: QueueEmulator, store: Store, queue: Any, prefix: str
) -> None:
    em, group = queue_emulator, taskcluster.slugid.nice()
    members = [em.create_task(routes=[f"{prefix}.k"], taskGroupId=group) for _ in range(2)]
    em.queue().cancelTask(members[1])
    elsewhere = em.create_task(routes=[f"{prefix}.k"])
    queue.listPendingTasks = queue.listTaskQueues = not_found

    with pytest.raises(ListingFailed, match="older queue releases answer 404"):
        await task_queue_ids(queue)
    summary = await rebuild(
        store, queue, sources([QUEUE_ID], []), queue_fetcher(queue), prefix=prefix
    )
    assert not summary.complete
    assert summary.incomplete == [
        f"pending tasks of {QUEUE_ID}: the queue has no listPendingTasks endpoint (older queue "
        "releases answer 404): rebuild from task groups instead, with --task-group ID"
    ]
    unknown = taskcluster.slugid.nice()
    summary = await rebuild(
        store, queue, sources([], [group, unknown]), queue_fetcher(queue), prefix=prefix
    )
    assert summary.incomplete == [
        f"task group {unknown}: the queue does not know task group {unknown}"
    ]
    assert (summary.listed, summary.indexed) == (2, 1)  # the canceled task is left out
    assert await pending(store) == [members[0]]
    assert elsewhere not in await pending(store)


def reconcile_process(
    root_url: str, redis_url: str, *args: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COALESCER_", "TASKCLUSTER_"))}
    env.update(REDIS_URL=redis_url, TASKCLUSTER_ROOT_URL=root_url, COALESCER_LOG_FORMAT="text")
    return subprocess.run(
        [sys.executable, "-m", "coalescer.cli", "reconcile", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_the_command_marks_the_index_rebuilt_only_when_it_covered_everything(
    queue_emulator: QueueEmulator, redis_client: aioredis.Redis, redis_url: str
) -> None:
    em = queue_emulator
    tasks = [em.create_task(routes=["coalesce.v1.k"]) for _ in range(3)]
    unknown = taskcluster.slugid.nice()
    run = reconcile_process(em.root_url, redis_url, "--rebuild", "--task-group", unknown)
    assert run.returncode == 1, run.stderr
    assert "INCOMPLETE" in run.stdout and f"does not know task group {unknown}" in run.stderr
    assert (await redis_client.hgetall(keys.INDEX_STATE))[b"state"] == b"lost"

    run = reconcile_process(em.root_url, redis_url, "--rebuild", "--progress")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("rebuilt 3 tasks under 1 keys (3 listed)")
    assert "rebuild: 100%" in run.stderr and "3/3" in run.stderr
    marker = await redis_client.hgetall(keys.INDEX_STATE)
    assert marker[b"state"] == b"ok"
    assert abs(int(marker[b"rebuilt_ms"]) - time.time() * 1000) < 60_000
    assert len(await redis_client.zrange(keys.group("k")[1], 0, -1)) == len(tasks)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rebuild", "--task-queue-id", "no-slash"], "not a taskQueueId: 'no-slash'"),
        (["--rebuild", "--task-group", "nope"], "malformed taskGroupId 'nope'"),
        (["--rebuild", "--every", "5"], "--rebuild runs once"),
        (["--task-queue-id", "p/q"], "--task-queue-id and --task-group go with --rebuild"),
    ],
)
def test_bad_arguments_are_clear_errors(
    queue_emulator: QueueEmulator, redis_url: str, args: list[str], message: str
) -> None:
    run = reconcile_process(queue_emulator.root_url, redis_url, *args)
    assert run.returncode == 2 and message in run.stderr, run.stderr
