"""Rebuilding the index from the queue, after the store lost it (Redis restarted empty).

:mod:`~coalescer.ingest.reconcile` checks what the index holds; an emptied index holds nothing,
so superseding stays off until new events arrive. A rebuild asks the queue what is live
instead: the pending and the claimed (running) tasks of each task queue (``listPendingTasks``,
``listClaimedTasks``, and ``listTaskQueues`` to find the task queues), or the tasks of task
groups (``listTaskGroup``, on queue releases without those listings). It keeps the tasks with a
coalescing route, asks their statuses in bulk (the reconcile's fetcher, with its task-by-task
fallback) and applies them as events through the store's ordinary write path. Versions make it
idempotent and safe while events flow: a task that started running after it was listed, or
whose running event was applied first, is never made pending again.

:func:`listed_task` decides what one listing entry is worth; :func:`rebuild` does the IO, and
:func:`rebuild_index` the whole of it with the index's marker: ``coalescer reconcile --rebuild``
and, with the embedded store, ``coalescer serve`` at start (:mod:`coalescer.ingest.startup`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import aiohttp
from taskcluster.exceptions import TaskclusterFailure, TaskclusterRestFailure

from coalescer.errors import CoalescerError, InvalidEvent
from coalescer.ingest import validation
from coalescer.ingest.events import status_event
from coalescer.ingest.reconcile import StatusFetcher, queue_fetcher, queue_session
from coalescer.model import TaskEvent, keys_from_routes
from coalescer.store import Store
from coalescer.store.census import Limits

log = logging.getLogger(__name__)

#: Listing method → the schema of its answer, and what names an entry.
_SCHEMAS: dict[str, tuple[str, Callable[[Any], Hashable]]] = {
    "listPendingTasks": ("list-pending-tasks-response", lambda e: (e["taskId"], e["runId"])),
    "listClaimedTasks": ("list-claimed-tasks-response", lambda e: (e["taskId"], e["runId"])),
    "listTaskGroup": ("list-task-group-response", lambda e: e["status"]["taskId"]),
    "listTaskQueues": ("list-taskqueues-response", lambda e: e["taskQueueId"]),
}
#: Task states worth rebuilding from a task group's listing (the others say nothing the index
#: needs: unscheduled tasks have no run, resolved ones are never offered).
_LIVE = frozenset(("pending", "running"))


class ListingFailed(CoalescerError):
    """A listing could not be read to its end; the message says why and what to do."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        #: The queue's HTTP status, when it answered with an error.
        self.status = status


@dataclasses.dataclass(frozen=True, slots=True)
class Source:
    """One listing to read: ``method(arg)`` on the queue client."""

    method: str
    arg: str

    def __str__(self) -> str:
        if self.method == "listTaskGroup":
            return f"task group {self.arg}"
        what = "pending" if self.method == "listPendingTasks" else "claimed"
        return f"{what} tasks of {self.arg}"


def sources(task_queue_ids: Sequence[str], task_groups: Sequence[str]) -> list[Source]:
    """The listings that cover ``task_queue_ids`` (pending, then claimed) and ``task_groups``."""
    out = [Source(m, q) for q in task_queue_ids for m in ("listPendingTasks", "listClaimedTasks")]
    return out + [Source("listTaskGroup", g) for g in task_groups]


@dataclasses.dataclass(frozen=True, slots=True)
class Listed:
    """A listed task worth indexing: its id, coalescing keys and tags (for its order)."""

    task_id: str
    keys: tuple[str, ...]
    tags: Mapping[str, Any]


def listed_task(entry: Mapping[str, Any], prefix: str) -> Listed | None:
    """What one listing entry (``listPendingTasks``, ``listClaimedTasks`` or ``listTaskGroup``)
    gives the index: ``None`` for a task without a coalescing route, or a task group's task
    that is neither pending nor running."""
    task = entry["task"]
    if "status" in entry:  # a task group's entry
        if entry["status"]["state"] not in _LIVE:
            return None
        task_id = entry["status"]["taskId"]
    else:
        task_id = entry["taskId"]
    keys = keys_from_routes(task.get("routes", []), prefix)
    return Listed(task_id, keys, task.get("tags") or {}) if keys else None


