"""Reconciliation: check what the index holds against the queue, and fix it.

Events can be lost (a crash between publish and delivery, a queue deleted by Pulse). For every
task the index knows, the queue's status (asked for many tasks at once) is turned into an event
by the same version logic as a Pulse message (:func:`~coalescer.ingest.events.status_event`) and
applied: a newer status fixes the index, an equal or older one changes nothing. A task the
queue no longer knows is removed. The routes of an indexed task are known from the keys it is indexed under.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import Any

import aiohttp
from taskcluster.exceptions import TaskclusterFailure, TaskclusterRestFailure

from coalescer.errors import InvalidEvent
from coalescer.ingest import validation
from coalescer.ingest.events import status_event
from coalescer.model import TaskEvent
from coalescer.settings import queue_credentials
from coalescer.store import Store
from coalescer.store.census import Limits

log = logging.getLogger(__name__)

#: The statuses (``task-status.json``) of the tasks the queue knows among those asked for, by
#: taskId; a task left out is one the queue does not know.
StatusFetcher = Callable[[Sequence[str]], Awaitable[Mapping[str, Mapping[str, Any]]]]


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
    #: Not indexed where the index lacks them: past COALESCER_MAX_KEYS/COALESCER_MAX_TASKS.
    limited: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        return (
            f"reconciled {self.tasks} tasks under {self.keys} keys in {self.seconds:.1f} s: "
            f"{self.fixed} fixed, {self.unchanged} already right, {self.removed} removed "
            f"(unknown to the queue), {self.expired} expired, {self.failed} failed"
        ) + (f", {self.limited} past the index's limits" if self.limited else "")


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


def queue_session(root_url: str, *, max_retries: int) -> tuple[Any, aiohttp.ClientSession]:
    """A ``taskcluster.aio.Queue`` at ``root_url`` on an HTTP session of its own (the caller
    closes it), signing with the credentials in the environment when there are any (a queue
    whose anonymous role cannot read tasks, listings that need scopes). Call from a running
    event loop."""
    import taskcluster.aio

    session = taskcluster.aio.createSession()
    options: dict[str, Any] = {"rootUrl": root_url, "maxRetries": max_retries}
    if creds := queue_credentials():
        options["credentials"] = creds
    return taskcluster.aio.Queue(options, session=session), session


def queue_fetcher(queue: Any) -> StatusFetcher:
    """A :data:`StatusFetcher` on an official ``taskcluster.aio.Queue`` client: the queue's bulk
    ``statuses`` endpoint, or ``status`` task by task on a queue that lacks it (404). Answers
    are checked against the saved schemas, as Pulse messages are."""
    bulk = True

    async def fetch(task_ids: Sequence[str]) -> Mapping[str, Mapping[str, Any]]:
        nonlocal bulk
        if bulk:
            try:
                return await _statuses(queue, task_ids)
            except TaskclusterRestFailure as exc:
                if exc.status_code != 404:
                    raise
                bulk = False
                log.info("the queue has no bulk statuses endpoint: asking task by task")
        found = await asyncio.gather(*(_status(queue, t) for t in task_ids))
        return {t: status for t, status in zip(task_ids, found, strict=True) if status}

    return fetch


async def _statuses(queue: Any, task_ids: Sequence[str]) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}
    query: dict[str, Any] = {}
    while True:
        body = await queue.statuses(payload={"taskIds": list(task_ids)}, query=query)
        _check("tasks-statuses-response", body, ("statuses", lambda entry: entry["taskId"]))
        out.update((entry["taskId"], entry["status"]) for entry in body["statuses"])
        if "continuationToken" not in body:
            return out
        query = {"continuationToken": body["continuationToken"]}


async def _status(queue: Any, task_id: str) -> Mapping[str, Any] | None:
    try:
        body = await queue.status(task_id)
    except TaskclusterRestFailure as exc:
        if exc.status_code == 404:
            return None
        raise
    _check("task-status-response", body)
    status: Mapping[str, Any] = body["status"]
    return status


def _check(
    schema: str, body: Any, listing: tuple[str, Callable[[Any], Hashable]] | None = None
) -> None:
    """Refuse an answer that fails its schema; ``listing`` is ``(field, identity)`` for a
    listing's items (see :func:`validation.listing_errors`)."""
    if listing is None:
        problems = validation.errors(schema, body)
    else:
        problems = validation.listing_errors(schema, body, *listing)
    if problems:
        raise InvalidEvent(f"the queue's {schema} fails its schema: " + "; ".join(problems))


async def reconcile(
    store: Store,
    tasks: Mapping[str, Indexed],
    fetch: StatusFetcher,
    *,
    concurrency: int = 4,
    batch: int = 500,
    progress: Callable[[int], object] | None = None,
    limits: Limits | None = None,
) -> Summary:
    """Check ``tasks`` (from :func:`indexed_tasks`), ``batch`` tasks per status request with at
    most ``concurrency`` requests in flight; each batch's events are applied in one round
    trip, held to ``limits`` as ingest is."""
    started = time.monotonic()
    summary = Summary(tasks=len(tasks))
    todo = list(tasks.items())

    async def check(chunk: list[tuple[str, Indexed]]) -> None:
        try:
            statuses = await fetch([task_id for task_id, _ in chunk])
        except (TaskclusterFailure, aiohttp.ClientError, TimeoutError, InvalidEvent) as exc:
            # The client has retried 5xx and connection errors already; the next run retries.
            summary.failed += len(chunk)
            log.warning("could not check %d tasks: %s", len(chunk), exc)
            return
        events: list[TaskEvent] = []
        unknown: dict[str, list[str]] = {}  # by key: tasks the queue does not know
        for task_id, known in chunk:
            status = statuses.get(task_id)
            if status is None:
                for key in known.keys:
                    unknown.setdefault(key, []).append(task_id)
                summary.removed += 1
                log.info("removed task %s: the queue does not know it", task_id)
                continue
            try:
                event = status_event(status, known.keys, order=known.order)
            except InvalidEvent as exc:
                summary.failed += 1
                log.warning("could not check task %s: %s", task_id, exc)
                continue
            if event is None:  # unscheduled, no run: nothing the index could say about it
                summary.unchanged += 1
            else:
                events.append(event)
        for key, task_ids in unknown.items():
            await store.forget(key, task_ids)
        for outcome in await store.apply(events, limits=limits) if events else []:
            if outcome == "applied":
                summary.fixed += 1
            elif outcome == "expired":
                summary.expired += 1
            elif outcome == "limited":
                summary.limited += 1
            else:
                summary.unchanged += 1

    async def worker() -> None:
        while todo:
            chunk = todo[-batch:]
            del todo[-batch:]
            await check(chunk)
            if progress is not None:
                progress(len(chunk))

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    summary.seconds = time.monotonic() - started
    return summary
