"""The task-group registry: every task joins its group when it is created.

A group comes into being with its first task, takes that task's ``schedulerId`` (every later
task must have the same), and lives until its last task expires. Once sealed it refuses new
tasks. The transitions on groups (sealing, canceling, priorities) are in
:mod:`coalescer.emulator.groups`, above :mod:`coalescer.emulator.state`, which holds this
registry.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from coalescer.emulator.model import QueueError, Task, TaskGroup


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
        """RequestConflict, worded as the real queue's, when a task with this (completed)
        definition cannot join its group: the group holds another scheduler's tasks, or is
        sealed.

        The real queue ensures the group before it looks for an existing task, so this refuses
        an identical retry of createTask into a sealed group too."""
        group_id, scheduler_id = definition["taskGroupId"], definition["schedulerId"]
        group = self._groups.get(group_id)
        if group is None:
            return
        if group.scheduler_id != scheduler_id:
            raise QueueError(
                "RequestConflict",
                f"Task group `{group_id}` contains tasks with a schedulerId other\n"
                f"than `{scheduler_id}`. All tasks in the same task-group must have\n"
                "the same schedulerId.",
                taskGroupId=group_id,
                schedulerId=scheduler_id,
            )
        if group.sealed is not None:
            raise QueueError(
                "RequestConflict",
                f"Task group `{group_id}` is sealed and does not accept new tasks.",
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
        group.never_resolved += 1

    def mark_ever_resolved(self, task: Task) -> None:
        """Set the task's ``ever_resolved`` mark (once and for all), as the real queue's
        dependency resolver does for every resolution it handles."""
        if task.ever_resolved:
            return
        task.ever_resolved = True
        group = self._groups.get(task.task_group_id)
        if group is not None and task.task_id in group.members:
            group.never_resolved -= 1

    def leave(self, task: Task) -> None:
        """Forget an expired task."""
        group = self._groups.get(task.task_group_id)
        if group is None or task.task_id not in group.members:
            return
        del group.members[task.task_id]
        if not task.ever_resolved:
            group.never_resolved -= 1

    def expire(self, now: datetime) -> None:
        """Forget the groups whose ``expires`` has passed: by then all their tasks are gone."""
        for group_id in [g for g, group in self._groups.items() if group.expires <= now]:
            del self._groups[group_id]