@dataclasses.dataclass
class RebuildSummary:
    """What a rebuild did; ``incomplete`` names each listing it could not read to its end."""

    listed: int = 0
    tasks: int = 0
    keys: set[str] = dataclasses.field(default_factory=set)
    indexed: int = 0
    unchanged: int = 0
    expired: int = 0
    gone: int = 0
    failed: int = 0
    #: Not indexed: past COALESCER_MAX_KEYS/COALESCER_MAX_TASKS (as ingest would refuse them).
    limited: int = 0
    incomplete: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """Whether everything asked for was listed and applied."""
        return not self.failed and not self.incomplete

    def line(self) -> str:
        head = (
            f"rebuilt {self.tasks} tasks under {len(self.keys)} keys ({self.listed} listed) in "
            f"{self.seconds:.1f} s: {self.indexed} indexed, {self.unchanged} already known, "
            f"{self.expired} expired, {self.gone} gone from the queue, {self.failed} failed"
        )
        if self.limited:
            head += f", {self.limited} past the index's limits"
        if self.incomplete:
            head += f"; INCOMPLETE, {len(self.incomplete)} listings not read to the end"
        return head


async def pages(queue: Any, method: str, *args: str) -> AsyncIterator[list[Mapping[str, Any]]]:
    """The entries of a paged listing, page by page, each page checked against its schema."""
    field = "taskQueues" if method == "listTaskQueues" else "tasks"
    query: dict[str, str] = {}
    while True:
        try:
            body = await getattr(queue, method)(*args, query=query)
        except TaskclusterRestFailure as exc:
            raise ListingFailed(_explain(method, args, exc), status=exc.status_code) from exc
        except (TaskclusterFailure, aiohttp.ClientError, TimeoutError) as exc:
            raise ListingFailed(f"{method} failed: {exc}") from exc
        schema, identity = _SCHEMAS[method]
        problems = validation.listing_errors(schema, body, field, identity)
        if problems:
            raise ListingFailed(f"the queue's {method} answer fails its schema: {problems[0]}")
        yield body[field]
        if "continuationToken" not in body:
            return
        query = {"continuationToken": body["continuationToken"]}


def _explain(method: str, args: Sequence[str], exc: TaskclusterRestFailure) -> str:
    if exc.status_code == 404 and method == "listTaskGroup":
        return f"the queue does not know task group {args[0]}"
    if exc.status_code == 404:
        return (
            f"the queue has no {method} endpoint (older queue releases answer 404): "
            "rebuild from task groups instead, with --task-group ID"
        )
    if exc.status_code == 403:
        return f"{method} was refused (403): the credentials lack its scope ({exc})"
    return f"{method} failed ({exc.status_code}): {exc}"


async def task_queue_ids(queue: Any) -> list[str]:
    """Every active task queue, by ``listTaskQueues``."""
    return [q["taskQueueId"] async for page in pages(queue, "listTaskQueues") for q in page]


