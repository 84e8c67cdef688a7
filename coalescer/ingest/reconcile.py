"""Reconciliation: check what the index holds against the queue, and fix it.

Events can be lost (a crash between publish and delivery, a queue deleted by Pulse). For every
task the index knows, the queue's ``status`` is turned into an event by the same version logic
as a Pulse message (:func:`~coalescer.ingest.events.status_event`) and applied: a newer status
fixes the index, an equal or older one changes nothing. A task the queue no longer knows (404)
is removed. The routes of an indexed task are known from the keys it is indexed under.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from taskcluster.exceptions import TaskclusterFailure, TaskclusterRestFailure

from coalescer import schemas
from coalescer.errors import InvalidEvent
from coalescer.ingest.events import status_event
from coalescer.model import TaskEvent
from coalescer.store import Store

log = logging.getLogger(__name__)

#: A task's status (``task-status.json``), or ``None`` when the queue does not know the task.
StatusFetcher = Callable[[str], Awaitable[Mapping[str, Any] | None]]


@dataclasses.dataclass(frozen=True, slots=True)
class Indexed:
    """What the index holds of one task: the keys it is under and its order."""

    keys: tuple[str, ...]
    order: float


@dataclasses.dataclass
class Summary:
    keys: int = 0
    tasks: int = 0
    fixed: int = 0
    unchanged: int = 0
    expired: int = 0
    removed: int = 0
    failed: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        return (
            f"reconciled {self.tasks} tasks under {self.keys} keys in {self.seconds:.1f} s: "
            f"{self.fixed} fixed, {self.unchanged} already right, {self.removed} removed "
            f"(unknown to the queue), {self.expired} expired, {self.failed} failed"
        )


async def indexed_tasks(store: Store) -> tuple[int, dict[str, Indexed]]:
    """``(number of keys, taskId → Indexed)`` for every task the index knows, in any state."""
    found: dict[str, Indexed] = {}
    names = [key for key, _ in await store.keys()]
    for key in names:
        for task_id, record in (await store.all_known(key)).items():
            seen = found.get(task_id)
            keys = (*seen.keys, key) if seen else (key,)
            found[task_id] = Indexed(keys, seen.order if seen else record.order)
    return len(names), found


def queue_fetcher(queue: Any) -> StatusFetcher:
    """A :data:`StatusFetcher` on an official ``taskcluster.aio.Queue`` client; the answer is
    checked against the saved schema, as a Pulse message is."""

    async def fetch(task_id: str) -> Mapping[str, Any] | None:
        try:
            body = await queue.status(task_id)
        except TaskclusterRestFailure as exc:
            if exc.status_code == 404:
                return None
            raise
        problems = schemas.errors("task-status-response", body)
        if problems:
            raise InvalidEvent("the queue's status fails its schema: " + "; ".join(problems))
        status: Mapping[str, Any] = body["status"]
        return status

    return fetch


async def reconcile(
    store: Store,
    tasks: Mapping[str, Indexed],
    fetch: StatusFetcher,
    *,
    concurrency: int = 16,
    chunk: int = 200,
    progress: Callable[[int], object] | None = None,
) -> Summary:
    """Check ``tasks`` (from :func:`indexed_tasks`) with at most ``concurrency`` status
    requests in flight; events are applied ``chunk`` at a time, one round trip each."""
    started = time.monotonic()
    summary = Summary(tasks=len(tasks))
    todo = list(tasks.items())
    ready: list[TaskEvent] = []

    async def flush() -> None:
        batch = ready[:]
        ready.clear()
        for outcome in await store.apply(batch) if batch else []:
            if outcome == "applied":
                summary.fixed += 1
            elif outcome == "expired":
                summary.expired += 1
            else:
                summary.unchanged += 1

    async def check(task_id: str, known: Indexed) -> None:
        try:
            status = await fetch(task_id)
            if status is None:
                for key in known.keys:
                    await store.forget(key, [task_id])
                summary.removed += 1
                log.info("removed task %s: the queue does not know it", task_id)
                return
            event = status_event(status, known.keys, order=known.order)
        except (TaskclusterFailure, aiohttp.ClientError, TimeoutError, InvalidEvent) as exc:
            # The client has retried 5xx and connection errors already; the next run retries.
            summary.failed += 1
            log.warning("could not check task %s: %s", task_id, exc)
            return
        if event is None:  # unscheduled, no run: nothing the index could say about it
            summary.unchanged += 1
            return
        ready.append(event)
        if len(ready) >= chunk:
            await flush()

    async def worker() -> None:
        while todo:
            task_id, known = todo.pop()
            await check(task_id, known)
            if progress is not None:
                progress(1)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    await flush()
    summary.seconds = time.monotonic() - started
    return summary
