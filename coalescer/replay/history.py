"""A task history to replay: what each task was, when it was scheduled, how long it ran. Pure.

Every source (:mod:`~coalescer.replay.synthetic`, :mod:`~coalescer.replay.sources`) produces a
:class:`History`. Times are milliseconds on the history's own clock; the replay never reads the
wall clock.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from coalescer.errors import InvalidInput


@dataclasses.dataclass(frozen=True, slots=True)
class TaskSpec:
    """One task of a history.

    ``scheduled_ms`` is when the task became (or would become) pending on its own; a task with
    ``dependencies`` becomes pending only once every one of them completed, and not before
    ``scheduled_ms``. ``order`` places it within its coalescing keys (a push id, or its first
    run's scheduled time). ``duration_ms`` is its recorded run time, ``None`` when it never ran
    (the replay then draws one from the same key's runs). ``started_ms``/``resolved_ms`` are
    the recorded run's times when known, for comparing the replay with what happened.
    ``canceled_ms`` is when the history canceled the task (``cancelTask``), 0 if it did not:
    the replay cancels it then, wherever it stands.
    """

    task_id: str
    task_queue: str
    keys: tuple[str, ...]
    order: float
    scheduled_ms: int
    deadline_ms: int
    priority: int = 0
    dependencies: tuple[str, ...] = ()
    duration_ms: int | None = None
    outcome: str = "completed"
    started_ms: int = 0
    resolved_ms: int = 0
    canceled_ms: int = 0


#: Taskcluster's priorities as numbers the pool model compares, highest first (``normal`` is
#: an old name of ``lowest``).
PRIORITIES = {
    "highest": 7,
    "very-high": 6,
    "high": 5,
    "medium": 4,
    "low": 3,
    "very-low": 2,
    "lowest": 1,
    "normal": 1,
}


def priority_rank(name: str) -> int:
    try:
        return PRIORITIES[name]
    except KeyError:
        raise InvalidInput(f"unknown task priority {name!r}") from None


@dataclasses.dataclass(frozen=True)
class History:
    """Tasks in a replayable order, with what was observed of the pool that ran them."""

    tasks: tuple[TaskSpec, ...]
    #: Workers per task queue: given, or the peak concurrency the history shows.
    workers: Mapping[str, int]
    source: str = "history"

    @classmethod
    def build(
        cls,
        tasks: Iterable[TaskSpec],
        *,
        workers: Mapping[str, int] | None = None,
        default_workers: int | None = None,
        source: str = "history",
    ) -> History:
        """Sort ``tasks`` by schedule and fill in the workers of each task queue: ``workers``
        where given, else the recorded peak concurrency, else ``default_workers``."""
        ordered = tuple(sorted(tasks, key=lambda t: (t.scheduled_ms, t.task_id)))
        if not ordered:
            raise InvalidInput("the history holds no task")
        ids = {t.task_id for t in ordered}
        if len(ids) != len(ordered):
            raise InvalidInput("the history lists a taskId twice")
        peaks = peak_concurrency(ordered)
        pool: dict[str, int] = {}
        for queue in sorted({t.task_queue for t in ordered}):
            given = (workers or {}).get(queue) or peaks.get(queue) or default_workers
            if not given:
                raise InvalidInput(
                    f"no worker count for task queue {queue!r}: the history shows no run "
                    "there; give one with --workers QUEUE=N or --workers N"
                )
            pool[queue] = given
        return cls(ordered, pool, source)

    def recorded_makespan_ms(self) -> int | None:
        """From the first schedule to the last recorded resolution, if runs were recorded."""
        ends = [t.resolved_ms for t in self.tasks if t.resolved_ms]
        if not ends:
            return None
        return max(ends) - self.tasks[0].scheduled_ms


def peak_concurrency(tasks: Sequence[TaskSpec]) -> dict[str, int]:
    """Per task queue, the most runs the recorded times show at one moment."""
    edges: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for t in tasks:
        if t.started_ms and t.resolved_ms >= t.started_ms:
            edges[t.task_queue] += [(t.started_ms, 1), (t.resolved_ms, -1)]
    peaks: dict[str, int] = {}
    for queue, points in edges.items():
        running = peak = 0
        for _, step in sorted(points):  # an end before a start at the same instant
            running += step
            peak = max(peak, running)
        peaks[queue] = peak
    return peaks


class Durations:
    """Run durations for tasks that never ran: drawn from the recorded runs of the same key
    (else the same task queue, else every run), with a seeded RNG."""

    def __init__(self, tasks: Sequence[TaskSpec], seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._by: dict[str, list[int]] = defaultdict(list)
        everything: list[int] = []
        for t in tasks:
            if t.duration_ms is not None:
                for name in (*t.keys, "queue:" + t.task_queue):
                    self._by[name].append(t.duration_ms)
                everything.append(t.duration_ms)
        self._all = everything

    def of(self, task: TaskSpec) -> int:
        if task.duration_ms is not None:
            return task.duration_ms
        for name in (*task.keys, "queue:" + task.task_queue):
            if runs := self._by.get(name):
                return self._rng.choice(runs)
        if self._all:
            return self._rng.choice(self._all)
        raise InvalidInput(f"task {task.task_id} never ran and no run gives it a duration")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank, ``None`` when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
