"""Task groups and priorities: the registry every task joins when it is created, and the pure
transitions of sealTaskGroup, cancelTaskGroup, changeTaskPriority and changeTaskGroupPriority.

A group comes into being with its first task, takes that task's ``schedulerId`` (every later
task must have the same), and lives until its last task expires. Once sealed it refuses new
tasks, and only then can it be canceled. Like :mod:`coalescer.emulator.claims`, the transitions
are plain functions on a :class:`~coalescer.emulator.state.QueueState` returning ``(response
body, messages to publish)``.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from coalescer.emulator import messages as msg
from coalescer.emulator.collation import sort_key
from coalescer.emulator.model import QueueError, Task, TaskGroup

if TYPE_CHECKING:
    from coalescer.emulator.state import Outcome, QueueState


class TaskGroups:
    """Every task group, by taskGroupId."""

    def __init__(self) -> None:
        self._groups: dict[str, TaskGroup] = {}

    def get(self, task_group_id: str) -> TaskGroup:
        """The group, or ResourceNotFound."""
        try:
            return self._groups[task_group_id]
        except KeyError:
            raise QueueError(
                "ResourceNotFound",
                f"No task group with taskGroupId `{task_group_id}`.",
                taskGroupId=task_group_id,
            ) from None

    def find(self, task_group_id: str) -> TaskGroup | None:
        """The group, or ``None``."""
        return self._groups.get(task_group_id)

    def check_joinable(self, definition: dict[str, Any]) -> None:
        """RequestConflict when a task with this (normalized) definition cannot join its group:
        the group holds another scheduler's tasks, or is sealed.

        The real queue ensures the group before it looks for an existing task, so this refuses
        an identical retry of createTask into a sealed group too (most plausibly: the
        documentation does not say)."""
        group_id, scheduler_id = definition["taskGroupId"], definition["schedulerId"]
        group = self._groups.get(group_id)
        if group is None:
            return
        if group.scheduler_id != scheduler_id:
            raise QueueError(
                "RequestConflict",
                f"Task group `{group_id}` contains tasks with schedulerId "
                f"`{group.scheduler_id}`, not `{scheduler_id}`: all tasks of a task group must "
                "have the same schedulerId.",
                taskGroupId=group_id,
            )
        if group.sealed is not None:
            raise QueueError(
                "RequestConflict",
                f"Task group `{group_id}` is sealed: no more tasks can be created in it.",
                taskGroupId=group_id,
            )

    def join(self, task: Task) -> None:
        """Add a new task to its group, making the group if it is the first."""
        group = self._groups.get(task.task_group_id)
        if group is None:
            scheduler_id = str(task.definition["schedulerId"])
            group = TaskGroup(task.task_group_id, scheduler_id, expires=task.expires)
            self._groups[task.task_group_id] = group
        # The schema: "after the last expiration of any task in the task group". The real
        # queue may add a margin (undocumented); the emulator adds none.
        group.expires = max(group.expires, task.expires)
        group.members[task.task_id] = None

    def leave(self, task: Task) -> None:
        """Forget an expired task."""
        group = self._groups.get(task.task_group_id)
        if group is not None:
            group.members.pop(task.task_id, None)

    def expire(self, now: datetime) -> None:
        """Forget the groups whose ``expires`` has passed: by then all their tasks are gone."""
        for group_id in [g for g, group in self._groups.items() if group.expires <= now]:
            del self._groups[group_id]


def members(state: QueueState, task_group_id: str) -> list[Task]:
    """The group's tasks by taskId in the database's collation, the order in which the real
    queue pages a group."""
    group = state.groups.get(task_group_id)
    return [state.tasks[task_id] for task_id in sorted(group.members, key=sort_key)]


def seal_task_group(state: QueueState, task_group_id: str, now: datetime) -> Outcome:
    """sealTaskGroup: from now on createTask into the group answers 409.

    Sealing again keeps the first ``sealed`` time; like other idempotent repeats it publishes
    ``task-group-sealed`` again (at-least-once delivery)."""
    group = state.groups.get(task_group_id)
    if group.sealed is None:
        group.sealed = now
    return group.to_json(), [msg.task_group_sealed(group)]


def cancel_task_group(state: QueueState, task_group_id: str, now: datetime) -> Outcome:
    """cancelTaskGroup: cancel every unresolved task of a sealed group, as cancelTask does.

    Every task is resolved before any message is composed, as the real queue cancels the whole
    group in one statement: a dependent in the group is canceled, not made pending by a
    dependency canceled before it. Each canceled task's resolution later gives a
    ``task-group-resolved``, as for any resolution (see :meth:`QueueState.resolve_groups`).
    """
    group = state.groups.get(task_group_id)
    if group.sealed is None:
        raise QueueError(
            "RequestConflict",
            f"Task group `{task_group_id}` is not sealed: seal it (sealTaskGroup) before "
            "canceling it.",
            taskGroupId=task_group_id,
        )
    tasks = members(state, task_group_id)
    canceled = [(task, run) for task in tasks if (run := state.cancel_run(task, now)) is not None]
    out = []
    for task, run in canceled:
        out += state.resolved(task, run, now)
    body = {
        "taskGroupId": task_group_id,
        "taskGroupSize": len(tasks),
        "cancelledCount": len(canceled),
        "taskIds": [task.task_id for task, _ in canceled],
    }
    return body, out


def change_task_priority(state: QueueState, task_id: str, priority: str) -> Outcome:
    """changeTaskPriority: a new priority for an unresolved task, for its pending run's place in
    claimWork and for any run it gets later (a running run is unaffected until retried).

    Undocumented, and chosen as the real queue most plausibly behaves: a resolved task answers
    409; the same priority again changes nothing and publishes nothing. The task's definition
    (``queue.task``) shows the new priority, so a createTask retry with the old one conflicts.
    """
    task = state.task(task_id)
    if task.resolved:
        raise QueueError(
            "RequestConflict",
            f"Task `{task_id}` is resolved: only an unresolved task's priority can change.",
            taskId=task_id,
        )
    old = task.priority
    if old == priority:
        return {"status": task.status()}, []
    task.definition["priority"] = priority
    return {"status": task.status()}, [msg.task_priority_changed(task, old)]


def change_task_group_priority(state: QueueState, task_group_id: str, priority: str) -> Outcome:
    """changeTaskGroupPriority: :func:`change_task_priority` for every unresolved task of the
    group whose priority differs (``tasksAffected``: "tasks where priority was changed"), then
    one ``task-group-priority-changed`` summary, even when no task changed; no per-task
    messages."""
    group = state.groups.get(task_group_id)
    changed = [
        t for t in members(state, task_group_id) if not t.resolved and t.priority != priority
    ]
    for task in changed:
        task.definition["priority"] = priority
    body = {
        "taskGroupId": task_group_id,
        "schedulerId": group.scheduler_id,
        "newPriority": priority,
        "tasksAffected": len(changed),
        "taskIds": [task.task_id for task in changed],
    }
    return body, [msg.task_group_priority_changed(group, priority, len(changed))]
