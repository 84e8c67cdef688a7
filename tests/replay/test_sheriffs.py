"""The sheriffs' reference columns on small hand-made histories whose right answer is known:
linear backfill runs the gap once and the failing push 4 more times in one round; mozci's rule
retriggers 5 times and backfills only when at least 3 of the 6 runs failed; both draw each run
as the pool would, and flaky runs can make either name the wrong push."""

from __future__ import annotations

import dataclasses

from coalescer.replay.cli import sheriffs_base
from coalescer.replay.history import History, TaskSpec
from coalescer.replay.pool import Outcome, State
from coalescer.replay.runner import Config
from coalescer.replay.sheriffs import LINEAR, MOZCI, Reference, reference
from tests.replay.support import MIN, T0, history, task

#: What the base configuration made of each push: passed, failed, or no result of its own.
PASS, FAIL, NONE = "pass", "fail", "none"


def base(h: History, fates: dict[str, str], *, wait: float = 5) -> Outcome:
    """An outcome where each task ran once at its scheduled time plus ``wait`` minutes (its
    pending wait) and resolved 10 minutes later, or was superseded then (``NONE``)."""
    n = len(h.tasks)
    out = Outcome(
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
    for i, t in enumerate(h.tasks):
        fate = fates[t.task_id]
        out.pending_ms[i], out.left_ms[i] = t.scheduled_ms, t.scheduled_ms + int(wait * MIN)
        out.resolved_ms[i] = out.left_ms[i] + 10 * MIN
        out.runs[i] = 1
        if fate == NONE:
            out.state[i] = State.SUPERSEDED
            continue
        out.state[i] = State.FAILED if fate == FAIL else State.COMPLETED
        out.executions[i] = 1
        out.worked_ms[i] = 10 * MIN
        out.worker_ms += 10 * MIN
        if fate == FAIL:
            out.failed_ms[i] = out.resolved_ms[i]
    return out


def key_pushes(key: str, n: int, broken_from: int | None, at: float = 0) -> list[TaskSpec]:
    """``n`` pushes of ``key`` a minute apart from ``at``, 10 minutes each, broken from the
    push ``broken_from`` on."""
    return [
        dataclasses.replace(
            task(f"{key}/{k}", at + k, 10, key=key, order=k),
            broken=broken_from is not None and k >= broken_from,
        )
        for k in range(n)
    ]


def gap_of_five(way_h: History | None = None) -> tuple[History, Outcome]:
    """p0 passed, p1..p5 superseded (a gap of 5), p6 failed; the key is broken from p3."""
    h = way_h or history(*key_pushes("k", 7, 3))
    fates = {"k/0": PASS, **{f"k/{n}": NONE for n in range(1, 6)}, "k/6": FAIL}
    return h, base(h, fates)


def ids(h: History, r: Reference) -> list[tuple[str, str]]:
    def name(i: int) -> str:
        return h.tasks[i].task_id if i >= 0 else ""

    return [(name(e.culprit), name(e.last_good)) for e in r.episode_list]


def test_linear_backfill_runs_a_5_push_gap_and_4_retriggers_in_one_round() -> None:
    h, out = gap_of_five()
    r = reference(h, out, "supersede", LINEAR)
    [e] = r.episode_list
    assert (e.runs, e.rounds, r.runs, r.rounds_most) == (5 + 4, 1, 9, 1)
    assert ids(h, r) == [("k/3", "k/2")]
    assert (r.regressions, r.seen, r.located, r.wrong_culprits, r.intermittent) == (1, 1, 1, 0, 0)
    # p6 failed at 6 + 5 + 10 = 21 min; the round waits 5 min (the queue's median wait in
    # the hour before) and takes the longest run, 10 min.
    assert (e.started_ms, e.ended_ms) == (T0 + 21 * MIN, T0 + 36 * MIN)
    assert r.locate_p50_s == 15 * 60
    assert r.worker_hours == (2 + 9) * 10 / 60 and r.extra_runs == 9


def test_mozci_retriggers_5_times_then_backfills_the_gap_in_a_second_round() -> None:
    h, out = gap_of_five()
    r = reference(h, out, "supersede", MOZCI)
    [e] = r.episode_list
    assert (e.runs, e.rounds, r.rounds_most) == (5 + 5, 2, 2)
    assert ids(h, r) == [("k/3", "k/2")]
    assert e.ended_ms - e.started_ms == 2 * 15 * MIN
    assert (r.located, r.wrong_culprits, r.locate_p95_s) == (1, 0, 30 * 60)


def test_a_failure_the_push_before_explains_costs_the_retriggers_alone() -> None:
    h = history(*key_pushes("k", 3, 2))
    out = base(h, {"k/0": PASS, "k/1": PASS, "k/2": FAIL})
    linear, mozci = reference(h, out, "b", LINEAR), reference(h, out, "b", MOZCI)
    assert (linear.runs, linear.rounds, mozci.runs, mozci.rounds) == (4, 1, 5, 1)
    assert ids(h, linear) == ids(h, mozci) == [("k/2", "k/1")]
    # The base's own results located it already, when p2 failed (at 22 min).
    assert linear.locate_p50_s == mozci.locate_p50_s == 0


def test_failures_after_a_named_culprit_and_before_any_pass_start_no_search() -> None:
    h = history(*key_pushes("k", 6, 2), *key_pushes("first", 3, 0, at=100))
    fates = {f"k/{n}": PASS if n < 2 else FAIL for n in range(6)}
    out = base(h, {**fates, **{f"first/{n}": FAIL for n in range(3)}})
    r = reference(h, out, "b", LINEAR)
    assert ids(h, r) == [("k/2", "k/1")] and r.runs == 4


def flaky_failures(keys: int, rate: float) -> tuple[History, Outcome]:
    """``keys`` keys, each a pass, a gap of 3 and a failing push; no push is broken, each key
    fails ``rate`` of its runs (the base's failure of the last push was one of them)."""
    tasks = [t for n in range(keys) for t in key_pushes(f"k{n}", 5, None)]
    h = dataclasses.replace(history(*tasks), flaky={f"k{n}": rate for n in range(keys)})
    fates = {t.task_id: (PASS, NONE, NONE, NONE, FAIL)[int(t.order)] for t in tasks}
    return h, base(h, fates)


def test_mozci_does_not_backfill_a_10_percent_flaky_failure_most_of_the_time() -> None:
    h, out = flaky_failures(400, 0.1)
    mozci, linear = reference(h, out, "b", MOZCI), reference(h, out, "b", LINEAR)
    assert mozci.episodes == linear.episodes == 400
    # At least 2 of 5 retriggers must fail as well: 8% of the time at 10%.
    backfilled = sum(1 for e in mozci.episode_list if e.rounds == 2)
    assert backfilled / 400 < 0.15 and mozci.intermittent == 400 - backfilled
    assert mozci.runs == 5 * 400 + 3 * backfilled
    # Linear backfill always runs the gap, and blames a push whenever one retrigger fails.
    assert linear.runs == (3 + 4) * 400
    assert linear.wrong_culprits > 2 * mozci.wrong_culprits > 0
    assert 0.2 < linear.wrong_culprits / 400 < 0.45  # 1 - 0.9^4 = 34%
    assert linear.located == mozci.located == linear.regressions == 0


def test_the_sheriffs_runs_draw_what_the_pool_would_draw_next() -> None:
    h, out = flaky_failures(300, 0.3)
    r = reference(h, out, "b", LINEAR, seed=5)
    at = {t.task_id: i for i, t in enumerate(h.tasks)}
    for e in r.episode_list:
        failing = h.tasks[e.failing]
        # Run 1 was the base's; the 4 retriggers are runs 2 to 5, as the pool numbers them.
        retriggers = [h.fails(failing, run, 5) for run in range(2, 6)]
        assert (e.culprit >= 0) == any(retriggers)
        if e.culprit >= 0:
            key = failing.keys[0]
            gap = [h.fails(h.tasks[at[f"{key}/{k}"]], 1, 5) for k in (1, 2, 3)]
            passed = [k + 1 for k, failed in enumerate(gap) if not failed]
            assert h.tasks[e.culprit].task_id == f"{key}/{passed[-1] + 1 if passed else 1}"
    assert r.wrong_culprits == r.episodes - r.intermittent > 0  # nothing is broken


def test_a_flaky_regression_can_be_named_on_the_wrong_push() -> None:
    tasks = [t for n in range(200) for t in key_pushes(f"k{n}", 6, 2)]
    broken = {t.task_id: 0.5 for t in tasks if t.broken}
    h = dataclasses.replace(history(*tasks), broken_rates=broken)
    fates = {t.task_id: (PASS, NONE, NONE, NONE, NONE, FAIL)[int(t.order)] for t in tasks}
    out = base(h, fates)
    r = reference(h, out, "b", LINEAR)
    assert r.regressions == r.seen == 200
    named = [e for e in r.episode_list if e.culprit >= 0]
    late = [e for e in named if h.tasks[e.culprit].order > 2]
    # Named right only when every broken push of the gap failed its one run (1 in 8).
    assert r.wrong_culprits == len(late) > len(named) / 2  # a broken push passed: blamed later
    assert r.located == len(named) - len(late) > 10
    assert all(h.tasks[e.culprit].order >= 2 for e in named)  # never before the breakage


def test_a_regression_only_a_backfill_run_failed_for_is_seen_not_located() -> None:
    # Broken at p1 (fixed at p2) and again from p3: the base ran p0 (passed) and p4 (failed).
    pushes = key_pushes("k", 5, None)
    h = history(*(dataclasses.replace(t, broken=t.order in (1, 3, 4)) for t in pushes))
    out = base(h, {"k/0": PASS, "k/1": NONE, "k/2": NONE, "k/3": NONE, "k/4": FAIL})
    linear, mozci = reference(h, out, "b", LINEAR), reference(h, out, "b", MOZCI)
    assert ids(h, linear) == ids(h, mozci) == [("k/3", "k/2")]
    assert (linear.regressions, linear.seen, linear.located) == (2, 2, 1)
    assert (mozci.seen, mozci.located, mozci.wrong_culprits) == (2, 1, 0)


def test_the_sheriffs_work_on_the_first_configuration_that_supersedes_without_searching() -> None:
    parse = Config.parse
    off = Config(False)
    plain = [off, parse("latest-wins,on-primary-failure=bisect"), parse("on-claim")]
    assert sheriffs_base(plain) == 2
    chosen = [off, parse("on-claim,on-primary-failure=release"), parse("latest-wins")]
    assert sheriffs_base(chosen) == 2
    assert sheriffs_base([off, parse("on-claim,on-primary-failure=bisect")]) == 1
    assert sheriffs_base([off]) == 0


def builds_and_tests(test_broken: int, build_broken: frozenset[int] = frozenset()) -> History:
    """Five pushes, each a build (30 min) and a test depending on it (10 min)."""
    tasks = []
    for n in range(5):
        build = dataclasses.replace(
            task(f"b/{n}", n, 30, key="b", queue="qb", order=n), broken=n in build_broken
        )
        test = task(f"t/{n}", n, 10, key="t", queue="qt", order=n, after=(build.task_id,))
        tasks += [build, dataclasses.replace(test, broken=n >= test_broken)]
    return history(*tasks)


#: The builds of pushes 1-3 were superseded, so their tests were never scheduled.
GAPPED = {"b/0": PASS, "t/0": PASS, "b/4": PASS, "t/4": FAIL} | {
    f"{k}/{n}": NONE for k in "bt" for n in (1, 2, 3)
}


def test_a_test_backfilled_where_its_build_never_ran_waits_for_the_build() -> None:
    h = builds_and_tests(2)
    r = reference(h, base(h, GAPPED), "b", LINEAR)
    [e] = r.episode_list
    assert ids(h, r) == [("t/2", "t/1")]
    assert e.runs == 3 + 3 + 4 and e.rounds == 1  # 3 builds, then 3 tests; 4 retriggers
    # t/4 failed at 19 min; the builds wait 5 and take 30 (to 54), the tests 5 and 10.
    assert e.ended_ms - e.started_ms == (5 + 30 + 5 + 10) * MIN
    assert r.worker_hours == (4 * 10 + 3 * 30 + 7 * 10) / 60


def test_a_test_whose_backfilled_build_fails_gets_no_result() -> None:
    h = builds_and_tests(3, frozenset({2}))
    r = reference(h, base(h, GAPPED), "b", LINEAR)
    [e] = r.episode_list
    assert e.runs == 3 + 2 + 4  # no run of t/2: its build failed
    assert ids(h, r) == [("t/3", "t/1")]
    # The build's regression was seen by the backfill's build run, and located by nobody.
    assert (r.regressions, r.seen, r.located, r.wrong_culprits) == (2, 2, 1, 0)
