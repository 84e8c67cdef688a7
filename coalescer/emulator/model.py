"""The emulator's records: tasks, runs, artifacts and task groups, and their JSON as the queue
returns it.

Plain data with no behaviour beyond serialisation; :mod:`coalescer.emulator.state` decides how
they change.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from coalescer.emulator.clock import format_time

#: Task priorities, most urgent first (``task.json#/properties/priority``).
PRIORITIES = ("highest", "very-high", "high", "medium", "low", "very-low", "lowest")
RESOLVED = frozenset({"completed", "failed", "exception"})

#: Taskcluster's error codes and the HTTP status each stands for (taskcluster-lib-api).
ERROR_STATUS = {
    "MalformedPayload": 400,
    "InvalidRequestArguments": 400,
    "InputValidationError": 400,
    "InputError": 400,
    "AuthenticationFailed": 401,
    "InsufficientScopes": 403,
    "ResourceNotFound": 404,
    "RequestConflict": 409,
    "ResourceExpired": 410,
    "InputTooLarge": 413,
    # S3's answers on the emulated ``putUrl``
    "AccessDenied": 403,
    "NoSuchKey": 404,
}


class QueueError(Exception):
    """An error the queue reports to its caller, by Taskcluster error ``code``."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details

    @property
    def status(self) -> int:
        return ERROR_STATUS.get(self.code, 500)


@dataclasses.dataclass
class Run:
    """One attempt at a task (``task-status.json#/properties/runs/items``)."""

    run_id: int
    state: str
    reason_created: str
    scheduled: datetime
    #: Global creation order, so that claimWork hands out equally old runs first-come first-served.
    seq: int = 0
    reason_resolved: str | None = None
    worker_group: str | None = None
    worker_id: str | None = None
    taken_until: datetime | None = None
    started: datetime | None = None
    resolved: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "runId": self.run_id,
            "state": self.state,
            "reasonCreated": self.reason_created,
            "scheduled": format_time(self.scheduled),
        }
        if self.reason_resolved is not None:
            out["reasonResolved"] = self.reason_resolved
        if self.worker_group is not None:
            out["workerGroup"] = self.worker_group
        if self.worker_id is not None:
            out["workerId"] = self.worker_id
        for key, value in (
            ("takenUntil", self.taken_until),
            ("started", self.started),
            ("resolved", self.resolved),
        ):
            if value is not None:
                out[key] = format_time(value)
        return out


@dataclasses.dataclass
class Artifact:
    """An artifact of one run; ``data`` holds the bytes PUT to an ``s3`` artifact's ``putUrl``."""

    name: str
    storage_type: str
    content_type: str
    expires: datetime
    details: dict[str, Any]
    content_length: int | None = None
    put_expires: datetime | None = None
    data: bytes | None = None
    data_type: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "storageType": self.storage_type,
            "name": self.name,
            "expires": format_time(self.expires),
            "contentType": self.content_type,
        }
        if self.content_length is not None:
            out["contentLength"] = self.content_length
        return out


@dataclasses.dataclass
class Task:
    """A task: its definition (as ``queue.task`` returns it), runs and artifacts."""

    task_id: str
    definition: dict[str, Any]
    deadline: datetime
    expires: datetime
    retries_left: int
    #: Creation order: the order in which the real queue's ``tasks`` table holds the tasks.
    seq: int = 0
    runs: list[Run] = dataclasses.field(default_factory=list)
    artifacts: dict[tuple[int, str], Artifact] = dataclasses.field(default_factory=dict)
    #: The real queue's ``ever_resolved`` mark: set once the dependency resolver has handled a
    #: resolution of the task, and never cleared (not even by a rerun).
    ever_resolved: bool = False

    @property
    def state(self) -> str:
        return self.runs[-1].state if self.runs else "unscheduled"

    @property
    def resolved(self) -> bool:
        return self.state in RESOLVED

    @property
    def task_queue_id(self) -> str:
        return str(self.definition["taskQueueId"])

    @property
    def routes(self) -> list[str]:
        return list(self.definition["routes"])

    @property
    def dependencies(self) -> list[str]:
        return list(self.definition["dependencies"])

    @property
    def priority(self) -> str:
        return str(self.definition["priority"])

    @property
    def task_group_id(self) -> str:
        return str(self.definition["taskGroupId"])

    @property
    def priority_rank(self) -> int:
        return PRIORITIES.index(self.priority)

    def run(self, run_id: int) -> Run:
        """The run ``run_id``, or ResourceNotFound."""
        if 0 <= run_id < len(self.runs):
            return self.runs[run_id]
        raise QueueError(
            "ResourceNotFound", f"Run {run_id} not found on task `{self.task_id}`.", runId=run_id
        )

    def status(self) -> dict[str, Any]:
        """``task-status.json``."""
        d = self.definition
        return {
            "taskId": self.task_id,
            "provisionerId": d["provisionerId"],
            "workerType": d["workerType"],
            "taskQueueId": d["taskQueueId"],
            "schedulerId": d["schedulerId"],
            "projectId": d["projectId"],
            "taskGroupId": d["taskGroupId"],
            "priority": d["priority"],
            "deadline": d["deadline"],
            "expires": d["expires"],
            "retriesLeft": self.retries_left,
            "state": self.state,
            "runs": [run.to_json() for run in self.runs],
        }


@dataclasses.dataclass
class TaskGroup:
    """A task group: made by its first task, it lives until its last task expires."""

    task_group_id: str
    scheduler_id: str
    #: the latest ``expires`` of any task ever in the group (it only grows)
    expires: datetime
    sealed: datetime | None = None
    #: the taskIds of the tasks in the group that still exist (a dict as an ordered set)
    members: dict[str, None] = dataclasses.field(default_factory=dict)
    #: how many of them are not yet :attr:`Task.ever_resolved`: the group is "active" (the real
    #: queue's ``is_task_group_active``) while this is above zero
    never_resolved: int = 0

    def to_json(self) -> dict[str, Any]:
        """``task-group-response.json``."""
        out: dict[str, Any] = {
            "taskGroupId": self.task_group_id,
            "schedulerId": self.scheduler_id,
            "expires": format_time(self.expires),
        }
        if self.sealed is not None:
            out["sealed"] = format_time(self.sealed)
        return out
