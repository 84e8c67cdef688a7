"""What a replay cost and saved, per configuration, from the pool model's outcome. Pure.

* worker-hours used, and saved against the first configuration without superseding;
* tasks run, superseded, resolved by their deadline, and dependents never scheduled;
* per key, the time from a push to a result at least as new as its own (p50/p95), and how many
  pushes got no result of their own;
* pending time (p95), the makespan and the backlog over time;
* per rule of the configuration's policy, the same figures for the tasks the rule governs;
* after failed primaries (:func:`regressions`): the regressions located to the push that
  introduced them, culprits a bisection named wrongly, the runs spent beyond one per primary
  (bisections, released secondaries) and the time from the first failing run of a regression
  to its located culprit (p50/p95);
* two numbers that must be 0: wrong winners (a task superseded by one that is not newer in its
  key's order, unless a bisection named that one the culprit and the task lies between it and
  the failed primary, whose failure the culprit's stands for; under ``first-wins``, neither
  older nor running) and lost tasks (became pending, then neither ran nor resolved).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from coalescer.policy.rules import ON_CLAIM, Rule, Strategy
from coalescer.replay.history import History, TaskSpec, percentile
from coalescer.replay.pool import REPLACED, RESOLVED, Outcome, State

#: A regression: the task of the push that introduced it, the task of the push before it in
#: its key, and the broken pushes' tasks (the first included), oldest first.
Regression = tuple[int, int, tuple[int, ...]]

#: Points kept of each backlog curve.
BACKLOG_POINTS = 240


@dataclasses.dataclass(frozen=True, slots=True)
class KeySummary:
    key: str
    tasks: int
    superseded: int
    #: Pushes whose own task produced no result (superseded, never scheduled, deadline).
    no_own_result: int
    #: Pushes that saw no result at all, not even a newer one.
    no_result: int
    ttr_p50_s: float | None
    ttr_p95_s: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class RuleSummary:
    """The tasks one rule governs (by their first key), under one configuration."""

    rule: str
    strategy: str
    tasks: int
    run: int
    superseded: int
    #: Of ``superseded``: running victims canceled (``supersede-running``).
    canceled: int
    never_scheduled: int
    worker_hours: float
    #: Against the baseline's worker-hours on the same tasks.
    saved_hours: float
    no_own_result: int
    ttr_p50_s: float | None
    ttr_p95_s: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    name: str
    worker_hours: float
    saved_hours: float
    tasks: int
    run: int
    superseded: int
    deadline_exceeded: int
    never_scheduled: int
    asked: int
    #: Decisions on arrival whose victim a worker had claimed first (left to run).
    decisions_missed: int
    #: Of ``superseded``: running victims canceled (``supersede-running``).
    canceled: int
    #: Runs given back to the queue (held victims of a failed primary, secondaries of a
    #: canceled one): each task ran again in a new run.
    released: int
    #: Tasks canceled as the history records it, before the replay resolved them.
    withdrawn: int
    pending_p95_s: float | None
    ttr_p50_s: float | None
    ttr_p95_s: float | None
    makespan_hours: float
    backlog_peak: int
    wrong_winners: int
    lost: int
    keys: tuple[KeySummary, ...]
    rules: tuple[RuleSummary, ...]
    #: ``(hours since the start, pending tasks)``, at most :data:`BACKLOG_POINTS` points.
    backlog: tuple[tuple[float, int], ...]
    #: Regressions in the history (a broken push after one that was not), and of them those
    #: located to their own push: it failed and the push before it passed, or a bisection
    #: named it the culprit.
    regressions: int = 0
    located: int = 0
    #: Regressions any run failed for (the others were superseded, or never scheduled, and
    #: fixed before anything of theirs ran).
    seen: int = 0
    #: Culprits named by a bisection, with a last good push below them, where no regression
    #: began (an intermittent failure trusted). On a recorded history, which marks no
    #: regression, none: see :attr:`culprits_unknown`.
    wrong_culprits: int = 0
    #: On a recorded history, the named culprits it cannot tell right: right is a culprit
    #: recorded failed whose previous push in its key was recorded passing.
    culprits_unknown: int = 0
    #: Bisections run after failed primaries.
    bisections: int = 0
    #: Runs beyond one per primary: bisections' runs, released secondaries' runs.
    extra_runs: int = 0
    #: The most rounds one search took: waves of runs, each waiting for the one before (the
    #: runs a bisection makes at once share a round; one at a time, each is one).
    rounds_most: int = 0
    #: From a regression's first failing run to its located culprit, seconds.
    locate_p50_s: float | None = None
    locate_p95_s: float | None = None
    #: Every push's time to a result, seconds (for the distribution chart).
    ttr_s: tuple[float, ...] = dataclasses.field(repr=False, default=())

    @property
    def saved_share(self) -> float:
        base = self.worker_hours + self.saved_hours
        return self.saved_hours / base if base else 0.0

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        del doc["ttr_s"]
        doc["saved_share"] = self.saved_share
        doc["backlog"] = [[h, n] for h, n in self.backlog]
        doc["keys"] = [dataclasses.asdict(k) for k in self.keys]
        doc["rules"] = [dataclasses.asdict(r) for r in self.rules]
        return doc


def summarize(
    history: History,
    name: str,
    out: Outcome,
    baseline_hours: float | None,
    *,
    newest_wins: bool = True,
    rule_of: Callable[[TaskSpec], Rule] | None = None,
    baseline: Outcome | None = None,
) -> Summary:
    """The figures of one configuration. ``rule_of`` gives each task's rule (default: one
    rule for all, ``first-wins`` when not ``newest_wins``): under ``first-wins`` a task is
    rightly superseded by an older one, or by one already running. ``baseline`` is the
    outcome without superseding, for the worker time each rule saved."""
    if rule_of is None:
        one = ON_CLAIM if newest_wins else Rule("first-wins", ("**",), Strategy.FIRST_WINS)
        rule_of = lambda task: one  # noqa: E731
    tasks = history.tasks
    governing = [rule_of(t) for t in tasks]
    start = tasks[0].scheduled_ms
    states = out.state
    wrong = 0
    #: A culprit (or an inconclusive search's suspect) stands for the pushes between it and
    #: the failed primary of its bisection.
    culprits: dict[int, list[int]] = defaultdict(list)
    for search in out.searches:
        if (stand_in := max(search.culprit, search.suspect)) >= 0:
            culprits[stand_in].append(search.primary)

    def place(i: int) -> tuple[float, str]:
        return tasks[i].order, tasks[i].task_id

    for i, by in enumerate(out.by):
        if by >= 0:
            mine, theirs = tasks[i], tasks[by]
            newer = place(by) > place(i)
            stood_for = any(place(by) < place(i) < place(p) for p in culprits.get(by, ()))
            if stood_for:
                right = True
            elif governing[i].strategy is not Strategy.FIRST_WINS:
                right = newer
            else:  # first-wins: an older task, or one that was already running
                at = out.resolved_ms[i]
                running = 0 <= out.left_ms[by] <= at and not 0 <= out.resolved_ms[by] < at
                right = not newer or running
            if not right or not set(mine.keys) & set(theirs.keys):
                wrong += 1
    lost = sum(1 for i, s in enumerate(states) if out.pending_ms[i] >= 0 and s not in RESOLVED)
    pending_waits = [
        (out.left_ms[i] - out.pending_ms[i]) / 1000
        for i in range(len(tasks))
        if out.pending_ms[i] >= 0 and out.left_ms[i] >= 0
    ]
    per_key, all_ttr, ttr_of = _time_to_result(history, out)
    worker_hours = out.worker_ms / 3_600_000
    ends = [r for r in out.resolved_ms if r >= 0]
    found = regressions(history)
    located_at = located(found, out)
    starts = {c for c, _, _ in found}
    waits = [w / 1000 for w in located_at.values()]
    named = [s.culprit for s in out.searches if s.culprit >= 0 and s.last_good >= 0]
    told = told_right(history, named) if history.is_recorded else set(named)
    return Summary(
        name=name,
        worker_hours=worker_hours,
        saved_hours=(baseline_hours or worker_hours) - worker_hours,
        tasks=len(tasks),
        run=sum(1 for s in states if s in (State.COMPLETED, State.FAILED)),
        superseded=sum(1 for s in states if s in REPLACED),
        deadline_exceeded=sum(1 for s in states if s == State.DEADLINE),
        never_scheduled=sum(1 for s in states if s == State.WAITING),
        asked=out.asked,
        decisions_missed=out.missed,
        canceled=sum(1 for s in states if s == State.CANCELED),
        released=out.released,
        withdrawn=sum(1 for s in states if s == State.WITHDRAWN),
        pending_p95_s=percentile(pending_waits, 0.95),
        ttr_p50_s=percentile(all_ttr, 0.5),
        ttr_p95_s=percentile(all_ttr, 0.95),
        makespan_hours=((max(ends) if ends else start) - start) / 3_600_000,
        backlog_peak=max((n for _, n in out.backlog), default=0),
        wrong_winners=wrong,
        lost=lost,
        keys=tuple(per_key),
        rules=_per_rule(governing, out, baseline, ttr_of),
        backlog=_downsample(out.backlog, start),
        regressions=len(found),
        located=len(located_at),
        seen=sum(1 for _, _, broken in found if any(out.failed_ms[j] >= 0 for j in broken)),
        wrong_culprits=0 if history.is_recorded else sum(1 for c in named if c not in starts),
        culprits_unknown=sum(1 for c in named if c not in told),
        bisections=len(out.searches),
        extra_runs=out.extra_runs,
        rounds_most=max((s.runs if s.rounds < 0 else s.rounds for s in out.searches), default=0),
        locate_p50_s=percentile(waits, 0.5),
        locate_p95_s=percentile(waits, 0.95),
        ttr_s=tuple(all_ttr),
    )


def regressions(history: History) -> list[Regression]:
    """Every regression of the history: per key (a task's first), a broken push whose
    previous push is not broken, with the broken pushes that follow it. A key's first push
    has no push before it to tell where its breakage began: it counts for none."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(history.tasks):
        if t.keys:
            members[t.keys[0]].append(i)
    found: list[Regression] = []
    tasks = history.tasks
    for key in sorted(members):
        ids = sorted(members[key], key=lambda i: (tasks[i].order, tasks[i].task_id))
        n = 1
        while n < len(ids):
            if tasks[ids[n]].broken and not tasks[ids[n - 1]].broken:
                end = n
                while end < len(ids) and tasks[ids[end]].broken:
                    end += 1
                found.append((ids[n], ids[n - 1], tuple(ids[n:end])))
                n = end
            else:
                n += 1
    return found


def told_right(history: History, named: Sequence[int]) -> set[int]:
    """The culprits of ``named`` a recorded history shows right: recorded failed, with the
    push before them in their key (a task's first) recorded passing. Of the others it cannot
    tell: the push before was superseded, or failed too, or the culprit never ran."""
    tasks = history.tasks
    before: dict[int, int] = {}
    members: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(tasks):
        if t.keys:
            members[t.keys[0]].append(i)
    for ids in members.values():
        ids.sort(key=lambda i: (tasks[i].order, tasks[i].task_id))
        before.update(zip(ids[1:], ids, strict=False))
    return {
        c
        for c in named
        if tasks[c].outcome == "failed"
        and c in before
        and tasks[before[c]].outcome == "completed"
        and tasks[before[c]].resolved_ms > 0
    }


def located(found: Sequence[Regression], out: Outcome) -> dict[int, int]:
    """The regressions located to their own push: ``{culprit: ms from the regression's first
    failing run to the moment it was located}``. Located by results when the culprit failed
    and the push before it passed (at the later of the two), or when a bisection named it
    (at the search's end), whichever came first."""
    named: dict[int, int] = {}
    for search in out.searches:
        if search.culprit >= 0:
            named[search.culprit] = min(named.get(search.culprit, search.ended_ms), search.ended_ms)
    located: dict[int, int] = {}
    for culprit, before, broken in found:
        times = []
        if out.state[culprit] == State.FAILED and out.state[before] == State.COMPLETED:
            times.append(max(out.resolved_ms[culprit], out.resolved_ms[before]))
        if culprit in named:
            times.append(named[culprit])
        failures = [out.failed_ms[j] for j in broken if out.failed_ms[j] >= 0]
        if times and failures:
            located[culprit] = max(0, min(times) - min(failures))
    return located


def _per_rule(
    governing: Sequence[Rule],
    out: Outcome,
    baseline: Outcome | None,
    ttr_of: dict[int, float],
) -> tuple[RuleSummary, ...]:
    members: dict[str, list[int]] = defaultdict(list)
    rule_named: dict[str, Rule] = {}
    for i, rule in enumerate(governing):
        members[rule.name].append(i)
        rule_named[rule.name] = rule
    found = []
    for name, ids in members.items():
        states = [out.state[i] for i in ids]
        worked = sum(out.worked_ms[i] for i in ids)
        base = worked if baseline is None else sum(baseline.worked_ms[i] for i in ids)
        ttr = [ttr_of[i] for i in ids if i in ttr_of]
        ran = sum(1 for s in states if s in (State.COMPLETED, State.FAILED))
        found.append(
            RuleSummary(
                rule=name,
                strategy=str(rule_named[name].strategy),
                tasks=len(ids),
                run=ran,
                superseded=sum(1 for s in states if s in REPLACED),
                canceled=sum(1 for s in states if s == State.CANCELED),
                never_scheduled=sum(1 for s in states if s == State.WAITING),
                worker_hours=worked / 3_600_000,
                saved_hours=(base - worked) / 3_600_000,
                no_own_result=len(ids) - ran,
                ttr_p50_s=percentile(ttr, 0.5),
                ttr_p95_s=percentile(ttr, 0.95),
            )
        )
    return tuple(found)


def _time_to_result(
    history: History, out: Outcome
) -> tuple[list[KeySummary], list[float], dict[int, float]]:
    """Per key: for each task (a push), the first result of a task at least as new, from the
    moment the push scheduled it; and each task's, by its first key."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(history.tasks):
        for key in t.keys:
            members[key].append(i)
    summaries: list[KeySummary] = []
    everything: list[float] = []
    of_task: dict[int, float] = {}
    for key in sorted(members):
        ids = sorted(members[key], key=lambda i: (history.tasks[i].order, history.tasks[i].task_id))
        best = None  # the earliest result among the tasks seen so far (newest first)
        ttr: list[float] = []
        no_result = 0
        for i in reversed(ids):
            if out.state[i] in (State.COMPLETED, State.FAILED):
                done = out.resolved_ms[i]
                best = done if best is None else min(best, done)
            if best is None:
                no_result += 1
            else:
                ttr.append(max(0, best - history.tasks[i].scheduled_ms) / 1000)
                if history.tasks[i].keys[0] == key:
                    of_task[i] = ttr[-1]
        ran = sum(1 for i in ids if out.state[i] in (State.COMPLETED, State.FAILED))
        summaries.append(
            KeySummary(
                key=key,
                tasks=len(ids),
                superseded=sum(1 for i in ids if out.state[i] in REPLACED),
                no_own_result=len(ids) - ran,
                no_result=no_result,
                ttr_p50_s=percentile(ttr, 0.5),
                ttr_p95_s=percentile(ttr, 0.95),
            )
        )
        everything += ttr
    return summaries, everything, of_task


def _downsample(points: list[tuple[int, int]], start: int) -> tuple[tuple[float, int], ...]:
    """The backlog step curve as about :data:`BACKLOG_POINTS` points, each bucket's peak (a
    bucket without a change keeps the level before it)."""
    if not points:
        return ()
    width = max(1.0, (points[-1][0] - start) / BACKLOG_POINTS)
    peaks: dict[int, int] = {}
    last: dict[int, int] = {}
    for at, n in points:
        b = int((at - start) // width)
        peaks[b] = max(peaks.get(b, 0), n)
        last[b] = n
    curve: list[tuple[float, int]] = []
    level = 0
    for b in range(max(peaks) + 1):
        curve.append((b * width / 3_600_000, peaks.get(b, level)))
        level = last.get(b, level)
    return tuple(curve)
