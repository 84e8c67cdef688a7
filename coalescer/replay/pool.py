"""The pool model: a history's tasks meet a modelled worker pool, on the history's clock.

Tasks become pending at their scheduled times (a dependent once every dependency completed,
after the history's resolver lag).
Each task queue has N workers; an idle worker claims the highest-priority, then
longest-pending task, as the queue's ``claimWork`` does, and workers idle at the same instant
all get their tasks before any of them asks the index. A run takes the task's recorded
duration. With superseding on, a worker that claimed a task with a coalescing key asks the
index (:class:`Index`) as the worker shim does, claims every listed task that is still pending
on its task queue with the same keys, runs the newest one it holds (the primary) and resolves
the others superseded when the primary ends. Under a policy, the index decides on arrival for
the keys whose rule says so, and carries its decisions out on the pool as the enforcer does on a
queue, through the queue-like operations of :class:`Pool` (:meth:`Pool.supersede`,
:meth:`Pool.hold`, :meth:`Pool.release`, :meth:`Pool.cancel`, :meth:`Pool.rerun`). A superseded task's dependents
are never scheduled, as on a queue whose tasks require ``all-completed``.

Each task has runs, as on the queue: a victim released by the enforcer, or a worker's secondary
released when its primary is canceled, resolves ``exception/worker-shutdown`` and is pending
again with a new run.

A run fails when its task is broken (a regression, every run or a flaky regression's share of
them), was recorded failed, or by the history's intermittent rate and its key's flake rate,
drawn per run from seeded streams of their own (the same task's ``k``-th run draws the same in
every configuration: :meth:`History.fails <coalescer.replay.history.History.fails>`). When a worker's primary fails, its secondaries follow
the worker's ``on_failure`` (``--on-primary-failure``): ``supersede`` (superseded by the failed
primary), ``release`` (each runs itself, in a new run) or ``bisect``: the worker keeps them and
runs the ones :class:`~coalescer.bisection.Bisection` asks for, one after another, as the shim
does (:meth:`Pool._probe`).

The model is pure apart from :class:`Index`, which it awaits, and never reads the wall clock.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

from coalescer.bisection import Bisection, contradicted, stand_ins
from coalescer.policy.rules import PrimaryFailure
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


@dataclasses.dataclass(frozen=True, slots=True)
class Search:
    """One bisection after a failed primary: the tasks it held (victims oldest first, then the
    primary), the culprit and last good task it named (-1: none), when the primary's run failed
    and when the search ended, and the runs it made beyond the primary's first."""

    primary: int
    culprit: int
    last_good: int
    started_ms: int
    ended_ms: int
    runs: int
    #: With an inconclusive verdict, the first failing push it found (stands for the newer
    #: pushes as a culprit does, but is not named).
    suspect: int = -1
    #: Waves of runs (runs at once share one); -1: one run after another, as many as ``runs``.
    rounds: int = -1


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
    #: When each task's first failing run ended (-1: none failed).
    failed_ms: list[int] = dataclasses.field(default_factory=list)
    #: Runs beyond one per primary spent after a failed primary: a bisection's runs, and the
    #: runs of the secondaries a worker released (``release``).
    extra_runs: int = 0
    #: Every bisection, in the order they ended.
    searches: list[Search] = dataclasses.field(default_factory=list)
    #: Runs of each task's command (the draws :meth:`History.fails` made for it).
    executions: list[int] = dataclasses.field(default_factory=list)


# Event kinds, in the order they are handled at one instant: runs end (freeing workers and
# scheduling dependents), then tasks arrive, then the history's cancellations; then decisions
# on arrival are carried out (and the decisions those lead to), and idle workers claim.
# Workers come and go last (one whose last run ends now is free by then).
# A claim that waited (see Pool._wait) is made with the instant's others.
_FINISH, _PROBE, _ARRIVE, _WITHDRAW, _WORKERS, _CLAIM = 0, 1, 2, 3, 4, 5


