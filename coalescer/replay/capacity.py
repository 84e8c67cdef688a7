"""The worker pools a recorded history shows. Pure.

Each worker seen in the history was there from its first claim to its last resolution: per task
queue, that gives the workers over time (:func:`curves`), which the pool model follows. A task
queue that never ran in the history borrows the workers of the queue its task group used most
(:func:`borrowed`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
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


_FOREVER = 1 << 62

#: A task queue's workers over time: ``(ms, workers from then on)``, by time, from no worker.
Curve = tuple[tuple[int, int], ...]


def curves(runs: Iterable[tuple[str, str, int, int | None]]) -> dict[str, Curve]:
    """Each task queue's workers over time, from its claimed runs ``(task queue, worker,
    started, resolved or None)``: a worker is there from its first claim to its last
    resolution (to the end, if a run of it never resolved)."""
    first: dict[tuple[str, str], int] = {}
    last: dict[tuple[str, str], int] = {}
    for queue, worker, started, resolved in runs:
        at = (queue, worker)
        first[at] = min(first.get(at, started), started)
        last[at] = max(last.get(at, started), _FOREVER if resolved is None else resolved)
    steps: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for at, came in first.items():
        steps[at[0]][came] += 1
        if last[at] != _FOREVER:
            steps[at[0]][last[at]] -= 1
    found: dict[str, Curve] = {}
    for queue, changes in steps.items():
        level, curve = 0, []
        for when in sorted(changes):
            if changes[when]:
                level += changes[when]
                curve.append((when, level))
        found[queue] = tuple(curve)
    return found


def peak(curve: Curve) -> int:
    return max((n for _, n in curve), default=0)
