"""Finding the culprit among the pushes a failed primary held: a model of pushes that fail from
one push on, with intermittent failures and pushes taken out of the search."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalescer.bisection import (
    Bisection,
    Probe,
    expiring,
    failures_to_believe,
    max_runs,
    stand_ins,
)
from coalescer.policy.record import finding_of, known_broken, ref, replay
from coalescer.verdicts import Verdict, broken_probability

T0 = datetime(2024, 5, 1, tzinfo=UTC)


def search(
    n: int,
    first_bad: int,
    confirm: int,
    spurious: frozenset[tuple[int, int]] = frozenset(),
    drops: dict[int, int] | None = None,
    flake: float = 0.05,
) -> Bisection:
    """Run a search where every push from ``first_bad`` on fails (``n + 1``: none does; the
    primary's first failure was then intermittent), ``spurious`` ``(push, attempt)`` runs fail
    although the push is good, and ``drops`` maps a step to a push taken out before it."""
    found = Bisection.start(n, confirm, T0, flake=flake)
    step = 0
    while (probe := found.next()) is not None:
        victim = (drops or {}).get(step)
        if victim is not None and victim not in found.verdicts:
            found.drop(victim)
            step += 1
            continue
        passed = probe.index < first_bad and (probe.index, probe.attempt) not in spurious
        found.record(probe.index, passed, T0 + timedelta(minutes=step))
        step += 1
        assert step < 1000
    return found


Case = tuple[int, int, int, frozenset[tuple[int, int]], dict[int, int], float]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    n = draw(st.integers(0, 32))
    confirm = draw(st.integers(0, 3))
    flake = draw(st.sampled_from([0.01, 0.05, 0.1, 0.2, 0.4]))
    # Failures in a row the search needs to believe a push broken (at this flake rate, within
    # its reruns); fewer are told apart from a breakage by the next run passing.
    doubt = failures_to_believe(confirm, flake=flake) - 1
    # n + 1: nothing fails for good, the primary's failure was intermittent (needs a
    # confirmation to be told apart, and victims to search).
    top = n + 1 if doubt and n else n
    first_bad = draw(st.integers(0, top))
    # Intermittent failures of good pushes, at most ``doubt`` in a row for one push: more
    # would be indistinguishable from a real failure.
    spurious = draw(
        st.frozensets(
            st.tuples(st.integers(0, n), st.integers(0, max(0, doubt - 1))).filter(
                lambda ia: ia[0] < first_bad and ia[1] < doubt
            ),
            max_size=40,
        )
    )
    drops = draw(st.dictionaries(st.integers(0, 12), st.integers(0, max(0, n - 1)), max_size=4))
    if n == 0:
        drops = {}
    return n, first_bad, confirm, spurious, drops, flake


@settings(max_examples=600, deadline=None)
@given(cases())
def test_the_culprit_is_always_the_first_failing_push_within_the_bound(case: Case) -> None:
    n, first_bad, confirm, spurious, drops, flake = case
    found = search(n, first_bad, confirm, spurious, drops, flake)
    runs = found.runs
    extra = len(runs) - 1

    assert found.done
    probed = {r.index for r in runs if r.index < n}
    # Each push probed to a verdict halves what is left; a push taken out after it ran (its
    # claim lost, an exception) narrows nothing and costs its runs on top.
    wasted = probed & found.dropped
    assert len(probed - wasted) <= math.ceil(math.log2(n + 1))
    assert extra <= max_runs(n, confirm) + (1 + confirm) * len(wasted)
    if not found.dropped:
        assert extra <= max_runs(n, confirm)
    # Every victim ran (its own result), was taken out (it runs itself), or is stood for by
    # the right push: never stood for as well.
    stood = stand_ins(found)
    for i in range(n):
        assert (i in found.ran or i in found.dropped) != (i in stood), i
    if first_bad == n + 1:
        # The primary's failure did not come back: it stands for every victim, none ran.
        assert found.culprit is None and found.intermittent == {n}
        assert found.verdict is Verdict.FLAKY and found.named is None
        assert probed == set() and stood == {i: n for i in range(n) if i not in found.dropped}
        return
    culprit, good = found.culprit, found.last_good
    assert culprit is not None
    assert culprit >= first_bad  # truly failing: an intermittent failure is never blamed
    assert found.verdicts[culprit] is False and culprit not in found.intermittent
    # Named only when its failures reached the confidence, or were trusted (confirm 0; no
    # victims, nothing searched).
    sure = found.probability(culprit) >= found.confidence or not confirm or not n
    assert (found.named == culprit) is (sure and not found.unsure)
    assert found.verdict is (Verdict.CULPRIT if found.named is not None else Verdict.INCONCLUSIVE)
    # Nothing between the last good and the culprit is left but pushes taken out.
    below = -1 if good is None else good
    assert below < first_bad
    assert all(i in found.dropped for i in range(below + 1, culprit))
    if not found.dropped:
        assert culprit == first_bad and below == first_bad - 1
    for victim, push in stood.items():
        assert push == (good if victim < below else culprit)
        assert push in found.ran
        assert found.verdicts[push] is (victim < below)
    # Held to the end: only what stands for others.
    assert found.keep <= {culprit, below}


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 31, 32])
def test_without_confirmation_at_most_log2_of_n_plus_one_extra_runs(n: int) -> None:
    counts = [len(search(n, k, 0).runs) - 1 for k in range(n + 1)]
    assert max(counts) == math.ceil(math.log2(n + 1)) == max_runs(n, 0)


def test_eight_victims_take_at_most_four_extra_runs() -> None:
    counts = {k: len(search(8, k, 0).runs) - 1 for k in range(9)}
    assert max(counts.values()) == 4
    assert sum(counts.values()) / len(counts) == pytest.approx(3.22, abs=0.01)
    # One confirmation: the primary's rerun plus one per failing probe.
    confirmed = [len(search(8, k, 1).runs) - 1 for k in range(9)]
    assert max(confirmed) <= max_runs(8, 1) == 9
    assert max(confirmed) == 7  # the culprit is the oldest: three failing probes, rerun


def test_the_search_runs_the_middle_and_narrows() -> None:
    found = Bisection.start(8, 0, T0)
    assert found.next() == Probe(3, 0)
    found.record(3, True)
    assert found.next() == Probe(5, 0)
    found.record(5, False)
    assert found.next() == Probe(4, 0)
    found.record(4, False)
    assert found.done and found.culprit == 4 and found.last_good == 3
    assert stand_ins(found) == {0: 3, 1: 3, 2: 3, 6: 4, 7: 4}


def test_a_confirmation_that_passes_marks_the_push_intermittent_and_good() -> None:
    found = Bisection.start(8, 1, T0)
    assert found.next() == Probe(8, 1)  # the primary's failure first
    found.record(8, False)
    assert found.next() == Probe(3, 0)
    found.record(3, False)
    assert found.next() == Probe(3, 1)  # rerun before narrowing on it
    found.record(3, True)
    assert found.intermittent == {3} and found.good == 3
    assert found.next() == Probe(5, 0)


def test_without_confirmation_an_intermittent_failure_is_blamed() -> None:
    """The trade-off of bisect-confirm 0: one spurious failure is taken at its word."""
    found = search(8, 6, 0, frozenset({(3, 0)}))
    assert found.culprit == 3


def test_an_intermittent_primary_stands_for_every_victim() -> None:
    found = Bisection.start(4, 1, T0)
    found.record(4, True)
    assert found.done and found.culprit is None and found.intermittent == {4}
    assert stand_ins(found) == {0: 4, 1: 4, 2: 4, 3: 4}
    assert found.keep == {4}


def test_a_primary_taken_out_before_its_confirmation_leaves_no_verdict() -> None:
    found = Bisection.start(4, 1, T0)
    found.drop(4)
    assert found.done and found.culprit is None and stand_ins(found) == {}


def test_nothing_to_search_blames_the_primary_without_rerunning_it() -> None:
    found = Bisection.start(0, 2, T0)
    assert found.done and found.culprit == 0 and len(found.runs) == 1


def test_a_push_with_a_verdict_cannot_be_taken_out() -> None:
    found = Bisection.start(4, 0, T0)
    found.record(1, True)
    with pytest.raises(ValueError, match="verdict"):
        found.drop(1)
    with pytest.raises(ValueError, match="verdict already"):
        found.record(1, False)
    with pytest.raises(ValueError, match="not in the search"):
        found.record(5, False)
    # A result that comes back after the search has moved past its push narrows nothing.
    found.record(0, False)
    assert found.good == 1 and found.bad == 4 and found.verdicts[0] is False


def test_expiring_deadlines() -> None:
    deadlines = {0: T0 + timedelta(minutes=5), 1: T0 + timedelta(hours=2), 2: T0}
    assert expiring(deadlines, T0, timedelta(minutes=10)) == [0, 2]
    assert expiring(deadlines, T0, timedelta(0)) == [2]


def test_a_flakier_key_confirms_a_failure_more_often() -> None:
    # At 2% two failures are sure enough (one confirmation); at 20%, three.
    assert failures_to_believe(3, 0.99, 0.02) == 2
    assert failures_to_believe(3, 0.99, 0.1) == 2
    assert failures_to_believe(3, 0.99, 0.2) == 3
    assert failures_to_believe(1, 0.99, 0.2) == 2  # no more than the reruns allowed
    assert failures_to_believe(0, 0.99, 0.2) == 1  # confirm 0: every failure trusted
    steady = search(8, 5, 3, flake=0.02)
    flaky = search(8, 5, 3, flake=0.2)
    assert steady.named == flaky.named == 5
    # One more rerun for each failure believed: the primary's and the culprit's.
    assert len(flaky.runs) - len(steady.runs) == 2


def test_a_flaky_primary_blames_nobody() -> None:
    # A 10%-flaky key: the newest push fails, and passes when run again.
    found = Bisection.start(6, 3, T0, flake=0.1)
    assert found.next() == Probe(6, 1)
    found.record(6, True)
    assert found.done and found.verdict is Verdict.FLAKY
    assert found.culprit is None and found.named is None and found.intermittent == {6}


def test_reruns_spent_short_of_the_confidence_leave_it_inconclusive() -> None:
    # At 40% flaky, two failures in a row are not enough: the culprit is a suspect only.
    found = search(4, 2, 1, flake=0.4)
    assert found.done and found.culprit == 2
    assert found.probability(2) < found.confidence
    assert found.verdict is Verdict.INCONCLUSIVE and found.named is None


def run_parallel(n: int, first_bad: int, parallel: int, confirm: int = 0) -> tuple[Bisection, int]:
    """A search with ``parallel`` runs at once, each round's results coming back together
    (newest first, so that results out of order are exercised); how many rounds it took."""
    found = Bisection.start(n, confirm, T0, parallel=parallel)
    rounds = 0
    while probes := found.probes():
        rounds += 1
        assert len(probes) <= parallel
        for probe in sorted(probes, key=lambda p: -p.index):
            found.record(probe.index, probe.index < first_bad)
        assert rounds < 100
    return found, rounds


@pytest.mark.parametrize("parallel", [1, 2, 3, 7])
def test_several_probes_at_once_find_the_same_culprit_in_fewer_rounds(parallel: int) -> None:
    for n in (1, 5, 8, 15, 31):
        for first_bad in range(n + 1):
            found, rounds = run_parallel(n, first_bad, parallel)
            assert found.named == first_bad
            assert found.last_good == (first_bad - 1 if first_bad else None)
            # An n-ary split: each round divides what is left by parallel + 1.
            assert rounds <= math.ceil(math.log(n + 1, parallel + 1) - 1e-9)


def test_with_several_slots_the_primarys_confirmation_runs_beside_the_first_probes() -> None:
    found = Bisection.start(8, 1, T0, parallel=3)
    assert found.probes() == [Probe(8, 1), Probe(2, 0), Probe(5, 0)]
    # One run at a time: its confirmation first, as before.
    assert Bisection.start(8, 1, T0).probes() == [Probe(8, 1)]
    # A run under way takes its slot, and keeps its place among the points that split the
    # pushes left: the other point is handed out, not a new middle.
    assert found.probes(running={8, 2}) == [Probe(5, 0)]
    assert found.probes(running={8, 2, 5}) == []


def test_beside_a_failure_awaiting_its_confirmation_the_search_narrows_below_it() -> None:
    # Twelve pushes, two runs at once: the primary's confirmation and push 5 first.
    found = Bisection.start(12, 1, T0, parallel=2)
    assert found.probes() == [Probe(12, 1), Probe(5, 0)]
    found.record(12, False)
    found.record(5, False)
    # Push 5's failure awaits its confirmation; on a key no flakier than the prior, it is
    # most likely a breakage: the free slot narrows below it (pushes 0-4), not across 0-11.
    assert found.probes() == [Probe(5, 1), Probe(2, 0)]
    found.record(5, True)  # intermittent after all: the search widens again, above push 5
    assert 5 in found.intermittent and found.good == 5
    assert all(p.index > 5 for p in found.probes(running={2}))
    # On a key flakier than the prior, a confirmation that passes is likelier: the free
    # slot cuts what is left as before.
    flaky = Bisection.start(12, 1, T0, parallel=2, flake=0.1)
    flaky.record(12, False)
    flaky.record(5, False)
    assert flaky.probes() == [Probe(5, 1), Probe(6, 0)]


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 40),
    data=st.data(),
    parallel=st.integers(1, 5),
    confirm=st.integers(0, 2),
)
def test_results_in_any_order_name_the_first_failing_push(
    n: int, data: st.DataObject, parallel: int, confirm: int
) -> None:
    """Runs handed out a few at a time, their results coming back in any order, new runs
    handed out between two results: the search still names the first failing push, after
    the push before it, and never has more than ``parallel`` runs out at once."""
    first_bad = data.draw(st.integers(0, n), label="first_bad")
    found = Bisection.start(n, confirm, T0, parallel=parallel)
    running: dict[int, int] = {}  # push -> attempt
    for _ in range(1000):
        for probe in found.probes(running):
            assert probe.index not in running
            running[probe.index] = probe.attempt
        assert len(running) <= parallel
        if not running:
            break
        index = data.draw(st.sampled_from(sorted(running)), label="result of")
        del running[index]
        found.record(index, index < first_bad)
    assert found.done and not running
    assert found.named == first_bad
    assert found.last_good == (first_bad - 1 if first_bad else None)


def test_a_pass_above_a_failure_moves_the_search_to_the_newer_breakage() -> None:
    """Two breakages in one gap: pushes 1-2 broken, 3 fixed them, 5 on broken again. The
    second probe passes above the first one's failure: the primary's breakage began above
    that pass, and the search looks for it there."""
    found = Bisection.start(8, 0, T0, parallel=2)
    assert found.probes() == [Probe(2, 0), Probe(5, 0)]
    found.record(2, False)
    assert found.good == -1 and found.bad == 2
    found.record(5, False)
    assert found.probes() == [Probe(0, 0), Probe(1, 0)]
    found.record(1, False)
    found.record(0, True)
    assert found.culprit == 1  # where the breakage seen first began
    found = Bisection.start(8, 0, T0, parallel=2)
    found.record(2, False)
    found.record(5, True)  # the breakage at 1-2 was fixed: the primary's is newer
    assert (found.good, found.bad) == (5, 8)
    assert found.probes() == [Probe(6, 0), Probe(7, 0)]
    found.record(6, False)
    found.record(7, False)
    assert found.done and found.named == 6 and found.last_good == 5
    assert stand_ins(found) == {0: 5, 1: 5, 3: 5, 4: 5}


def test_a_failure_that_stays_below_a_flaky_primary_is_still_searched() -> None:
    """The primary's failure does not come back, but a push the search ran beside its
    confirmation failed for good: a breakage the primary's push fixed, searched for below
    that push; the pushes above it are stood for by the primary, which passed."""
    found = Bisection.start(8, 1, T0, parallel=2)
    assert found.probes() == [Probe(8, 1), Probe(3, 0)]
    found.record(8, True)
    found.record(3, False)
    assert found.verdict is None and found.probes() == [Probe(3, 1)]
    assert found.keep == {3, 8}  # the failure awaiting its confirmation is held too
    found.record(3, False)
    assert found.top == 3 and (found.good, found.bad) == (-1, 3)
    while probes := found.probes():
        for probe in probes:
            found.record(probe.index, probe.index < 2)
    assert found.verdict is Verdict.CULPRIT and found.named == 2 and found.last_good == 1
    assert found.intermittent == {8}
    assert stand_ins(found) == {4: 8, 5: 8, 6: 8, 7: 8}  # 0 and 1 ran
    assert 8 in found.keep


@st.composite
def breakages(draw: st.DrawFn) -> tuple[int, list[bool], int, int]:
    """Pushes ``0 .. n`` broken in stretches (``broken[i]``), runs at once, reruns allowed. The
    primary (push ``n``) failed its first run: it is broken, or (with reruns to tell) that
    failure was intermittent."""
    n = draw(st.integers(1, 40))
    confirm = draw(st.integers(0, 2))
    broken = draw(st.lists(st.booleans(), min_size=n + 1, max_size=n + 1))
    if not confirm:
        broken[n] = True  # a failure taken at its word: nothing tells it was intermittent
    return n, broken, draw(st.integers(1, 5)), confirm


@settings(max_examples=400, deadline=None)
@given(case=breakages(), data=st.data())
def test_the_culprit_is_where_a_breakage_began_above_every_pass_the_search_saw(
    case: tuple[int, list[bool], int, int], data: st.DataObject
) -> None:
    """Any number of breakages and fixes in the gap, results in any order: a culprit named
    is where a breakage began (the push before it passed), at or below the newest push that
    failed for good, and above every push the search saw pass below that one. The search
    blames nobody only when nothing failed for good."""
    n, broken, parallel, confirm = case
    found = Bisection.start(n, confirm, T0, parallel=parallel)
    running: set[int] = set()
    for _ in range(1000):
        running |= {probe.index for probe in found.probes(running)}
        if not running:
            break
        index = data.draw(st.sampled_from(sorted(running)), label="result of")
        running.discard(index)
        found.record(index, not broken[index])
    assert found.done
    failed = [i for i, ok in found.verdicts.items() if ok is False]
    top = found.top
    assert top == (n if broken[n] else max(failed, default=None))
    stood = stand_ins(found)
    if top is None:
        assert found.verdict is Verdict.FLAKY and found.named is None
        assert stood == {i: n for i in range(n) if i not in found.ran}
        return
    culprit, good = found.named, found.last_good
    assert culprit is not None and found.verdict is Verdict.CULPRIT
    assert culprit <= top
    assert broken[culprit] and (good == culprit - 1 if culprit else good is None)
    assert not broken[culprit - 1] if culprit else True
    assert all(i < culprit for i, ok in found.verdicts.items() if ok and i < top)
    for victim, push in stood.items():
        assert push == (good if victim < culprit else culprit if victim < top else n)


def test_a_push_believed_broken_is_not_run_and_the_search_goes_on_below_it() -> None:
    # Push 3 of 8 is an earlier search's culprit: the search looks only below it.
    found = Bisection.start(8, 0, T0)
    found.believe(3)
    assert found.bad == 3 and 3 not in found.ran
    assert found.next() == Probe(1, 0)
    found.record(1, True)
    found.record(2, True)
    assert found.done and found.named == 3 and found.last_good == 2
    assert len(found.runs) == 3  # the primary's failure and two probes: push 3 never ran
    # It stands for the pushes above it as any culprit does; the last good for those below.
    assert stand_ins(found) == {0: 2, 4: 3, 5: 3, 6: 3, 7: 3}
    with pytest.raises(ValueError):
        found.believe(3)
    with pytest.raises(ValueError):
        found.believe(8)  # the primary: its own run says


def test_a_search_starts_from_what_earlier_searches_found_failing_first() -> None:
    doc = {
        "ended": 5_000,
        "confidence": 0.99,
        "victims": [["a", 0, 9], ["b", 1, 9], ["c", 2, 9], ["d", 0, 9], ["held", 0, 9]],
        "gap": {"a": [], "b": [], "c": [], "d": []},
    }
    findings = [
        {"verdict": "culprit", "culprit": {"taskId": "a", "runId": 0}, "probability": 0.95},
        # Inconclusive for a push below it the search could not see: its failure is sure.
        {"verdict": "inconclusive", "suspect": {"taskId": "b", "runId": 1}, "probability": 0.998},
        # Its reruns spent short of the confidence: not known broken.
        {"verdict": "inconclusive", "suspect": {"taskId": "c", "runId": 2}, "probability": 0.9},
        # Named in a run the push has since run again after: not the run the gap holds.
        {"verdict": "culprit", "culprit": {"taskId": "d", "runId": 1}, "probability": 0.999},
        # Held by the primary, not a push of the gap: it never failed.
        {"verdict": "culprit", "culprit": {"taskId": "held", "runId": 0}, "probability": 1},
        {"verdict": "flaky", "culprit": None, "suspect": None, "probability": None},
    ]
    known = known_broken(doc, findings)
    assert [(r["i"], r["run"], r["probability"], r.get("suspect", False)) for r in known] == [
        (0, 0, 0.95, False),
        (1, 1, 0.998, True),
    ]
    assert all(r["known"] and r["passed"] is False and r["ended"] == 5_000 for r in known)


def test_a_finding_names_each_run_by_the_result_it_gave() -> None:
    # Four victims, the oldest a push of the gap, and the primary (its run 2 failed). Its
    # confirmation failed; push 1 failed, then passed its confirmation; push 2 failed twice.
    doc = {
        "primary": "p",
        "primaryRun": 2,
        "confirm": 1,
        "flake": 0.05,
        "parallel": 2,
        "ended": 1_000,
        "rounds": 2,
        "victims": [["a", 0, 9], ["b", 0, 9], ["c", 0, 9], ["d", 0, 9]],
        "gap": {"a": []},
        "floor": ["f", 0],
        "results": [
            {"i": 4, "run": 3, "attempt": 1, "passed": False, "ended": 2_000},
            {"i": 1, "run": 1, "attempt": 0, "passed": False, "ended": 2_500},
            {"i": 1, "run": 2, "attempt": 1, "passed": True, "ended": 3_000},
            {"i": 2, "run": 1, "attempt": 0, "passed": False, "ended": 3_500},
            {"i": 2, "run": 2, "attempt": 1, "passed": False, "ended": 4_000},
        ],
    }
    search = replay(doc)
    assert search.done and (search.culprit, search.last_good) == (2, 1)
    stands = [{"taskId": "d", "runId": 0, "by": ref(doc, 2)}]
    found = finding_of("k", doc, search, search.verdict, search.named, stands, "me")
    assert found["verdict"] == "culprit" and found["culprit"] == {"taskId": "c", "runId": 2}
    assert found["probability"] == round(broken_probability(2, 0, 0.05), 6)
    assert found["suspect"] is None and found["lastGood"] == {"taskId": "b", "runId": 2}
    assert found["primary"] == {"taskId": "p", "runId": 2}
    assert [(r["taskId"], r["runId"], r["passed"]) for r in found["runs"]] == [
        ("p", 2, False),
        ("p", 3, False),
        ("b", 1, False),
        ("b", 2, True),
        ("c", 1, False),
        ("c", 2, False),
    ]
    # The failure that did not come back is named in the run that failed.
    assert found["intermittent"] == [{"taskId": "b", "runId": 1}]
    assert (found["held"], found["gap"], found["extraRuns"], found["rounds"]) == (3, 1, 5, 2)
    assert found["standsFor"] == stands and found["located"] == "1970-01-01T00:00:04.000Z"
    # Known broken from an earlier search (no run): named with that search's probability,
    # the last good being the gap's floor.
    doc["results"] = [
        {"i": 0, "run": 0, "attempt": 0, "passed": False, "ended": 1_000}
        | {"known": True, "probability": 0.97},
        {"i": 4, "run": 3, "attempt": 1, "passed": False, "ended": 2_000},
    ]
    search = replay(doc)
    found = finding_of("k", doc, search, search.verdict, search.named, [], "me")
    assert found["culprit"] == {"taskId": "a", "runId": 0} and found["probability"] == 0.97
    assert found["lastGood"] == {"taskId": "f", "runId": 0} and found["extraRuns"] == 1
