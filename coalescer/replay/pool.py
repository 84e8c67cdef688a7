"""The pool model: a history's tasks meet a modelled worker pool, on the history's clock.

Tasks become pending at their scheduled times (a dependent once every dependency completed).
Each task queue has N workers; an idle worker claims the highest-priority, then
longest-pending task, as the queue's ``claimWork`` does, and workers idle at the same instant
all get their tasks before any of them asks the index. A run takes the task's recorded
duration. With superseding on, a worker that claimed a task with a coalescing key asks the
index (:class:`Index`) as the worker shim does, claims every listed task that is still pending
on its task queue with the same keys, runs the newest one it holds (the primary) and resolves
the others superseded when the primary ends. Under a policy, the index decides on arrival for
the keys whose rule says so, and carries its decisions out on the pool as the enforcer does on a
queue, through the queue-like operations of :class:`Pool` (:meth:`Pool.supersede`,
:meth:`Pool.hold`, :meth:`Pool.release`, :meth:`Pool.cancel`). A superseded task's dependents
are never scheduled, as on a queue whose tasks require ``all-completed``.

Each task has runs, as on the queue: a victim released by the enforcer, or a worker's secondary
released when its primary is canceled, resolves ``exception/worker-shutdown`` and is pending
again with a new run.

The model is pure apart from :class:`Index`, which it awaits, and never reads the wall clock.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections import defaultdict
from collections.abc import Callable
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
    CANCELED = 8  # a running victim of a policy, canceled (superseded while running)
    WITHDRAWN = 9  # canceled as the history records it (cancelTask, not superseding)


RESOLVED = frozenset(
    {
        State.COMPLETED,
        State.FAILED,
        State.SUPERSEDED,
        State.DEADLINE,
        State.CANCELED,
        State.WITHDRAWN,
    }
)
#: Superseded, pending or running: resolved for another task, which ``by`` names.
REPLACED = frozenset({State.SUPERSEDED, State.CANCELED})

#: Where a task stands, as the enforcer sees it on the queue (:meth:`Pool.where`).
WAITING, PENDING, HELD_BY_ENFORCER, RUNNING, RESOLVED_BY_ENFORCER, GONE = (
    "waiting",
    "pending",
    "ours",
    "running",
    "resolved-by-us",
    "gone",
)


class Index(Protocol):
    """The superseder as a worker sees it: told every task transition, asked on each claim
    of a task whose key supersedes on claim, and deciding on arrival (a policy)."""

    def asks(self, task: TaskSpec) -> bool:
        """Whether a worker that claimed ``task`` asks the index (its key is ``on-claim``)."""

    def record(
        self, task: TaskSpec, run: int, state: str, at_ms: int, since_ms: int, reason: str
    ) -> None:
        """A task event, in the order they happen (``since_ms``: when the run became
        pending)."""

    async def ask(self, task: TaskSpec, now_ms: int) -> list[str]:
        """The ``supersedes`` list for ``task`` (oldest first, ``task`` included)."""

    async def enforce(self, pool: Pool, now_ms: int) -> None:
        """Carry out on ``pool`` the decisions taken on arrival since the last call."""


@dataclasses.dataclass(slots=True)
class Outcome:
    """What the replay made of each task (lists indexed like ``History.tasks``)."""

    state: list[State]
    pending_ms: list[int]  # when it became pending (-1: never)
    left_ms: list[int]  # when it stopped being pending: claimed, held or resolved (-1: never)
    resolved_ms: list[int]  # when it resolved (-1: never)
    by: list[int]  # the primary that superseded it (-1: none)
    #: Time the workers spent running each task (a canceled run counts until canceled).
    worked_ms: list[int]
    #: Runs each task had (a released task gets a new run).
    runs: list[int]
    worker_ms: int = 0  # time the workers spent running tasks
    #: ``(time_ms, pending tasks)`` after every instant the backlog changed.
    backlog: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    asked: int = 0
    #: Decisions on arrival whose victim a worker had claimed first (left to run).
    missed: int = 0
    #: Victims released (their primary failed) or secondaries released (their primary was
    #: canceled): each ran again in a new run.
    released: int = 0


# Event kinds, in the order they are handled at one instant: runs end (freeing workers and
# scheduling dependents), then tasks arrive, then the history's cancellations; then decisions
# on arrival are carried out (and the decisions those lead to), and idle workers claim.
_FINISH, _ARRIVE, _WITHDRAW = 0, 1, 2


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
            worked_ms=[0] * n,
            runs=[0] * n,
        )
        self.dependents: dict[int, list[int]] = defaultdict(list)
        self.blocked = [0] * n
        for i, t in enumerate(self.tasks):
            for dep in t.dependencies:
                if (j := self.pos.get(dep)) is not None:  # one outside the history is done
                    self.dependents[j].append(i)
                    self.blocked[i] += 1
        self.idle = dict(history.workers)
        self.queues: dict[str, list[tuple[int, int, int, int, int]]] = {q: [] for q in self.idle}
        self.events: list[tuple[int, int, int, object]] = []
        self.seq = 0
        self.pending = 0
        #: A running primary's end: ``(finish_ms, secondaries)``; canceled runs are removed.
        self.running: dict[int, tuple[int, list[int]]] = {}
        #: A worker's secondary -> its primary; the enforcer's held victims.
        self.secondary_of: dict[int, int] = {}
        self.enforcer_holds: set[int] = set()
        self.by_enforcer: set[int] = set()
        self.since = [-1] * n  # when each task's current run became pending

    async def run(self) -> Outcome:
        for i, t in enumerate(self.tasks):
            if not self.blocked[i]:
                self._at(t.scheduled_ms, _ARRIVE, i)
            if t.canceled_ms:
                self._at(t.canceled_ms, _WITHDRAW, i)
        events = self.events
        while events:
            now = events[0][0]
            while events and events[0][0] == now:
                _, kind, _, arg = heapq.heappop(events)
                if kind == _FINISH:
                    self._finish(now, *arg)  # type: ignore[misc]
                elif kind == _WITHDRAW:
                    self._withdraw(now, arg)  # type: ignore[arg-type]
                elif self.out.state[arg] == State.WAITING:  # type: ignore[call-overload]
                    self._pending(now, arg)  # type: ignore[arg-type]
            if self.index is not None:
                await self.index.enforce(self, now)
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
            self.index.record(task, self.out.runs[i] - 1, state, now, self.since[i], reason)

    def _pending(self, now: int, i: int) -> None:
        task = self.tasks[i]
        self.out.state[i] = State.PENDING
        if self.out.pending_ms[i] < 0:
            self.out.pending_ms[i] = now
        self.since[i] = now
        self.out.runs[i] += 1
        self.seq += 1
        heapq.heappush(
            self.queues[task.task_queue], (-task.priority, now, self.seq, i, self.out.runs[i])
        )
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

    # -- the queue's side of a policy's decisions (see coalescer.replay.enforcing) --------
    def where(self, i: int) -> str:
        """Where task ``i`` stands for the enforcer: ``waiting`` (never pending yet),
        ``pending``, ``ours`` (held by the enforcer), ``running`` (on a worker, as its primary
        or a secondary), ``resolved-by-us`` or ``gone`` (resolved otherwise)."""
        state = self.out.state[i]
        if state == State.WAITING:
            return WAITING
        if state == State.PENDING:
            return PENDING
        if i in self.enforcer_holds:
            return HELD_BY_ENFORCER
        if state in (State.RUNNING, State.HELD):
            return RUNNING
        return RESOLVED_BY_ENFORCER if i in self.by_enforcer else GONE

    def started_ms(self, i: int) -> int:
        """When task ``i``'s current run was claimed."""
        return self.out.left_ms[i]

    def supersede(self, i: int, primary: int, now: int) -> None:
        """Resolve a pending or enforcer-held task superseded by ``primary``."""
        if self.out.state[i] == State.PENDING:
            self._leave(i, State.SUPERSEDED, now)
        self.enforcer_holds.discard(i)
        self.by_enforcer.add(i)
        self._resolve(i, State.SUPERSEDED, now, by=primary)
        self._record(i, "exception", now, "superseded")

    def hold(self, i: int, now: int) -> None:
        """The enforcer claims a pending task and holds it (``on-primary-failure: release``)."""
        self._leave(i, State.HELD, now)
        self.enforcer_holds.add(i)
        self._record(i, "running", now)

    def release(self, i: int, now: int) -> None:
        """The enforcer gives a held task back: its run resolves ``worker-shutdown`` and it is
        pending again, in a new run."""
        self.enforcer_holds.discard(i)
        self._rerun(i, now)

    def cancel(self, i: int, primary: int, now: int, state: State = State.CANCELED) -> None:
        """``cancelTask`` on a task running on a worker. A canceled primary's worker stops at
        once and releases its secondaries (they run again); a canceled secondary is dropped
        by its worker."""
        if i in self.running:
            finish, secondaries = self.running.pop(i)
            task = self.tasks[i]
            self.idle[task.task_queue] += 1
            self.out.worker_ms -= finish - now
            self.out.worked_ms[i] -= finish - now
            for j in secondaries:
                if self.secondary_of.get(j) == i:
                    del self.secondary_of[j]
                    self._rerun(j, now)
        self.secondary_of.pop(i, None)
        self.by_enforcer.add(i)
        self._resolve(i, state, now, by=primary)
        self._record(i, "exception", now, "canceled")

    def _withdraw(self, now: int, i: int) -> None:
        """A cancellation the history records, at its recorded time, wherever the task stands
        in the replay: never scheduled, pending, held or running (its worker stops). A task
        the replay already resolved is left as it is."""
        state = self.out.state[i]
        if state in RESOLVED:
            return
        if state == State.WAITING:
            self._resolve(i, State.WITHDRAWN, now)  # its dependencies' end schedules nothing
            return
        if state == State.PENDING:
            self._leave(i, State.WITHDRAWN, now)
        self.enforcer_holds.discard(i)
        self.cancel(i, -1, now, State.WITHDRAWN)
        self.by_enforcer.discard(i)

    def unresolved_dependents(self, i: int) -> tuple[str, ...]:
        """Every unresolved task depending on ``i``, transitively (a cascade's victims; they
        are never scheduled here, as the queue never schedules them either way)."""
        found: list[str] = []
        seen = {i}
        todo = [i]
        while todo:
            for d in self.dependents.get(todo.pop(), ()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
                    if self.out.state[d] not in RESOLVED:
                        found.append(self.tasks[d].task_id)
        return tuple(found)

    def _rerun(self, i: int, now: int) -> None:
        self._record(i, "exception", now, "worker-shutdown")
        self.out.released += 1
        self._pending(now, i)

    async def _dispatch(self, now: int) -> None:
        # Every idle worker of a queue gets its task at once, as workers waiting in
        # ``claimWork`` do when tasks arrive; only then does each ask about its task's key. Two
        # workers that claimed tasks of one key at the same moment each run one of them: the
        # first to ask holds whatever its answer lists that is still pending, the second finds
        # only its own task.
        claimed: list[int] = []
        for queue, heap in self.queues.items():
            while heap and self.idle[queue]:
                *_, i, run = heapq.heappop(heap)
                if self.out.state[i] != State.PENDING or self.out.runs[i] != run:
                    continue  # claimed as a secondary or superseded meanwhile, or rerun
                if self.tasks[i].deadline_ms <= now:
                    self._leave(i, State.DEADLINE, now)
                    self._resolve(i, State.DEADLINE, now)
                    self._record(i, "exception", now, "deadline-exceeded")
                    continue
                self.idle[queue] -= 1
                self._leave(i, State.RUNNING, now)
                self._record(i, "running", now)
                claimed.append(i)
        for i in claimed:
            await self._claim(i, now)

    async def _claim(self, i: int, now: int) -> None:
        """A worker that claimed task ``i`` asks (when its key supersedes on claim), holds what
        it can of the answer and runs the newest it holds."""
        task = self.tasks[i]
        held = [i]
        if self.index is not None and task.keys and self.index.asks(task):
            answer = await self.index.ask(task, now)
            self.out.asked += 1
            if task.task_id not in answer:  # unusable, as the shim judges it: run alone
                answer = [task.task_id]
            if self.out.runs[i] > 1:  # given back before: the shim claims nothing newer
                answer = answer[: answer.index(task.task_id) + 1]
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
        self.out.worked_ms[primary] += duration
        self.running[primary] = (now + duration, secondaries)
        for j in secondaries:
            self.secondary_of[j] = primary
        self._at(now + duration, _FINISH, (primary, self.out.runs[primary]))

    def _claimable(self, j: int, initial: TaskSpec, now: int) -> bool:
        other = self.tasks[j]
        return (
            self.out.state[j] == State.PENDING
            and self.out.runs[j] == 1  # one given back (released) runs itself, as the shim has it
            and other.task_queue == initial.task_queue
            and set(other.keys) == set(initial.keys)
            and other.deadline_ms > now
        )

    def _finish(self, now: int, primary: int, run: int) -> None:
        if primary not in self.running or self.out.runs[primary] != run:
            return  # canceled meanwhile: its worker stopped then
        _, secondaries = self.running.pop(primary)
        task = self.tasks[primary]
        self.idle[task.task_queue] += 1
        state = State.FAILED if task.outcome == "failed" else State.COMPLETED
        self._resolve(primary, state, now)
        self._record(primary, state.name.lower(), now)
        for j in secondaries:
            if self.secondary_of.get(j) != primary:
                continue  # canceled by a policy meanwhile
            del self.secondary_of[j]
            self._resolve(j, State.SUPERSEDED, now, by=primary)
            self._record(j, "exception", now, "superseded")
        if state == State.COMPLETED:
            for d in self.dependents.get(primary, ()):
                self.blocked[d] -= 1
                if not self.blocked[d]:
                    self._at(max(now, self.tasks[d].scheduled_ms), _ARRIVE, d)
