"""``coalescer reconcile`` against the queue emulator (the real API, through the official client)
and the real Redis: events the index missed are recovered, tasks the queue forgot are removed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest
import taskcluster
import taskcluster.aio
from taskcluster.exceptions import TaskclusterRestFailure

from coalescer.emulator.harness import QueueEmulator
from coalescer.errors import InvalidEvent
from coalescer.ingest.events import Message, to_event
from coalescer.ingest.reconcile import indexed_tasks, queue_fetcher, reconcile
from coalescer.store import Store
from tests.conftest import make_message

WORKER = {"workerGroup": "wg", "workerId": "wi"}


@pytest.fixture
def prefix() -> str:
    return f"coalesce.r{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def queue(queue_emulator: QueueEmulator) -> AsyncIterator[Any]:
    async with taskcluster.aio.createSession() as session:
        yield taskcluster.aio.Queue({"rootUrl": queue_emulator.root_url}, session=session)


async def deliver(store: Store, prefix: str, *messages: dict[str, Any]) -> None:
    """What the index learned from Pulse: these messages, and nothing else."""
    events = [to_event(Message.from_json(m), prefix=prefix) for m in messages]
    assert await store.apply([e for e in events if e is not None]) == ["applied"] * len(messages)


def claim(emulator: QueueEmulator, task_id: str, run_id: int = 0) -> Any:
    """The queue client of the worker that claimed ``task_id``'s run."""
    claimed = emulator.queue().claimTask(task_id, run_id, WORKER)
    return emulator.queue(credentials=claimed["credentials"])


async def pending(store: Store, key: str = "k") -> list[str]:
    return [t.task_id for t in await store.pending(key, now_ms=int(time.time() * 1000))]


@pytest.fixture
def diverged(queue_emulator: QueueEmulator, store: Store, prefix: str) -> Any:
    """Five tasks whose index state the queue contradicts or confirms; returns their ids."""
    em = queue_emulator
    routes = [f"{prefix}.k", f"{prefix}.other"]

    async def make() -> dict[str, str]:
        names = ("completed", "canceled", "retried", "untouched")
        tasks = {name: em.create_task(routes=routes) for name in names}
        await deliver(store, prefix, *(em.messages("task-pending", t)[0] for t in tasks.values()))
        claim(em, tasks["completed"]).reportCompleted(tasks["completed"], 0)
        em.queue().cancelTask(tasks["canceled"])
        claim(em, tasks["retried"]).reportException(
            tasks["retried"], 0, {"reason": "worker-shutdown"}
        )
        # The index saw run 0 start, not run 1 become pending: it thinks the task runs.
        await deliver(store, prefix, em.messages("task-running", tasks["retried"])[0])
        # A task the queue has never heard of (expired and deleted, or another deployment).
        tasks["unknown"] = taskcluster.slugid.nice()
        await deliver(store, prefix, make_message(tasks["unknown"], routes=(f"{prefix}.k",)))
        return tasks

    return make


async def test_reconcile_recovers_missed_events_and_removes_unknown_tasks(
    store: Store, queue: Any, diverged: Any
) -> None:
    tasks = await diverged()
    assert await pending(store) == [
        tasks["completed"],
        tasks["canceled"],
        tasks["untouched"],
        tasks["unknown"],
    ]
    keys, indexed = await indexed_tasks(store)
    assert keys == 2 and set(indexed) == set(tasks.values())
    seen: list[int] = []
    requests: list[list[str]] = []
    statuses = queue.statuses

    async def counted(*, payload: dict[str, Any], **kwargs: Any) -> Any:
        requests.append(payload["taskIds"])
        return await statuses(payload=payload, **kwargs)

    queue.statuses = counted
    summary = await reconcile(
        store, indexed, queue_fetcher(queue), concurrency=3, batch=2, progress=seen.append
    )
    assert (summary.tasks, summary.fixed, summary.unchanged, summary.removed, summary.failed) == (
        5,
        3,
        1,
        1,
        0,
    )
    assert sum(seen) == 5
    assert sorted(len(r) for r in requests) == [1, 2, 2]  # three bulk requests for five tasks
    # The retried task is pending again, in its original place; both keys agree.
    assert await pending(store) == [tasks["retried"], tasks["untouched"]]
    assert await pending(store, "other") == [tasks["retried"], tasks["untouched"]]
    assert await store.known("k", [tasks["unknown"]]) == {}
    # Running it again changes nothing.
    again = await reconcile(store, (await indexed_tasks(store))[1], queue_fetcher(queue))
    assert (again.tasks, again.fixed, again.unchanged, again.removed) == (4, 0, 4, 0)


