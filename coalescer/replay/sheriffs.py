"""The two ways sheriffs find a culprit today, as reference columns beside the configurations.
Pure.

Both work on one configuration's results (its *base*): a sheriff sees which pushes of a key
passed and failed, and reacts to each new failure, a push that failed after the newest push
that passed (its *last good*), unless a culprit already named since that pass explains it:

* **linear backfill** (:data:`LINEAR`): every push of the gap between the last good and the
  failing push runs once, and the failing push 4 more times, all in one round. The failure
  stands when at least 2 of the failing push's 5 runs failed;
* **mozci's rule** (:data:`MOZCI`): the failing push runs 5 more times; when at least 3 of its
  6 runs failed, the gap is backfilled in a second round (none when the gap is empty).

When the failure stands, the culprit is the push after the newest push of the gap whose run
passed, or after the last good when none did: a good push's flaky failure just before the
breakage puts it too early, a flaky regression's passing run too late. Otherwise the failure
is taken as intermittent and nobody is blamed.

A test backfilled on a push whose build never ran needs the build, run first in the same
round; a build that fails (or failed in the base) leaves its test without a result.

Every run is drawn with :meth:`History.fails <coalescer.replay.history.History.fails>`, its
number following the base's own runs of the task, so the sheriffs meet the luck the pool did.
A run takes the pending wait of its queue when it is queued (the median wait, in the base, of
the tasks that became pending there in the hour before) plus its duration; a round ends with
its last run, and the first begins when the failing run ends. The runs load no worker of the
pool.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from coalescer.replay.history import Durations, History, percentile
from coalescer.replay.metrics import located, regressions
from coalescer.replay.pool import Outcome, State

HOUR_MS = 3_600_000


@dataclasses.dataclass(frozen=True, slots=True)
class Procedure:
    """A sheriff's way: ``retriggers`` more runs of the failing push, of whose runs at least
    ``needed`` must fail for the failure to stand; the gap backfilled in the same round
    (``backfill_first``) or in a second round once the failure stands."""

    name: str
    retriggers: int
    needed: int
    backfill_first: bool


LINEAR = Procedure("linear backfill", retriggers=4, needed=2, backfill_first=True)
MOZCI = Procedure("mozci's rule", retriggers=5, needed=3, backfill_first=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Episode:
    """One failure a sheriff looked into: the failing push, the culprit and last good it named
    (-1: none, the failure taken as intermittent), its runs and rounds, when it began (the
    failing run's end) and ended."""

    failing: int
    culprit: int
    last_good: int
    runs: int
    rounds: int
    started_ms: int
    ended_ms: int
    worker_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class Reference:
    """A procedure's figures on a base configuration's results, with the meanings the
    configurations' figures have (the base's own results count: a regression its results
    located stays located)."""

    name: str
    #: The configuration whose results the sheriffs worked on.
    base: str
    worker_hours: float
    regressions: int
    #: Regressions a run failed for, the base's or the sheriffs' (a backfill may run a
    #: regression the base superseded whole).
    seen: int
    located: int
    wrong_culprits: int
    #: Failures looked into; of them, those taken as intermittent (nobody blamed).
    episodes: int
    intermittent: int
    #: The base's extra runs plus the sheriffs' runs; the sheriffs' rounds, in all and the
    #: most one failure took.
    extra_runs: int
    runs: int
    rounds: int
    rounds_most: int
    locate_p50_s: float | None
    locate_p95_s: float | None
    episode_list: tuple[Episode, ...] = dataclasses.field(repr=False, default=())

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        del doc["episode_list"]
        return doc


class _Waits:
    """The base's pending waits per task queue, to price a round queued at a given time."""

    def __init__(self, history: History, out: Outcome) -> None:
        points: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for i, t in enumerate(history.tasks):
            if out.pending_ms[i] >= 0 and out.left_ms[i] >= 0:
                points[t.task_queue].append((out.pending_ms[i], out.left_ms[i] - out.pending_ms[i]))
        self.points = {q: sorted(p) for q, p in points.items()}

    def at(self, queue: str, now: int) -> int:
        points = self.points.get(queue, [])
        lo = bisect.bisect_right(points, (now - HOUR_MS, -1))
        hi = bisect.bisect_right(points, (now, 1 << 62))
        waits = sorted(w for _, w in points[lo:hi])
        return waits[(len(waits) - 1) // 2] if waits else 0


def reference(
    history: History, out: Outcome, base: str, procedure: Procedure, *, seed: int = 0
) -> Reference:
    """``procedure`` applied to every failure of ``out`` (the configuration ``base``'s
    outcome), with ``seed`` the pool's."""
    sheriff = _Sheriff(history, out, procedure, seed)
    episodes = sheriff.work()
    failed = [
        min((ms for ms in (mine, theirs) if ms >= 0), default=-1)
        for mine, theirs in zip(out.failed_ms, sheriff.failed_ms, strict=True)
    ]
    found = regressions(history)
    starts = {c for c, _, _ in found}
    #: When a run (the base's, or the sheriffs') first failed for each regression seen.
    first_failure = {
        c: min(fails)
        for c, _, broken in found
        if (fails := [failed[j] for j in broken if failed[j] >= 0])
    }
    times = located(found, out)  # the base's results locate these already
    for e in episodes:
        if e.culprit in first_failure:
            wait = max(0, e.ended_ms - first_failure[e.culprit])
            times[e.culprit] = min(times.get(e.culprit, wait), wait)
    waits = [w / 1000 for w in times.values()]
    named = [e for e in episodes if e.culprit >= 0]
    runs = sum(e.runs for e in episodes)
    return Reference(
        name=procedure.name,
        base=base,
        worker_hours=(out.worker_ms + sum(e.worker_ms for e in episodes)) / HOUR_MS,
        regressions=len(found),
        seen=len(first_failure),
        located=len(times),
        wrong_culprits=sum(1 for e in named if e.culprit not in starts),
        episodes=len(episodes),
        intermittent=len(episodes) - len(named),
        extra_runs=out.extra_runs + runs,
        runs=runs,
        rounds=sum(e.rounds for e in episodes),
        rounds_most=max((e.rounds for e in episodes), default=0),
        locate_p50_s=percentile(waits, 0.5),
        locate_p95_s=percentile(waits, 0.95),
        episode_list=tuple(episodes),
    )


class _Sheriff:
    """One procedure's walk through each key's results, oldest push first."""

    def __init__(self, history: History, out: Outcome, procedure: Procedure, seed: int) -> None:
        self.history, self.out, self.procedure, self.seed = history, out, procedure, seed
        self.durations = Durations(history.tasks, seed)
        self.waits = _Waits(history, out)
        #: Each push's known runs (True: failed): its own result in the base, then ours.
        self.results: dict[int, list[bool]] = {
            i: [state == State.FAILED]
            for i, state in enumerate(out.state)
            if state in (State.COMPLETED, State.FAILED)
        }
        self.ran = [0] * len(history.tasks)  # our runs of each task
        self.failed_ms = [-1] * len(history.tasks)  # when our first failing run of each ended
        self.made = 0  # our runs so far
        self.pos = {t.task_id: i for i, t in enumerate(history.tasks)}

    def work(self) -> list[Episode]:
        tasks = self.history.tasks
        members: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(tasks):
            if t.keys:
                members[t.keys[0]].append(i)
        episodes: list[Episode] = []
        for key in sorted(members):
            pushes = sorted(members[key], key=lambda i: (tasks[i].order, tasks[i].task_id))
            last_good, blamed = -1, False
            for pos, i in enumerate(pushes):
                if i not in self.results:
                    continue
                if self._fails(i) and not blamed and last_good >= 0:
                    episodes.append(
                        self._episode(pushes[last_good], pushes[last_good + 1 : pos], i)
                    )
                    blamed = episodes[-1].culprit >= 0
                if not self._fails(i):
                    last_good, blamed = pos, False
        return sorted(episodes, key=lambda e: (e.started_ms, e.failing))

    def _fails(self, i: int) -> bool:
        """A push's verdict from its runs: its one run, or the procedure's share of them."""
        runs = self.results[i]
        return runs[0] if len(runs) == 1 else sum(runs) >= self.procedure.needed

    def _run(self, j: int) -> int:
        """One more run of task ``j``, drawn as the pool would draw it; its duration."""
        self.ran[j] += 1
        self.made += 1
        task = self.history.tasks[j]
        number = self.out.executions[j] + self.ran[j]
        self.results.setdefault(j, []).append(self.history.fails(task, number, self.seed))
        return self.durations.of(task)

    def _deps(self, j: int) -> list[int]:
        return [self.pos[d] for d in self.history.tasks[j].dependencies if d in self.pos]

    def _can_run(self, j: int) -> bool:
        """Whether every dependency of ``j`` has passed a run (a failed or missing build has
        no test to run on)."""
        return all(d in self.results and not all(self.results[d]) for d in self._deps(j))

    def _round(self, runs: Sequence[int], now: int) -> tuple[int, int]:
        """Run ``runs`` at once from ``now``, each after the dependencies it needs (one stage
        before it, a build before its tests), each waiting its queue's pending wait: when the
        last ends, and the worker time."""
        needs = {j: [d for d in self._deps(j) if d not in self.results] for j in set(runs)}
        first = sorted({d for unrun in needs.values() for d in unrun})
        after, worked = self._round(first, now) if first else (now, 0)
        end = now
        for j in runs:
            if not self._can_run(j):
                continue  # a dependency failed: no run of this push can be had
            begins = after if needs[j] else now
            took = self._run(j)
            ends = begins + self.waits.at(self.history.tasks[j].task_queue, begins) + took
            worked += took
            end = max(end, ends)
            if self.results[j][-1] and self.failed_ms[j] < 0:
                self.failed_ms[j] = ends
        return max(end, after), worked

    def _episode(self, good: int, gap: list[int], failing: int) -> Episode:
        procedure = self.procedure
        started = now = self.out.resolved_ms[failing]
        made = self.made
        backfill = [j for j in gap if j not in self.results]
        retriggers = [failing] * procedure.retriggers
        first = retriggers + backfill if procedure.backfill_first else retriggers
        now, worked = self._round(first, now)
        rounds = 1
        stands = self._fails(failing)
        if stands and not procedure.backfill_first and backfill:
            now, more = self._round(backfill, now)
            rounds, worked = 2, worked + more
        culprit = last_good = -1
        if stands:
            culprit, last_good = failing, good
            for j in reversed(gap):
                if j not in self.results:
                    continue  # its build failed: no result to read
                if not self._fails(j):
                    last_good = j
                    break
                culprit = j
        runs = self.made - made
        return Episode(failing, culprit, last_good, runs, rounds, started, now, worked)
