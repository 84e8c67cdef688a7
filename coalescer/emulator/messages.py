"""Pulse messages as the queue publishes them: exchange, primary routing key, CC and body.

The routing-key layout comes from the saved ``exchanges.json`` reference, field by field, with
``_`` for a missing value, exactly as taskcluster-lib-pulse builds it; CC is ``route.<r>`` for
each of ``task.routes`` (none for a task group's messages).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

from coalescer.emulator.clock import format_time
from coalescer.emulator.model import Artifact, Run, Task, TaskGroup
from coalescer.schemas import load_reference


@dataclasses.dataclass(frozen=True)
class Message:
    """One message for one exchange."""

    exchange: str
    routing_key: str
    cc: tuple[str, ...]
    payload: dict[str, Any]

    @property
    def kind(self) -> str:
        """The exchange's short name, e.g. ``task-pending``."""
        return self.exchange.rsplit("/", 1)[-1]

    def to_json(self) -> dict[str, Any]:
        """The shape ``POST /v1/events`` takes, and what the pytest fixture records."""
        return {
            "exchange": self.exchange,
            "routingKey": self.routing_key,
            "CC": list(self.cc),
            "payload": self.payload,
        }


@functools.cache
def _reference() -> tuple[str, dict[str, list[dict[str, Any]]]]:
    ref = load_reference("exchanges.json")
    layouts = {entry["exchange"]: entry["routingKey"] for entry in ref["entries"]}
    return ref["exchangePrefix"], layouts


def exchange_name(kind: str) -> str:
    """``task-pending`` → ``exchange/taskcluster-queue/v1/task-pending``."""
    prefix, layouts = _reference()
    if kind not in layouts:
        raise KeyError(f"the queue has no exchange {kind!r}")
    return prefix + kind


def _compose(
    kind: str, fields: dict[str, Any], cc: tuple[str, ...], payload: dict[str, Any]
) -> Message:
    words = []
    for entry in _reference()[1][kind]:
        if "constant" in entry:
            words.append(str(entry["constant"]))
        else:
            value = fields.get(entry["name"])
            words.append("_" if value is None else str(value))
    return Message(exchange_name(kind), ".".join(words), cc, payload)


def build(kind: str, task: Task, body: dict[str, Any]) -> Message:
    """A message about ``task`` on exchange ``kind``; ``body`` lacks ``version``."""
    payload = {"version": 1, **body}
    status = payload["status"]
    fields = {
        "taskId": status["taskId"],
        "runId": payload.get("runId"),
        "workerGroup": payload.get("workerGroup"),
        "workerId": payload.get("workerId"),
        "provisionerId": status["provisionerId"],
        "workerType": status["workerType"],
        "schedulerId": status["schedulerId"],
        "taskGroupId": status["taskGroupId"],
    }
    return _compose(kind, fields, tuple(f"route.{route}" for route in task.routes), payload)


def build_group(kind: str, group: TaskGroup, body: dict[str, Any]) -> Message:
    """A message about a task group on exchange ``kind``: no CC, as a group has no routes."""
    fields = {"taskGroupId": group.task_group_id, "schedulerId": group.scheduler_id}
    return _compose(kind, fields, (), {"version": 1, **fields, **body})


def _tags(task: Task) -> dict[str, Any]:
    return {"tags": task.definition["tags"]}


def task_defined(task: Task) -> Message:
    """The task as it was defined, before any run: the real queue publishes this status
    (``unscheduled``, no runs) even when the task is pending at once."""
    defined = {**task.status(), "state": "unscheduled", "runs": []}
    defined["retriesLeft"] = task.definition["retries"]
    return build("task-defined", task, {"status": defined, "task": _tags(task)})


def task_pending(task: Task, run: Run) -> Message:
    body = {"status": task.status(), "runId": run.run_id, "task": _tags(task)}
    return build("task-pending", task, body)


def _worker(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if run.worker_group is not None and run.worker_id is not None:
        out["workerGroup"] = run.worker_group
        out["workerId"] = run.worker_id
    return out


def task_running(task: Task, run: Run) -> Message:
    assert run.taken_until is not None
    body = {
        "status": task.status(),
        "runId": run.run_id,
        "takenUntil": format_time(run.taken_until),
        "task": _tags(task),
        **_worker(run),
    }
    return build("task-running", task, body)


def task_resolved(task: Task, run: Run, *, with_worker: bool = True) -> Message:
    """``task-completed``, ``task-failed`` or ``task-exception``, by the run's state.

    The real deadline resolver leaves the worker out of its exception message (and so out of the
    routing key); ``with_worker=False`` does the same.
    """
    body: dict[str, Any] = {"status": task.status(), "runId": run.run_id, "task": _tags(task)}
    if with_worker:
        body.update(_worker(run))
    return build(f"task-{run.state}", task, body)


def artifact_created(task: Task, run: Run, artifact: Artifact) -> Message:
    # The message's artifact structure has no ``contentLength`` (additionalProperties: false).
    described = {k: v for k, v in artifact.to_json().items() if k != "contentLength"}
    body = {"status": task.status(), "runId": run.run_id, "artifact": described, **_worker(run)}
    return build("artifact-created", task, body)


def task_group_resolved(group: TaskGroup) -> Message:
    return build_group("task-group-resolved", group, group.to_json())


def task_group_sealed(group: TaskGroup) -> Message:
    return build_group("task-group-sealed", group, group.to_json())


def task_priority_changed(task: Task, old: str) -> Message:
    """The message has no ``runId``, so its routing key has ``_`` for the run and worker, as
    for ``task-defined``: the queue builds every task routing key from the message's fields."""
    body = {"status": task.status(), "oldPriority": old, "newPriority": task.priority}
    return build("task-priority-changed", task, body)


def task_group_priority_changed(group: TaskGroup, priority: str, affected: int) -> Message:
    body = {"newPriority": priority, "tasksAffected": affected}
    return build_group("task-group-priority-changed", group, body)


def select(
    published: Iterable[dict[str, Any]], kind: str | None = None, task_id: str | None = None
) -> list[dict[str, Any]]:
    """Published messages (as JSON), filtered by exchange short name (``task-pending``) and
    taskId (which leaves out a task group's messages: they name no task)."""
    return [
        m
        for m in list(published)
        if (kind is None or m["exchange"].rsplit("/", 1)[-1] == kind)
        and (task_id is None or m["payload"].get("status", {}).get("taskId") == task_id)
    ]