async def test_a_failed_status_request_is_counted_and_the_rest_goes_on(
    store: Store, prefix: str
) -> None:
    good, bad = taskcluster.slugid.nice(), taskcluster.slugid.nice()
    await deliver(store, prefix, *(make_message(t, routes=(f"{prefix}.k",)) for t in (good, bad)))
    completed = make_message(good, "completed", routes=(f"{prefix}.k",))["payload"]["status"]

    async def fetch(task_ids: Sequence[str]) -> Mapping[str, Mapping[str, Any]]:
        if bad in task_ids:
            raise InvalidEvent("the queue's statuses fail their schema")
        return {good: completed}

    _, indexed = await indexed_tasks(store)
    summary = await reconcile(store, indexed, fetch, batch=1)
    assert (summary.fixed, summary.failed) == (1, 1)
    assert await pending(store) == [bad]


def reconcile_process(root_url: str, redis_url: str, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COALESCER_", "TASKCLUSTER_"))}
    env.update(REDIS_URL=redis_url, TASKCLUSTER_ROOT_URL=root_url, COALESCER_LOG_FORMAT="text")
    return subprocess.Popen(
        [sys.executable, "-m", "coalescer.cli", "reconcile", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_the_command_shows_progress_and_a_summary(
    queue_emulator: QueueEmulator, store: Store, redis_url: str, diverged: Any
) -> None:
    tasks = await diverged()
    proc = reconcile_process(
        queue_emulator.root_url, redis_url, "--progress", "--concurrency", "2", "--batch", "2"
    )
    out, err = await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == 0, err
    assert out.strip().endswith(
        "3 fixed, 1 already right, 1 removed (unknown to the queue), 0 expired, 0 failed"
    )
    assert "reconcile: 100%" in err and "5/5" in err
    assert await pending(store) == [tasks["retried"], tasks["untouched"]]


async def test_every_runs_periodically_until_sigterm(
    queue_emulator: QueueEmulator, store: Store, redis_url: str, diverged: Any
) -> None:
    await diverged()
    proc = reconcile_process(queue_emulator.root_url, redis_url, "--every", "0.2")
    assert proc.stdout is not None
    first = await asyncio.to_thread(proc.stdout.readline)
    second = await asyncio.to_thread(proc.stdout.readline)
    assert "3 fixed" in first and "0 fixed, 4 already right" in second
    proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.to_thread(proc.communicate, timeout=30)
    assert proc.returncode == 0, err


def test_reconcile_needs_the_queue_and_redis(redis_url: str) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COALESCER_", "TASKCLUSTER_", "REDIS_"))
    }
    run = subprocess.run(
        [sys.executable, "-m", "coalescer.cli", "reconcile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "TASKCLUSTER_ROOT_URL is not set" in run.stderr


async def test_a_queue_without_bulk_statuses_is_asked_task_by_task(
    store: Store, queue: Any, diverged: Any
) -> None:
    tasks = await diverged()
    asked: list[str] = []
    status = queue.status

    async def statuses(**_: Any) -> Any:  # an older queue: no such endpoint
        raise TaskclusterRestFailure("not found", superExc=None, status_code=404)

    async def one(task_id: str) -> Any:
        asked.append(task_id)
        return await status(task_id)

    queue.statuses, queue.status = statuses, one
    summary = await reconcile(store, (await indexed_tasks(store))[1], queue_fetcher(queue))
    assert (summary.fixed, summary.unchanged, summary.removed, summary.failed) == (3, 1, 1, 0)
    assert sorted(asked) == sorted(tasks.values())
    assert await pending(store) == [tasks["retried"], tasks["untouched"]]
