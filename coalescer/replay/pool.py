"""The pool model: a history's tasks meet a modelled worker pool, on the history's clock.

Tasks become pending at their scheduled times (a dependent once every dependency completed).
Each task queue has N workers; an idle worker claims the highest-priority, then
longest-pending task, as the queue's ``claimWork`` does. A run takes the task's recorded
duration. With superseding on, a worker that claimed a task with a coalescing key asks the
index (:class:`Index`) as the worker shim does, claims every listed task that is still pending
on its task queue with the same keys, runs the newest one it holds (the primary) and resolves
the others superseded when the primary ends. Under a policy, the index decides on arrival
instead, and each pending victim is resolved superseded at once. A superseded task's dependents
are never scheduled, as on a queue whose tasks require ``all-completed``.

The model is pure apart from :class:`Index`, which it awaits, and never reads the wall clock.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Protocol

from coalescer.replay.history import Durations, History, TaskSpec


class State(enum.IntEnum):
    WAITING = 0  # dependencies not all completed (never scheduled, if it stays so)
    PENDING = 1
    RUNNING = 2  # a primary, on a worker
    HELD = 3  # a secondary, claimed while its primary runs
    COMPLETED = 4
    FAILED = 5
    SUPERSEDED = 6
    DEADLINE = 7  # resolved exception/deadline-exceeded while pending


RESOLVED = frozenset({State.COMPLETED, State.FAILED, State.SUPERSEDED, State.DEADLINE})


class Index(Protocol):
    """The superseder as a worker sees it: told every task transition, asked on each claim
    (when ``asks_on_claim``), and deciding on arrival (a policy)."""

    asks_on_claim: bool

    def record(self, task: TaskSpec, state: str, at_ms: int, since_ms: int, reason: str) -> None:
        """A task event, in the order they happen (``since_ms``: when it became pending)."""

    async def ask(self, task: TaskSpec, now_ms: int) -> list[str]:
        """The ``supersedes`` list for ``task`` (oldest first, ``task`` included)."""

    async def decisions(self, now_ms: int) -> list[tuple[str, str]]:
        """``(victim, primary)`` decided on arrival since the last call (a policy's)."""


@dataclasses.dataclass(slots=True)
class Outcome:
    """What the replay made of each task (lists indexed like ``History.tasks``)."""

    state: list[State]
    pending_ms: list[int]  # when it became pending (-1: never)
    left_ms: list[int]  # when it stopped being pending: claimed, held or resolved (-1: never)
    resolved_ms: list[int]  # when it resolved (-1: never)
    by: list[int]  # the primary that superseded it (-1: none)
    worker_ms: int = 0  # time the workers spent running tasks
    #: ``(time_ms, pending tasks)`` after every instant the backlog changed.
    backlog: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    asked: int = 0
    #: Decisions on arrival whose victim was no longer pending.
    missed: int = 0


# Event kinds, in the order they are handled at one instant: runs end (freeing workers and
# scheduling dependents), then tasks arrive; then decisions on arrival are carried out, and
# idle workers claim.
_FINISH, _ARRIVE = 0, 1


class Pool:
    """One replay of ``history`` against its worker pool; ``index`` is ``None`` to model no
    superseding at all. ``progress`` is called with the number of tasks newly resolved."""

    def __init__(
        self,
        history: History,
        index: Index | None,
        *,
        seed: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.history = history
        self.tasks = history.tasks
        self.index = index
        self.durations = Durations(self.tasks, seed)
        self.progress = progress or (lambda n: None)
        n = len(self.tasks)
        self.pos = {t.task_id: i for i, t in enumerate(self.tasks)}
        self.out = Outcome(
            state=[State.WAITING] * n,
            pending_ms=[-1] * n,
            left_ms=[-1] * n,
            resolved_ms=[-1] * n,
            by=[-1] * n,
        )
        self.dependents: dict[int, list[int]] = defaultdict(list)
        self.blocked = [0] * n
        for i, t in enumerate(self.tasks):
            for dep in t.dependencies:
                if (j := self.pos.get(dep)) is not None:  # one outside the history is done
                    self.dependents[j].append(i)
                    self.blocked[i] += 1
        self.idle = dict(history.workers)
        self.queues: dict[str, list[tuple[int, int, int, int]]] = {q: [] for q in self.idle}
        self.events: list[tuple[int, int, int, object]] = []
        self.seq = 0
        self.pending = 0

    async def run(self) -> Outcome:
        for i, t in enumerate(self.tasks):
            if not self.blocked[i]:
                self._at(t.scheduled_ms, _ARRIVE, i)
        events = self.events
        while events:
            now = events[0][0]
            while events and events[0][0] == now:
                _, kind, _, arg = heapq.heappop(events)
                if kind == _FINISH:
                    self._finish(now, *arg)  # type: ignore[misc]
                else:
                    self._pending(now, arg)  # type: ignore[arg-type]
            if self.index is not None:
                for victim, primary in await self.index.decisions(now):
                    self._supersede_pending(now, self.pos[victim], self.pos[primary])
            await self._dispatch(now)
            self._sample(now)
        self.progress(sum(1 for s in self.out.state if s not in RESOLVED))  # never resolved
        return self.out

    # -- the pieces ---------------------------------------------------------------------
    def _at(self, when: int, kind: int, arg: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, kind, self.seq, arg))

    def _sample(self, now: int) -> None:
        backlog = self.out.backlog
        if not backlog or backlog[-1][1] != self.pending:
            backlog.append((now, self.pending))

    def _record(self, i: int, state: str, now: int, reason: str = "") -> None:
        task = self.tasks[i]
        if self.index is not None and task.keys:
            self.index.record(task, state, now, self.out.pending_ms[i], reason)

    def _pending(self, now: int, i: int) -> None:
        task = self.tasks[i]
        self.out.state[i] = State.PENDING
        self.out.pending_ms[i] = now
        self.seq += 1
        heapq.heappush(self.queues[task.task_queue], (-task.priority, now, self.seq, i))
        self.pending += 1
        self._record(i, "pending", now)

    def _leave(self, i: int, state: State, now: int) -> None:
        self.out.state[i] = state
        self.out.left_ms[i] = now
        self.pending -= 1

    def _resolve(self, i: int, state: State, now: int, by: int = -1) -> None:
        self.out.state[i] = state
        self.out.resolved_ms[i] = now
        self.out.by[i] = by
        self.progress(1)

    def _supersede_pending(self, now: int, victim: int, primary: int) -> None:
        """A decision on arrival: the enforcer claims the pending victim and resolves it."""
        if self.out.state[victim] != State.PENDING:
            self.out.missed += 1  # a worker claimed it first
            return
        self._leave(victim, State.SUPERSEDED, now)
        self._resolve(victim, State.SUPERSEDED, now, by=primary)
        self._record(victim, "exception", now, "superseded")

    async def _dispatch(self, now: int) -> None:
        for queue, heap in self.queues.items():
            while heap and self.idle[queue]:
                i = heapq.heappop(heap)[3]
                if self.out.state[i] != State.PENDING:
                    continue  # claimed as a secondary meanwhile
                if self.tasks[i].deadline_ms <= now:
                    self._leave(i, State.DEADLINE, now)
                    self._resolve(i, State.DEADLINE, now)
                    self._record(i, "exception", now, "deadline-exceeded")
                    continue
                self.idle[queue] -= 1
                await self._claim(i, now)

    async def _claim(self, i: int, now: int) -> None:
        task = self.tasks[i]
        self._leave(i, State.RUNNING, now)
        self._record(i, "running", now)
        held = [i]
        if self.index is not None and self.index.asks_on_claim and task.keys:
            answer = await self.index.ask(task, now)
            self.out.asked += 1
            if task.task_id not in answer:  # unusable, as the shim judges it: run alone
                answer = [task.task_id]
            held = []
            for task_id in answer:
                j = self.pos.get(task_id, -1)
                if j == i:
                    held.append(i)
                elif j >= 0 and self._claimable(j, task, now):
                    self._leave(j, State.HELD, now)
                    self._record(j, "running", now)
                    held.append(j)
        primary, secondaries = held[-1], held[:-1]
        if primary != i:
            self.out.state[i], self.out.state[primary] = State.HELD, State.RUNNING
        duration = self.durations.of(self.tasks[primary])
        self.out.worker_ms += duration
        self._at(now + duration, _FINISH, (primary, tuple(secondaries)))

    def _claimable(self, j: int, initial: TaskSpec, now: int) -> bool:
        other = self.tasks[j]
        return (
            self.out.state[j] == State.PENDING
            and other.task_queue == initial.task_queue
            and set(other.keys) == set(initial.keys)
            and other.deadline_ms > now
        )

    def _finish(self, now: int, primary: int, secondaries: Sequence[int]) -> None:
        task = self.tasks[primary]
        self.idle[task.task_queue] += 1
        state = State.FAILED if task.outcome == "failed" else State.COMPLETED
        self._resolve(primary, state, now)
        self._record(primary, state.name.lower(), now)
        for j in secondaries:
            self._resolve(j, State.SUPERSEDED, now, by=primary)
            self._record(j, "exception", now, "superseded")
        if state == State.COMPLETED:
            for d in self.dependents.get(primary, ()):
                self.blocked[d] -= 1
                if not self.blocked[d]:
                    self._at(max(now, self.tasks[d].scheduled_ms), _ARRIVE, d)
