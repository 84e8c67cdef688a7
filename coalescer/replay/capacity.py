"""The worker pools a recorded history shows. Pure.

A task queue that never ran in the history borrows the workers of the queue its task group used
most (:func:`borrowed`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Protocol


class Task(Protocol):
    """What sizing a pool reads of a task (:class:`~coalescer.replay.history.TaskSpec`)."""

    @property
    def task_queue(self) -> str: ...

    @property
    def group(self) -> str: ...


def borrowed(tasks: Sequence[Task], sized: Mapping[str, int]) -> dict[str, tuple[int, str]]:
    """For each task queue of ``tasks`` that ``sized`` leaves out: the workers of the sized
    queue with the most tasks in the task groups of its own tasks, and that queue's name (ties:
    the first name). A queue whose groups ran nowhere else is left out."""
    groups: dict[str, set[str]] = defaultdict(set)
    for t in tasks:
        if t.group:
            groups[t.task_queue].add(t.group)
    found: dict[str, tuple[int, str]] = {}
    for queue in sorted({t.task_queue for t in tasks} - sized.keys()):
        used = Counter(
            t.task_queue for t in tasks if t.group in groups[queue] and t.task_queue in sized
        )
        if used:
            like = min(used, key=lambda q: (-used[q], q))
            found[queue] = (sized[like], like)
    return found