@dataclasses.dataclass(slots=True)
class _Searching:
    """A bisection under way on the worker of a failed primary."""

    primary: int
    pushes: list[int]  # victims oldest first, then the primary
    search: Bisection
    started_ms: int
    longest_ms: int  # the longest run so far: the margin before a victim's deadline is twice it


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
        on_failure: PrimaryFailure = PrimaryFailure.SUPERSEDE,
        bisect_confirm: int = 1,
    ) -> None:
        self.history = history
        self.seed = seed
        self.on_failure, self.bisect_confirm = on_failure, bisect_confirm
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
            failed_ms=[-1] * n,
            executions=[0] * n,
        )
        self.dependents: dict[int, list[int]] = defaultdict(list)
        self.blocked = [0] * n
        for i, t in enumerate(self.tasks):
            for dep in t.dependencies:
                if (j := self.pos.get(dep)) is not None:  # one outside the history is done
                    self.dependents[j].append(i)
                    self.blocked[i] += 1
        #: Idle workers; with a curve (:attr:`History.curves`), the workers there, and those
        #: that left in the history and leave here once idle (the last one stays).
        curves = history.curves
        self.idle = {q: 0 if q in curves else n for q, n in history.workers.items()}
        self.present = dict(self.idle)
        self.leaving = dict.fromkeys(self.idle, 0)
        self.queues: dict[str, list[tuple[int, int, int, int, int]]] = {q: [] for q in self.idle}
        self.events: list[tuple[int, int, int, object]] = []
        self.seq = 0
        self.pending = 0
        #: A running primary's end: ``(finish_ms, secondaries)``; canceled runs are removed.
        self.running: dict[int, tuple[int, list[int]]] = {}
        #: When a running task's run begins, for those claimed with a wait (see :meth:`_wait`).
        self.begins: dict[int, int] = {}
        #: A worker's secondary -> its primary; the enforcer's held victims.
        self.secondary_of: dict[int, int] = {}
        self.enforcer_holds: set[int] = set()
        self.by_enforcer: set[int] = set()
        self.since = [-1] * n  # when each task's current run became pending
        self.priority = [t.priority for t in self.tasks]  # changeTaskPriority changes it
        #: Tasks resolved, then run again by ``rerunTask``: the queue will not change their
        #: priority any more (release 106 answers 409, "already resolved").
        self.reran: set[int] = set()
        self.executions = self.out.executions  # runs of each task's command so far (its draws)
        #: Secondaries released after their primary failed, whose run will be an extra one.
        self.after_failure: set[int] = set()
        self.searches: dict[int, _Searching] = {}
        #: each key's tasks (a task's first key), built at the first search's end
        self._by_key: defaultdict[str, list[int]] | None = None

    async def run(self) -> Outcome:
        for i, t in enumerate(self.tasks):
            if not self.blocked[i]:
                self._at(t.scheduled_ms, _ARRIVE, i)
            if t.canceled_ms:
                self._at(t.canceled_ms, _WITHDRAW, i)
        for queue, curve in self.history.curves.items():
            level = 0
            for at, workers in curve:
                self._at(at, _WORKERS, (queue, workers - level))
                level = workers
        events = self.events
        while events:
            now = events[0][0]
            waited: list[int] = []
            while events and events[0][0] == now:
                _, kind, _, arg = heapq.heappop(events)
                if kind == _FINISH:
                    self._finish(now, *arg)  # type: ignore[misc]
                elif kind == _PROBE:
                    self._probed(now, *arg)  # type: ignore[misc]
                elif kind == _WITHDRAW:
                    self._withdraw(now, arg)  # type: ignore[arg-type]
                elif kind == _WORKERS:
                    self._workers(*arg)  # type: ignore[misc]
                elif kind == _CLAIM:
                    waited.append(arg)  # type: ignore[arg-type]
                elif self.out.state[arg] == State.WAITING:  # type: ignore[call-overload]
                    self._pending(now, arg)  # type: ignore[arg-type]
            if self.index is not None:
                await self.index.enforce(self, now)
            for i in waited:
                if self.out.state[i] == State.RUNNING:
                    await self._claim(i, now)
                else:  # canceled while its worker claimed it
                    self._free(self.tasks[i].task_queue)
            await self._dispatch(now)
            self._leave_idle()
            self._sample(now)
        self.progress(sum(1 for s in self.out.state if s not in RESOLVED))  # never resolved
        return self.out

    # -- the pieces ---------------------------------------------------------------------
    def _free(self, queue: str) -> None:
        """A worker of ``queue`` ends its run: it is idle."""
        self.idle[queue] += 1

    def _workers(self, queue: str, change: int) -> None:
        """Workers come (they are idle) or leave, as the history's curve says."""
        if change > 0:
            self.idle[queue] += change
            self.present[queue] += change
        else:
            self.leaving[queue] -= change

    def _leave_idle(self) -> None:
        """Workers that left in the history leave once idle with nothing to claim (they left
        because nothing was pending for them), the last one of a queue excepted: a replay may
        have work where the history had none."""
        for queue, count in self.leaving.items():
            if count and self.idle[queue]:
                gone = min(count, self.idle[queue], self.present[queue] - 1)
                self.idle[queue] -= gone
                self.present[queue] -= gone
                self.leaving[queue] -= gone

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
        self.out.state[i] = State.PENDING
        if self.out.pending_ms[i] < 0:
            self.out.pending_ms[i] = now
        self.since[i] = now
        self.out.runs[i] += 1
        self._queue(i)
        self.pending += 1
        self._record(i, "pending", now)

    def _queue(self, i: int) -> None:
        """Task ``i``'s pending run in its task queue: by priority, then since when pending
        (an entry left behind by a change of priority is skipped when it comes up)."""
        self.seq += 1
        heapq.heappush(
            self.queues[self.tasks[i].task_queue],
            (-self.priority[i], self.since[i], self.seq, i, self.out.runs[i]),
        )

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

    def rerun(self, i: int, now: int) -> None:
        """``rerunTask`` for a bisection: a task that resolved (with its own result, or
        superseded) is pending again in a new run, and resolves again when that run ends; one
        never scheduled (a dependency did not complete) is scheduled, whatever its
        dependencies. Either run is an extra one."""
        if self.out.state[i] != State.WAITING:
            self.progress(-1)
            self.reran.add(i)
        self.after_failure.add(i)
        self._pending(now, i)

    def prioritize(self, i: int, priority: int) -> None:
        """``changeTaskPriority``: task ``i`` (and its later runs) at ``priority``; a pending
        run moves to its new place in the queue at once."""
        self.priority[i] = priority
        if self.out.state[i] == State.PENDING:
            self._queue(i)

    def cancel(self, i: int, primary: int, now: int, state: State = State.CANCELED) -> None:
        """``cancelTask`` on a task running on a worker. A canceled primary's worker stops at
        once and releases its secondaries (they run again); a canceled secondary is dropped
        by its worker."""
        if i in self.running:
            finish, secondaries = self.running.pop(i)
            task = self.tasks[i]
            self._free(task.task_queue)
            unrun = finish - max(now, self.begins.pop(i, now))  # none while it waited
            self.out.worker_ms -= unrun
            self.out.worked_ms[i] -= unrun
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
                rank, *_, i, run = heapq.heappop(heap)
                if self.out.state[i] != State.PENDING or self.out.runs[i] != run:
                    continue  # claimed as a secondary or superseded meanwhile, or rerun
                if -rank != self.priority[i]:
                    continue  # queued again at its new priority
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
            if wait := self._wait(i, now):
                self._at(now + wait, _CLAIM, i)
            else:
                await self._claim(i, now)

    def _wait(self, i: int, now: int) -> int:
        """How long task ``i``, claimed now, waits for its run to start: its first run's
        recorded wait (from when its worker could claim it); else, when it became pending at this instant,
        the history's: it reached a worker already waiting in ``claimWork``, which the queue
        answers at its next poll."""
        wait = self.tasks[i].wait_ms
        if wait is not None and self.out.runs[i] == 1:
            return wait
        return self.history.claim_wait_ms if self.since[i] == now else 0

    async def _claim(self, i: int, now: int) -> None:
        """A worker that claimed task ``i`` asks (when its key supersedes on claim), holds what
        it can of the answer and runs the newest it holds (once it claimed them)."""
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
        if primary in self.after_failure:
            self.after_failure.discard(primary)
            self.out.extra_runs += 1
        if primary != i:
            self.out.state[i], self.out.state[primary] = State.HELD, State.RUNNING
        wait = 0
        if secondaries:  # claimed them before it runs the newest
            hold = self.tasks[primary].hold_ms
            wait = self.history.hold_ms if hold is None else hold
        duration = self.durations.of(self.tasks[primary])
        self.out.worker_ms += duration
        self.out.worked_ms[primary] += duration
        self.running[primary] = (now + wait + duration, secondaries)
        if wait:
            self.begins[primary] = now + wait
        for j in secondaries:
            self.secondary_of[j] = primary
        self._at(now + wait + duration, _FINISH, (primary, self.out.runs[primary]))

    def _claimable(self, j: int, initial: TaskSpec, now: int) -> bool:
        other = self.tasks[j]
        return (
            self.out.state[j] == State.PENDING
            and self.out.runs[j] == 1  # one given back (released) runs itself, as the shim has it
            and other.task_queue == initial.task_queue
            and set(other.keys) == set(initial.keys)
            and other.deadline_ms > now
        )

    def _fails(self, i: int, now: int) -> bool:
        """Whether task ``i``'s next run fails: broken, recorded failed, or an intermittent
        or flaky failure drawn for this run (its ``k``-th): :meth:`History.fails
        <coalescer.replay.history.History.fails>`."""
        self.executions[i] += 1
        failed = self.history.fails(self.tasks[i], self.executions[i], self.seed)
        if failed and self.out.failed_ms[i] < 0:
            self.out.failed_ms[i] = now
        return failed

    def _result(self, i: int, failed: bool, now: int) -> None:
        """Task ``i`` resolves with its own result; a completed one schedules its dependents."""
        state = State.FAILED if failed else State.COMPLETED
        self._resolve(i, state, now)
        self._record(i, state.name.lower(), now)
        if state == State.COMPLETED:
            for d in self.dependents.get(i, ()):
                self.blocked[d] -= 1
                if not self.blocked[d]:  # pending once the queue's resolver gets to it
                    lag = self.tasks[d].lag_ms
                    at = now + (self.history.resolver_lag_ms if lag is None else lag)
                    self._at(max(at, self.tasks[d].scheduled_ms), _ARRIVE, d)

    def _finish(self, now: int, primary: int, run: int) -> None:
        if primary not in self.running or self.out.runs[primary] != run:
            return  # canceled meanwhile: its worker stopped then
        _, secondaries = self.running.pop(primary)
        self.begins.pop(primary, None)
        failed = self._fails(primary, now)
        held = [j for j in secondaries if self.secondary_of.get(j) == primary]  # not canceled
        if failed and held and self.on_failure is PrimaryFailure.BISECT:
            self._bisect(now, primary, held)
            return
        self._free(self.tasks[primary].task_queue)
        self._result(primary, failed, now)
        for j in held:
            del self.secondary_of[j]
            if failed and self.on_failure is PrimaryFailure.RELEASE:
                self.after_failure.add(j)
                self._rerun(j, now)
            else:
                self._resolve(j, State.SUPERSEDED, now, by=primary)
                self._record(j, "exception", now, "superseded")

    # -- a bisection on the failed primary's worker (--on-primary-failure bisect) -----------
    def _bisect(self, now: int, primary: int, held: list[int]) -> None:
        """The primary failed: its worker keeps what it held and searches it."""
        order = sorted(held, key=lambda j: (self.tasks[j].order, self.tasks[j].task_id))
        found = _Searching(
            primary=primary,
            pushes=[*order, primary],
            search=Bisection.start(len(order), self.bisect_confirm),
            started_ms=now,
            longest_ms=self.out.worked_ms[primary],
        )
        self.searches[primary] = found
        self._probe(now, found)

    def _probe(self, now: int, found: _Searching) -> None:
        """Settle what can no longer stand for others, take out of the search the victims
        canceled meanwhile or whose deadline comes within twice the longest run (released to
        run themselves, as the shim does), then run the next push the search asks for, or
        conclude."""
        search = found.search
        self._settle(now, found, search.keep)
        for k, j in enumerate(found.pushes):
            if k in search.verdicts or k in search.dropped:
                continue
            gone = self.out.state[j] in RESOLVED
            due = self.tasks[j].deadline_ms <= now + 2 * found.longest_ms
            if not gone and k < search.n and due:
                self.secondary_of.pop(j, None)
                self.after_failure.add(j)
                self._rerun(j, now)
                gone = True
            if gone:
                search.drop(k)
        probe = search.next()
        if probe is None:
            self._conclude(now, found)
            return
        j = found.pushes[probe.index]
        duration = self.durations.of(self.tasks[j])
        found.longest_ms = max(found.longest_ms, duration)
        self.out.worker_ms += duration
        self.out.worked_ms[j] += duration
        self.out.extra_runs += 1
        self._at(now + duration, _PROBE, (found.primary, probe.index))

    def _probed(self, now: int, primary: int, index: int) -> None:
        found = self.searches[primary]
        j = found.pushes[index]
        if self.out.state[j] not in RESOLVED:  # else canceled while it ran: dropped next
            found.search.record(index, not self._fails(j, now))
        self._probe(now, found)

    def _unsure(self, pushes: list[int], culprit: int, good: int | None) -> bool:
        """Whether a task of the key outside the search, between the last good push and the
        culprit, did not pass (as the shim learns from ``GET /v1/bisections/gap``)."""
        tasks = self.tasks
        key = tasks[pushes[culprit]].keys[0]
        if self._by_key is None:
            self._by_key = defaultdict(list)
            for i, t in enumerate(tasks):
                if t.keys:
                    self._by_key[t.keys[0]].append(i)
        ours = set(pushes)
        outside = {
            tasks[i].task_id: (
                tasks[i].order,
                "completed" if self.out.state[i] == State.COMPLETED else "other",
            )
            for i in self._by_key[key]
            if i not in ours
        }
        low = None if good is None else tasks[pushes[good]].order
        return bool(contradicted(low, tasks[pushes[culprit]].order, outside))

    def _settle(self, now: int, found: _Searching, keep: set[int]) -> None:
        """Resolve with its own result every push that ran and is not in ``keep``."""
        for k, passed in found.search.verdicts.items():
            j = found.pushes[k]
            if k not in keep and self.out.state[j] not in RESOLVED:
                self.secondary_of.pop(j, None)
                self._result(j, not passed, now)

    def _conclude(self, now: int, found: _Searching) -> None:
        """The search is over: each victim that did not run is superseded by the push that
        stands for it, what ran resolves with its own result, anything else is released to
        run itself; the worker is free."""
        search, pushes, primary = found.search, found.pushes, found.primary
        for k, by in stand_ins(search).items():
            j = pushes[k]
            if self.secondary_of.get(j) == primary:
                del self.secondary_of[j]
                self._resolve(j, State.SUPERSEDED, now, by=pushes[by])
                self._record(j, "exception", now, "superseded")
        self._settle(now, found, set())
        for j in pushes[:-1]:
            if self.secondary_of.get(j) == primary:
                del self.secondary_of[j]
                self.after_failure.add(j)
                self._rerun(j, now)
        del self.searches[primary]
        self._free(self.tasks[primary].task_queue)
        culprit, good = search.culprit, search.last_good
        if culprit is not None and self._unsure(pushes, culprit, good):
            culprit = None  # inconclusive: the shim asks the index what lies between
        self.out.searches.append(
            Search(
                primary=primary,
                culprit=-1 if culprit is None else pushes[culprit],
                last_good=-1 if good is None else pushes[good],
                started_ms=found.started_ms,
                ended_ms=now,
                runs=len(search.runs) - 1,
            )
        )
