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
from coalescer.replay import capacity
from coalescer.replay.capacity import Curve


@dataclasses.dataclass(frozen=True, slots=True)
class TaskSpec:
    """One task of a history.

    ``scheduled_ms`` is when the task became (or would become) pending on its own; a task with
    ``dependencies`` becomes pending only once every one of them completed, and not before
    ``scheduled_ms``. ``order`` places it within its coalescing keys (a push id, or its first
    run's scheduled time). ``duration_ms`` is its recorded run time, ``None`` when it never ran
    (the replay then draws one from the same key's runs). ``started_ms``/``resolved_ms`` are
    the recorded run's times when known, for comparing the replay with what happened.
    ``canceled_ms`` is when a person canceled the task (``cancelTask``), 0 if nobody did: the
    replay cancels it then, wherever it stands.

    ``superseded_ms`` is when the history's own superseding (a worker's shim, the enforcer)
    resolved the task for a newer one, ``superseded_by`` (when known): it did no work then,
    and the replay treats it as any task (without superseding, it runs for a drawn duration
    and its dependents are scheduled). ``cascaded_ms`` is when the enforcer canceled the task
    because a task it depends on was superseded (not a person's cancel: it is replayed as a
    dependent of that task). ``real_runs`` are the ``(started, resolved)`` times of
    the runs that executed a command, which size the pools (see
    :mod:`coalescer.replay.runs`).

    ``broken``: the task's push broke its key (a regression, in a synthetic history): every
    run of it fails, or only some when the history gives the task a rate
    (:attr:`History.broken_rates`). Other runs fail when ``outcome`` is ``failed``, or by the
    history's :attr:`History.intermittent` rate and its key's :attr:`History.flaky` rate
    (see :meth:`History.fails`).
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
    superseded_ms: int = 0
    superseded_by: str = ""
    cascaded_ms: int = 0
    real_runs: tuple[tuple[int, int], ...] = ()
    broken: bool = False
    #: The task group it belongs to, when recorded.
    group: str = ""
    #: How long the queue's resolver took to make it pending once its dependencies completed,
    #: as recorded (``None``: not recorded; the history's :attr:`History.resolver_lag_ms`).
    lag_ms: int | None = None
    #: How long its first run waited to be claimed once its worker could claim it: pending
    #: while its worker waited in ``claimWork``, or while the worker resolved its previous
    #: task (``None``: not recorded; :attr:`History.claim_wait_ms` for the first).
    wait_ms: int | None = None
    #: How long its worker took, from claiming the first task of its key it held, to start
    #: its run, as recorded (``None``: not recorded; :attr:`History.hold_ms`).
    hold_ms: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Recorded:
    """What really happened, as far as a recorded history shows: the time the real runs took,
    the tasks that did their work, those superseded, those canceled by the enforcer's cascade
    (a dependency superseded) and by a person, and the span from the first schedule to the last
    resolution."""

    worker_ms: int
    run: int
    superseded: int
    cascaded: int
    canceled: int
    makespan_ms: int

    def to_json(self) -> dict[str, float | int]:
        return {
            "workerHours": self.worker_ms / 3_600_000,
            "run": self.run,
            "superseded": self.superseded,
            "cascaded": self.cascaded,
            "canceled": self.canceled,
            "makespanHours": self.makespan_ms / 3_600_000,
        }


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


def priority_name(rank: int) -> str:
    """The queue's name of a priority rank (``lowest`` for ranks at or below it)."""
    return next((n for n, r in PRIORITIES.items() if r == rank), "lowest")


