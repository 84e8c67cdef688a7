"""Task groups and priorities: the pure transitions of sealTaskGroup, cancelTaskGroup,
changeTaskPriority and changeTaskGroupPriority.

A group comes into being with its first task (see :mod:`coalescer.emulator.registry`). Once
sealed it refuses new tasks, and only then can it be canceled. Like
:mod:`coalescer.emulator.claims`, the transitions are plain functions on a
:class:`~coalescer.emulator.state.QueueState` returning ``(response body, messages to
publish)``.
"""

from __future__ import annotations

from datetime import datetime

from coalescer.emulator import messages as msg
from coalescer.emulator.clock import format_time
from coalescer.emulator.collation import sort_key
from coalescer.emulator.model import QueueError, Task
from coalescer.emulator.state import Outcome, QueueState


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
    dependency canceled before it. The dependency resolver later handles each canceled task's
    resolution as any other (see :meth:`QueueState.resolve_dependencies`): the group is found
    resolved once the last of them is marked ever-resolved.
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


def change_task_priority(state: QueueState, task_id: str, priority: str, now: datetime) -> Outcome:
    """changeTaskPriority: a new priority for a task the queue has never resolved, for its
    pending run's place in claimWork and for any run it gets later (a running run is unaffected
    until retried).

    As release 106's queue answers (measured on it): past its deadline, 409 saying so; then 409
    "already resolved" when the task is marked ever-resolved (by the dependency resolver, some
    seconds after any resolution: a task rerun since, pending again, stays refused; one resolved
    but not yet handled is still changed) or already has that priority (the same wording: the
    queue refuses whatever it did not update). Else the definition (``queue.task``) shows the
    new priority, so a createTask retry with the old one conflicts, and ``task-priority-changed``
    is published.
    """
    task = state.task(task_id)
    if task.deadline <= now:
        raise QueueError(
            "RequestConflict",
            f"Task `{task_id}` can't be reprioritized past its deadline of "
            f"{format_time(task.deadline)}.",
            taskId=task_id,
            deadline=format_time(task.deadline),
        )
    old = task.priority
    if task.ever_resolved or old == priority:
        raise QueueError(
            "RequestConflict",
            f"Task `{task_id}` is already resolved and cannot be reprioritized.",
            taskId=task_id,
        )
    task.definition["priority"] = priority
    return {"status": task.status()}, [msg.task_priority_changed(task, old)]


def change_task_group_priority(
    state: QueueState, task_group_id: str, priority: str, now: datetime
) -> Outcome:
    """changeTaskGroupPriority: :func:`change_task_priority` for every task of the group it
    would change (never ever-resolved, before its deadline, of another priority:
    ``tasksAffected``, "tasks where priority was changed"), then one
    ``task-group-priority-changed`` summary, even when no task changed; no per-task messages."""
    group = state.groups.get(task_group_id)
    changed = [
        t
        for t in members(state, task_group_id)
        if not t.ever_resolved and now < t.deadline and t.priority != priority
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