async def rebuild(
    store: Store,
    queue: Any,
    listings: Sequence[Source],
    fetch: StatusFetcher,
    *,
    prefix: str,
    rank_tag: str | None = None,
    concurrency: int = 4,
    batch: int = 500,
    found: Callable[[int], object] | None = None,
    progress: Callable[[int], object] | None = None,
    limits: Limits | None = None,
) -> RebuildSummary:
    """Read ``listings`` page by page (up to ``concurrency`` at once), and index their tasks:
    ``batch`` tasks per status request, at most ``concurrency`` requests in flight, each
    batch's events applied in one round trip, held to ``limits`` as ingest is. ``found(n)`` is told of tasks as they are listed,
    ``progress(n)`` as they are applied."""
    started = time.monotonic()
    summary = RebuildSummary()
    seen: set[str] = set()
    chunks: asyncio.Queue[list[Listed] | None] = asyncio.Queue(maxsize=concurrency)
    listing_slots = asyncio.Semaphore(concurrency)

    async def emit(chunk: list[Listed]) -> None:
        summary.tasks += len(chunk)
        if found is not None:
            found(len(chunk))
        await chunks.put(chunk)

    async def read(source: Source) -> None:
        chunk: list[Listed] = []
        async with listing_slots:
            try:
                async for page in pages(queue, source.method, source.arg):
                    summary.listed += len(page)
                    for entry in page:
                        task = listed_task(entry, prefix)
                        if task is None or task.task_id in seen:
                            continue
                        seen.add(task.task_id)
                        summary.keys.update(task.keys)
                        chunk.append(task)
                        if len(chunk) >= batch:
                            await emit(chunk)
                            chunk = []
            except ListingFailed as exc:
                summary.incomplete.append(f"{source}: {exc}")
                log.error("could not list the %s: %s", source, exc)
        if chunk:
            await emit(chunk)

    async def index(chunk: list[Listed]) -> None:
        try:
            statuses = await fetch([t.task_id for t in chunk])
        except (TaskclusterFailure, aiohttp.ClientError, TimeoutError, InvalidEvent) as exc:
            summary.failed += len(chunk)
            log.warning("could not get the status of %d tasks: %s", len(chunk), exc)
            return
        events: list[TaskEvent] = []
        for task in chunk:
            status = statuses.get(task.task_id)
            if status is None:  # expired between the listing and now
                summary.gone += 1
                continue
            try:
                event = status_event(status, task.keys, tags=task.tags, rank_tag=rank_tag)
            except InvalidEvent as exc:
                summary.failed += 1
                log.warning("could not index task %s: %s", task.task_id, exc)
                continue
            if event is None:
                summary.unchanged += 1
            else:
                events.append(event)
        for outcome in await store.apply(events, limits=limits) if events else []:
            if outcome == "applied":
                summary.indexed += 1
            elif outcome == "expired":
                summary.expired += 1
            elif outcome == "limited":
                summary.limited += 1
            else:
                summary.unchanged += 1

    async def worker() -> None:
        while (chunk := await chunks.get()) is not None:
            await index(chunk)
            if progress is not None:
                progress(len(chunk))

    async def produce() -> None:
        await asyncio.gather(*(read(source) for source in listings))
        for _ in range(workers):
            await chunks.put(None)

    workers = max(1, concurrency)
    try:
        async with asyncio.TaskGroup() as group:  # one failing (Redis down) stops them all
            group.create_task(produce())
            for _ in range(workers):
                group.create_task(worker())
    except ExceptionGroup as exc:
        raise exc.exceptions[0] from exc
    summary.seconds = time.monotonic() - started
    return summary


@contextlib.asynccontextmanager
async def queue_client(root_url: str) -> AsyncIterator[Any]:
    """A ``taskcluster.aio.Queue`` at ``root_url``, signing with the credentials in the
    environment when there are any (the listings need scopes: docs/how-to/recover-store.md)."""
    queue, session = queue_session(root_url, max_retries=3)
    try:
        yield queue
    finally:
        await session.close()


async def rebuild_index(
    store: Store,
    queue: Any,
    *,
    prefix: str,
    rank_tag: str | None = None,
    task_queues: Iterable[str] = (),
    task_groups: Iterable[str] = (),
    concurrency: int = 4,
    batch: int = 500,
    found: Callable[[int], object] | None = None,
    progress: Callable[[int], object] | None = None,
    limits: Limits | None = None,
) -> RebuildSummary:
    """Rebuild the index from ``task_queues`` and ``task_groups`` (every active task queue when
    both are empty: :exc:`ListingFailed` when they cannot be listed), then mark it rebuilt when
    the rebuild is complete. A partial rebuild leaves the marker as it was."""
    # The marker first (created as lost if missing): a rebuild covers a loss found before it,
    # including one found by another client a moment ago, with a clock a little ahead.
    started = int(time.time() * 1000)
    started = max(started, (await store.index_state(started)).since_ms)
    queue_ids, groups = list(task_queues), list(task_groups)
    if not queue_ids and not groups:
        queue_ids = await task_queue_ids(queue)
        log.info("rebuilding from %d active task queues", len(queue_ids))
    summary = await rebuild(
        store,
        queue,
        sources(queue_ids, groups),
        queue_fetcher(queue),
        prefix=prefix,
        rank_tag=rank_tag,
        concurrency=concurrency,
        batch=batch,
        found=found,
        progress=progress,
        limits=limits,
    )
    if summary.complete:
        marker = await store.mark_rebuilt(int(time.time() * 1000), started_ms=started)
        if marker.state != "ok":
            summary.incomplete.append("the store was emptied while the rebuild ran: run it again")
    return summary
