"""The pool model's rules without superseding: claim order, dependents, durations, deadlines."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from coalescer.errors import InvalidInput
from coalescer.replay.history import Durations, History, TaskSpec, peak_concurrency
from coalescer.replay.lags import resolver_lag_ms
from coalescer.replay.pool import Outcome, Pool, State
from tests.replay.support import MIN, T0, history, minutes, task


def run(h: History) -> Outcome:
    return asyncio.run(Pool(h, None).run())


def claimed_order(h: History, out: Outcome) -> list[str]:
    ran = [i for i, s in enumerate(out.state) if s in (State.COMPLETED, State.FAILED)]
    return [h.tasks[i].task_id for i in sorted(ran, key=lambda i: out.left_ms[i])]


def test_a_worker_claims_the_highest_priority_then_the_longest_pending() -> None:
    h = history(
        task("busy", 0, 60),
        task("low-old", 5, priority=1),
        task("high", 10, priority=5),
        task("low-new", 15, priority=1),
        task("high-new", 20, priority=5),
    )
    out = run(h)
    assert claimed_order(h, out) == ["busy", "high", "high-new", "low-old", "low-new"]
    assert [minutes(out.left_ms[h.tasks.index(t)]) for t in h.tasks] == [0, 80, 60, 90, 70]


def test_each_task_queue_has_its_own_workers() -> None:
    h = history(
        task("a", 0, 30, queue="q1"), task("b", 0, 30, queue="q2"), task("c", 0, 30, queue="q1")
    )
    out = run(h)
    assert [minutes(t) for t in out.resolved_ms] == [30, 30, 60]
    assert out.worker_ms == 90 * MIN


def test_a_dependent_becomes_pending_when_its_dependencies_complete() -> None:
    h = history(
        task("build", 0, 30),
        task("lint", 0, 5),
        task("test", 0, 10, after=("build", "lint")),
        workers=2,
    )
    out = run(h)
    test = h.tasks.index(next(t for t in h.tasks if t.task_id == "test"))
    assert minutes(out.pending_ms[test]) == 30
    assert minutes(out.resolved_ms[test]) == 40


def test_a_failed_dependency_leaves_its_dependents_never_scheduled() -> None:
    h = history(task("build", 0, 30, outcome="failed"), task("test", 0, 10, after=("build",)))
    out = run(h)
    assert out.state == [State.FAILED, State.WAITING]
    assert out.pending_ms[1] == -1


def test_a_task_still_pending_at_its_deadline_is_resolved_by_it() -> None:
    slow = task("slow", 0, 25 * 60)
    late = task("late", 1, 10)
    out = run(history(slow, late))
    assert out.state == [State.COMPLETED, State.DEADLINE]
    assert out.worker_ms == 25 * 60 * MIN


def test_a_task_that_never_ran_takes_a_duration_from_its_key() -> None:
    tasks = [task("a", 0, 7, key="x"), task("b", 0, 50, key="y"), task("c", 1, None, key="x")]
    assert Durations(tasks).of(tasks[2]) == 7 * MIN
    out = run(history(*tasks, workers=3))
    assert minutes(out.resolved_ms[2]) == 1 + 7


def test_a_recorded_cancellation_stops_a_pending_or_running_task_at_its_time() -> None:
    h = history(
        task("running", 0, 60, canceled=20),  # its worker stops at 20
        task("pending", 1, 10, canceled=10),  # still pending behind it at 10
        task("next", 2, 10),
        task("late", 3, 5, canceled=50),  # the replay ran it before: left as it ran
    )
    out = run(h)
    states = {t.task_id: out.state[i].name.lower() for i, t in enumerate(h.tasks)}
    assert states == {
        "running": "withdrawn",
        "pending": "withdrawn",
        "next": "completed",
        "late": "completed",
    }
    assert [minutes(out.resolved_ms[i]) for i in range(4)] == [20, 10, 30, 35]
    assert out.worker_ms == (20 + 10 + 5) * MIN and out.worked_ms[0] == 20 * MIN
    assert out.by == [-1] * 4


def test_a_canceled_task_waiting_for_its_dependencies_is_never_scheduled() -> None:
    h = history(task("build", 0, 30), task("test", 0, 5, after=("build",), canceled=10))
    out = run(h)
    assert [s.name for s in out.state] == ["COMPLETED", "WITHDRAWN"]
    assert out.pending_ms[1] == -1 and minutes(out.resolved_ms[1]) == 10


def test_the_pool_defaults_to_the_peak_concurrency_the_history_shows() -> None:
    def ran(task_id: str, *spans: tuple[int, int], queue: str = "q") -> TaskSpec:
        real = tuple((T0 + start, T0 + end) for start, end in spans)
        return TaskSpec(task_id, queue, (), 0.0, T0, T0 + 10**8, real_runs=real)

    tasks = [
        ran("a", (0, 10)),
        ran("b", (5, 20)),
        ran("c", (10, 30)),
        ran("d", (12, 14)),
        ran("e", (0, 1), queue="r"),
        # Held by the superseding side from 5 to 25, then run: only its real run counts.
        ran("f", (25, 40)),
    ]
    assert peak_concurrency(tasks) == {"q": 3, "r": 1}
    assert History.build(tasks).workers == {"q": 3, "r": 1}
    assert History.build(tasks, workers={"q": 8}).workers == {"q": 8, "r": 1}
    with pytest.raises(InvalidInput, match="no worker count for task queue 'z'"):
        History.build([TaskSpec("z1", "z", (), 0.0, T0, T0 + 1)])


def test_a_queue_that_never_ran_borrows_the_pool_its_task_group_used_most() -> None:
    def ran(task_id: str, queue: str, group: str, *spans: tuple[int, int]) -> TaskSpec:
        real = tuple((T0 + start, T0 + end) for start, end in spans)
        return TaskSpec(task_id, queue, (), 0.0, T0, T0 + 10**8, real_runs=real, group=group)

    tasks = [
        ran("b1", "build", "g", (0, 10)),
        ran("b2", "build", "g", (0, 10)),
        ran("m1", "mac", "g", (0, 10)),
        ran("m2", "mac", "g", (0, 10)),
        ran("m3", "mac", "g", (0, 10)),
        ran("m4", "mac", "g", (10, 20)),
        ran("t1", "test", "g"),  # superseded with its build: never ran
        ran("x1", "other", "h", (0, 10)),
        ran("x2", "other", "h", (0, 10)),
        ran("x3", "other", "h", (0, 10)),
        ran("x4", "other", "h", (0, 10)),
        ran("x5", "other", "h", (0, 10)),
    ]
    h = History.build(tasks)
    assert h.workers == {"build": 2, "mac": 3, "other": 5, "test": 3}
    [note] = h.notes
    assert "'test' never ran" in note and "the 3 workers of 'mac'" in note
    assert History.build(tasks, workers={"test": 1}).workers["test"] == 1
    assert History.build(tasks, workers={"test": 1}).notes == ()
    alone = [ran("t1", "test", "lonely"), *tasks[:2]]
    with pytest.raises(InvalidInput, match="no worker count for task queue 'test'"):
        History.build(alone)


def test_a_dependent_becomes_pending_the_resolver_lag_after_its_dependency() -> None:
    h = history(task("build", 0, 30), task("test", 0, 10, after=("build",)))
    out = run(dataclasses.replace(h, resolver_lag_ms=3_000))
    assert out.pending_ms[1] - out.resolved_ms[0] == 3_000
    assert out.resolved_ms[1] == T0 + 40 * MIN + 3_000
    assert run(h).pending_ms[1] == out.resolved_ms[0]  # a synthetic history: at once


def test_the_resolver_lag_is_the_median_gap_the_history_shows() -> None:
    def done(task_id: str, at_s: float, *, outcome: str = "completed") -> TaskSpec:
        end = T0 + int(at_s * 1000)
        return TaskSpec(task_id, "q", (), 0.0, T0, T0 + 10**8, outcome=outcome, resolved_ms=end)

    def waiting(task_id: str, *after: str) -> TaskSpec:
        return TaskSpec(task_id, "q", (), 0.0, T0, T0 + 10**8, dependencies=after)

    tasks = [
        done("b1", 10),
        done("b2", 20),
        done("b3", 30),
        done("lint", 35),
        done("bad", 40, outcome="failed"),
        waiting("t1", "b1"),  # pending 1 s after b1
        waiting("t2", "b2"),  # 4 s after b2
        waiting("t3", "b3", "lint"),  # 2 s after lint, the last of its two
        waiting("t4", "bad"),  # its dependency failed: never pending, shows nothing
        waiting("t5", "elsewhere"),  # a dependency outside the history
    ]
    pending = {"t1": T0 + 11_000, "t2": T0 + 24_000, "t3": T0 + 37_000, "t5": T0}
    assert resolver_lag_ms(tasks, pending) == 2_000
    assert resolver_lag_ms(tasks[:5], {}) == 0
