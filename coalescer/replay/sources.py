"""Histories from what a queue recorded: Pulse messages (JSON lines), or task groups read from
the queue with the official client (``listTaskGroup``).

A task's history comes from its newest status: its first run's ``scheduled`` time, its task
queue and deadline, and the run that did its work (the last one resolved ``completed`` or
``failed``: its ``started``→``resolved`` is the duration the replay gives it). A task that
never did its work (superseded, canceled, deadline) gets a duration drawn from its key's runs.
A task whose newest run was canceled (``cancelTask``) is canceled in the replay at that time.
Order within a key is the index's: the rank tag if set, else the first run's ``scheduled``.
Pulse messages carry neither dependencies nor priorities: a task group read from the queue does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import orjson
from taskcluster.exceptions import TaskclusterFailure

from coalescer.errors import CoalescerError, InvalidEvent, InvalidInput
from coalescer.ingest import validation
from coalescer.ingest.events import EXCHANGE_PREFIX, Message, exchange_state, status_event
from coalescer.model import keys_from_routes, parse_time_ms
from coalescer.replay.history import History, TaskSpec, priority_rank


class SourceError(CoalescerError):
    """A history cannot be read: the message says where and why."""


def task_spec(
    status: Mapping[str, Any],
    routes: Iterable[str],
    *,
    prefix: str,
    rank_tag: str | None,
    tags: Mapping[str, Any] | None = None,
    definition: Mapping[str, Any] | None = None,
) -> TaskSpec | None:
    """The replayable task of a status (and its definition, when read from the queue); ``None``
    for a task that was never pending and never will be (resolved before any run)."""
    runs = status.get("runs") or []
    keys = keys_from_routes(list(routes), prefix)
    if definition is not None:  # a dependent was created with its push, pending later
        scheduled = parse_time_ms(definition["created"])
    elif runs:
        scheduled = parse_time_ms(runs[0]["scheduled"])
    else:
        return None
    order = float(scheduled)
    if keys and runs:
        event = status_event(status, keys, tags=tags, rank_tag=rank_tag)
        if event is not None:
            order = event.order
    worked = [r for r in runs if r.get("state") in ("completed", "failed") and "started" in r]
    started = resolved = 0
    if worked:
        started, resolved = (
            parse_time_ms(worked[-1]["started"]),
            parse_time_ms(worked[-1]["resolved"]),
        )
    last = runs[-1] if runs else {}
    canceled = last.get("reasonResolved") == "canceled" and "resolved" in last
    queue = status.get("taskQueueId") or f"{status['provisionerId']}/{status['workerType']}"
    definition = definition or {}
    return TaskSpec(
        task_id=status["taskId"],
        task_queue=queue,
        keys=keys,
        order=order,
        scheduled_ms=scheduled,
        deadline_ms=parse_time_ms(status["deadline"]),
        priority=priority_rank(definition.get("priority", "lowest")),
        dependencies=tuple(d for d in definition.get("dependencies", ()) if d != status["taskId"]),
        duration_ms=resolved - started if worked else None,
        outcome=worked[-1]["state"] if worked else "completed",
        started_ms=started,
        resolved_ms=resolved,
        canceled_ms=parse_time_ms(last["resolved"]) if canceled else 0,
    )


def read_events(lines: Iterable[bytes | str]) -> Iterator[Message]:
    """Messages from JSON lines (blank lines skipped; ``POST /v1/events`` shapes)."""
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield Message.from_json(orjson.loads(line))
        except (orjson.JSONDecodeError, InvalidEvent) as exc:
            raise SourceError(f"line {n}: {exc}") from exc


def from_events(
    messages: Iterable[Message],
    *,
    prefix: str,
    rank_tag: str | None,
    workers: Mapping[str, int] | None = None,
    default_workers: int | None = None,
    source: str = "recorded events",
) -> History:
    """A history from recorded Pulse messages: each task as its newest message shows it."""
    newest: dict[str, tuple[tuple[int, int], Message]] = {}
    for message in messages:
        try:
            exchange_state(message.exchange)
        except InvalidEvent:
            continue  # task-defined, artifact-created, task groups: nothing to replay
        status = message.payload.get("status") or {}
        task_id = status.get("taskId")
        if not isinstance(task_id, str):
            raise SourceError(f"a {message.exchange} message without status.taskId")
        runs = status.get("runs") or []
        # A later message knows more: more runs, or the same run further along.
        weight = (len(runs), len([r for r in runs if "resolved" in r]))
        if task_id not in newest or weight >= newest[task_id][0]:
            newest[task_id] = (weight, message)
    tasks = []
    for _, message in newest.values():
        name = message.exchange.removeprefix(EXCHANGE_PREFIX)
        if problems := validation.errors(f"{name}-message", message.payload):
            raise SourceError(f"a {name} message fails its schema: " + "; ".join(problems))
        tags = (message.payload.get("task") or {}).get("tags")
        try:
            spec = task_spec(
                message.payload["status"],
                message.routes,
                prefix=prefix,
                rank_tag=rank_tag,
                tags=tags,
            )
        except (KeyError, InvalidEvent, InvalidInput) as exc:
            raise SourceError(f"task {message.payload['status'].get('taskId')}: {exc}") from exc
        if spec is not None:
            tasks.append(spec)
    if not tasks:
        raise SourceError("the messages hold no task that was ever pending")
    return History.build(tasks, workers=workers, default_workers=default_workers, source=source)


def from_task_groups(
    queue: Any,
    group_ids: Iterable[str],
    *,
    prefix: str,
    rank_tag: str | None,
    workers: Mapping[str, int] | None = None,
    default_workers: int | None = None,
) -> History:
    """A history from task groups, read with ``queue`` (a ``taskcluster.Queue``)."""
    tasks = []
    ids = list(group_ids)
    for group in ids:
        query: dict[str, str] = {}
        while True:
            try:
                page = queue.listTaskGroup(group, query=query)
            except TaskclusterFailure as exc:
                raise SourceError(f"cannot list task group {group}: {exc}") from exc
            for entry in page["tasks"]:
                definition, status = entry["task"], entry["status"]
                try:
                    spec = task_spec(
                        status,
                        definition.get("routes", []),
                        prefix=prefix,
                        rank_tag=rank_tag,
                        tags=definition.get("tags"),
                        definition=definition,
                    )
                except (KeyError, InvalidEvent, InvalidInput) as exc:
                    raise SourceError(f"task {status.get('taskId')}: {exc}") from exc
                if spec is not None:
                    tasks.append(spec)
            if not page.get("continuationToken"):
                break
            query = {"continuationToken": page["continuationToken"]}
    if not tasks:
        raise SourceError(f"task groups {', '.join(ids)} hold no task")
    return History.build(
        tasks,
        workers=workers,
        default_workers=default_workers,
        source="task groups " + ", ".join(ids),
    )
