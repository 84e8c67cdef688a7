"""The queue's task-queue listings: ``listPendingTasks``, ``listClaimedTasks`` and
``listTaskQueues``, answered from the emulator's state as the real queue answers them.

* ``listPendingTasks``: the pending runs of a task queue, in the order they were inserted into
  the pending queue (``inserted`` is when the run became pending);
* ``listClaimedTasks``: its running runs, the oldest claim first;
* ``listTaskQueues``: the task queues seen lately (tasks created in them, claimed from them),
  by ``taskQueueId``.

Pages are cut by ``limit`` (at most 1000). The ``continuationToken`` names the last entry
returned, not an offset, so that a task leaving the listing between two pages (claimed,
resolved) does not make the next page skip one that is still there.

Pure: each function takes the state and the query string and returns the answer's body.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from coalescer.emulator.clock import format_time, parse_time
from coalescer.emulator.model import QueueError, Run, Task
from coalescer.emulator.state import QueueState

#: The most entries one page holds, and the default (the real queue's).
PAGE_LIMIT = 1000
#: The task queue fields the emulator has nothing better for (the real queue's defaults).
_QUEUE_DEFAULTS = {"stability": "experimental", "description": ""}
#: What a continuationToken looks like: a run's place (see :func:`_sortable`), a taskQueueId.
_RUN_TOKEN = r"[0-9]{20}-[0-9]{12}"
_QUEUE_TOKEN = r"[a-zA-Z0-9_-]{1,38}/[-a-z0-9]{1,38}"
#: How long a task queue outlives its last creation of a task, and its last claim.
_SEEN_BY_CREATION = timedelta(days=5)
_SEEN_BY_CLAIM = timedelta(days=1)


def _limit(query: Mapping[str, str]) -> int:
    try:
        limit = int(query.get("limit") or PAGE_LIMIT)
    except ValueError:
        raise QueueError("InvalidRequestArguments", "limit must be an integer") from None
    return min(max(limit, 1), PAGE_LIMIT)


def _after(query: Mapping[str, str], pattern: str) -> str | None:
    token = query.get("continuationToken") or None
    if token is not None and not re.fullmatch(pattern, token):
        raise QueueError("InvalidRequestArguments", f"bad continuationToken: {token!r}")
    return token


def _keyset_page(
    rows: Iterable[tuple[str, dict[str, Any]]],
    query: Mapping[str, str],
    what: str,
    token: str = _RUN_TOKEN,
) -> dict[str, Any]:
    """``{"tasks" | "taskQueues": [...], "continuationToken"?}`` from ``(sort key, entry)`` rows:
    the rows after the token's sort key, up to the limit."""
    limit, after = _limit(query), _after(query, token)
    ordered = sorted(rows, key=lambda row: row[0])
    if after is not None:
        ordered = [row for row in ordered if row[0] > after]
    page = ordered[:limit]
    out: dict[str, Any] = {what: [entry for _, entry in page]}
    if len(ordered) > limit:
        out["continuationToken"] = page[-1][0]
    return out


def _runs(state: QueueState, queue_id: str, run_state: str) -> Iterable[tuple[Task, Run]]:
    for task in state.tasks.values():
        if task.task_queue_id == queue_id and task.state == run_state:
            yield task, task.runs[-1]


def _sortable(when: datetime, seq: int) -> str:
    """A token that sorts as ``(when, seq)`` does: a run's place in a listing."""
    return f"{when.timestamp() * 1_000_000:020.0f}-{seq:012d}"


def pending_tasks(state: QueueState, queue_id: str, query: Mapping[str, str]) -> dict[str, Any]:
    """``list-pending-tasks-response.json``."""
    rows = (
        (
            _sortable(run.scheduled, run.seq),
            {
                "taskId": task.task_id,
                "runId": run.run_id,
                "task": task.definition,
                "inserted": format_time(run.scheduled),
            },
        )
        for task, run in _runs(state, queue_id, "pending")
    )
    return _keyset_page(rows, query, "tasks")


def claimed_tasks(state: QueueState, queue_id: str, query: Mapping[str, str]) -> dict[str, Any]:
    """``list-claimed-tasks-response.json``."""
    rows = (
        (
            _sortable(run.started or run.scheduled, run.seq),
            {
                "taskId": task.task_id,
                "runId": run.run_id,
                "workerGroup": run.worker_group,
                "workerId": run.worker_id,
                "claimed": format_time(run.started or run.scheduled),
                "task": task.definition,
            },
        )
        for task, run in _runs(state, queue_id, "running")
    )
    return _keyset_page(rows, query, "tasks")


def task_queues(state: QueueState, query: Mapping[str, str], now: datetime) -> dict[str, Any]:
    """``list-taskqueues-response.json``: as the real queue keeps them, a task queue is seen
    when a task is created in it (it then lives 5 more days) or claimed from it (1 more day);
    it is listed until it expires."""
    active: dict[str, datetime] = {}
    expires: dict[str, datetime] = {}
    for task in state.tasks.values():
        queue_id = task.task_queue_id
        created = parse_time(task.definition["created"])
        seen = [(created, created + _SEEN_BY_CREATION)]
        seen += [(r.started, r.started + _SEEN_BY_CLAIM) for r in task.runs if r.started]
        for when, until in seen:
            active[queue_id] = max(active.get(queue_id, when), when)
            expires[queue_id] = max(expires.get(queue_id, until), until)
    rows = (
        (
            queue_id,
            {
                "taskQueueId": queue_id,
                **_QUEUE_DEFAULTS,
                "expires": format_time(expires[queue_id]),
                "lastDateActive": format_time(last),
            },
        )
        for queue_id, last in active.items()
        if expires[queue_id] > now
    )
    return _keyset_page(rows, query, "taskQueues", _QUEUE_TOKEN)