@dataclasses.dataclass(frozen=True)
class History:
    """Tasks in a replayable order, with what was observed of the pool that ran them."""

    tasks: tuple[TaskSpec, ...]
    #: Workers per task queue: given, or the peak concurrency the history shows.
    workers: Mapping[str, int]
    source: str = "history"
    #: Runs that may have been superseded (canceled, or completed while their worker held
    #: another run of their key) whose link could not be read: no queue, no service given.
    unchecked: int = 0
    #: Probability that a run of a task that is not broken fails (drawn per run, seeded).
    intermittent: float = 0.0
    #: Flaky keys: the probability that a run of a task of that key (its first) fails, on top
    #: of :attr:`intermittent` (drawn per run, from a stream of its own).
    flaky: Mapping[str, float] = dataclasses.field(default_factory=dict)
    #: Broken tasks that fail only some runs (a flaky regression): the probability that a run
    #: fails, by taskId; any other broken task fails every run.
    broken_rates: Mapping[str, float] = dataclasses.field(default_factory=dict)
    #: What the replay chose for the history that a person should know (said on stderr).
    notes: tuple[str, ...] = ()
    #: How long after its last dependency completes a dependent becomes pending: the queue's
    #: dependency resolver, as the history shows it (0 for a synthetic history).
    resolver_lag_ms: int = 0
    #: The task queues whose workers follow the history's (:func:`~coalescer.replay.capacity.
    #: curves`): their workers over time; :attr:`workers` holds their peak.
    curves: Mapping[str, Curve] = dataclasses.field(default_factory=dict)
    #: How each task queue's workers were found: ``given`` (``--workers QUEUE=N``, or by the
    #: synthetic history), ``history`` (its curve), ``peak``, ``default`` (``--workers N``)
    #: or ``borrowed`` (from the queue its task group used most).
    sized: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: How long a task that becomes pending while a worker waits in ``claimWork`` waits to be
    #: claimed: the queue answers a waiting worker at its next poll of the pending tasks (every
    #: second on a real queue), as the history shows it (0 for a synthetic history).
    claim_wait_ms: int = 0
    #: How long a worker shim that holds other tasks of its key takes, from its first claim,
    #: to start the run it executes (it asks the service and claims them first).
    hold_ms: int = 0

    @classmethod
    def build(
        cls,
        tasks: Iterable[TaskSpec],
        *,
        workers: Mapping[str, int] | None = None,
        default_workers: int | None = None,
        source: str = "history",
        unchecked: int = 0,
        intermittent: float = 0.0,
        flaky: Mapping[str, float] | None = None,
        broken_rates: Mapping[str, float] | None = None,
        resolver_lag_ms: int = 0,
        curves: Mapping[str, Curve] | None = None,
        claim_wait_ms: int = 0,
        hold_ms: int = 0,
    ) -> History:
        """Sort ``tasks`` by schedule and fill in the workers of each task queue: ``workers``
        where given, else its ``curves`` (the workers seen over time), else the recorded peak
        concurrency, else ``default_workers``, else the
        workers of the queue its task group used most (:func:`~coalescer.replay.capacity.
        borrowed`), with a note."""
        ordered = tuple(sorted(tasks, key=lambda t: (t.scheduled_ms, t.task_id)))
        if not ordered:
            raise InvalidInput("the history holds no task")
        ids = {t.task_id for t in ordered}
        if len(ids) != len(ordered):
            raise InvalidInput("the history lists a taskId twice")
        peaks = peak_concurrency(ordered)
        pool: dict[str, int] = {}
        sized: dict[str, str] = {}
        follow: dict[str, Curve] = {}
        for queue in sorted({t.task_queue for t in ordered}):
            curve = (curves or {}).get(queue, ())
            for how, given in (
                ("given", (workers or {}).get(queue)),
                ("history", capacity.peak(curve)),
                ("peak", peaks.get(queue)),
                ("default", default_workers),
            ):
                if given:
                    pool[queue], sized[queue] = given, how
                    break
            if sized.get(queue) == "history":
                follow[queue] = curve
        notes = []
        for queue, (count, like) in capacity.borrowed(ordered, pool).items():
            pool[queue], sized[queue] = count, "borrowed"
            notes.append(
                f"task queue {queue!r} never ran in the history: given the {count} workers of "
                f"{like!r}, the queue its task group used most (--workers {queue}=N to change)"
            )
        if unsized := sorted({t.task_queue for t in ordered} - pool.keys()):
            raise InvalidInput(
                f"no worker count for task queue {unsized[0]!r}: the history shows no run "
                "there; give one with --workers QUEUE=N or --workers N"
            )
        return cls(
            ordered,
            pool,
            source,
            unchecked,
            intermittent,
            flaky or {},
            broken_rates or {},
            tuple(notes),
            resolver_lag_ms,
            follow,
            sized,
            claim_wait_ms,
            hold_ms,
        )

    def fails(self, task: TaskSpec, run: int, seed: int = 0) -> bool:
        """Whether the ``run``-th run (from 1) of ``task``'s command fails: recorded failed;
        broken (every run, or by the task's :attr:`broken_rates`); or an intermittent or
        flaky failure. Each draw comes from a stream seeded by ``seed``, the task and the run
        alone, so the same run draws the same whoever runs it and whatever ran before: every
        configuration, and the sheriffs' reference columns, meet the same luck."""
        if task.outcome == "failed":
            return True
        at = f"{seed}/{task.task_id}/{run}"
        if task.broken:
            rate = self.broken_rates.get(task.task_id, 1.0)
            if rate >= 1 or random.Random(at + "/broken").random() < rate:
                return True
        if self.intermittent and random.Random(at).random() < self.intermittent:
            return True
        flake = self.flaky.get(task.keys[0], 0.0) if task.keys else 0.0
        return bool(flake) and random.Random(at + "/flaky").random() < flake

    @property
    def is_recorded(self) -> bool:
        """Whether the history was recorded (it has runs), not drawn: it does not mark which
        pushes broke their key (:attr:`TaskSpec.broken`), only what each run did."""
        return self.recorded_makespan_ms() is not None

    def recorded_makespan_ms(self) -> int | None:
        """From the first schedule to the last recorded resolution, if runs were recorded."""
        ends = [
            end
            for t in self.tasks
            for end in (
                t.resolved_ms,
                t.superseded_ms,
                t.cascaded_ms,
                t.canceled_ms,
                *(r for _, r in t.real_runs),
            )
            if end
        ]
        if not ends:
            return None
        return max(ends) - self.tasks[0].scheduled_ms

    def recorded(self) -> Recorded | None:
        """What really happened, if the history recorded runs (a synthetic one did not)."""
        makespan = self.recorded_makespan_ms()
        if makespan is None:
            return None
        return Recorded(
            worker_ms=sum(end - start for t in self.tasks for start, end in t.real_runs),
            run=sum(1 for t in self.tasks if t.resolved_ms),
            superseded=sum(1 for t in self.tasks if t.superseded_ms),
            cascaded=sum(1 for t in self.tasks if t.cascaded_ms),
            canceled=sum(1 for t in self.tasks if t.canceled_ms),
            makespan_ms=makespan,
        )


def peak_concurrency(tasks: Sequence[TaskSpec]) -> dict[str, int]:
    """Per task queue, the most real runs (runs that executed a command) the recorded times show
    at one moment: a run held by the superseding side took no worker of the pool."""
    edges: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for t in tasks:
        for started, resolved in t.real_runs:
            if resolved >= started:
                edges[t.task_queue] += [(started, 1), (resolved, -1)]
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
