"""Finding the culprit among the pushes a failed primary held: a model of pushes that fail from
one push on, with intermittent failures and pushes taken out of the search."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalescer.bisection import Bisection, Probe, expiring, max_runs, stand_ins

T0 = datetime(2024, 5, 1, tzinfo=UTC)


def search(
    n: int,
    first_bad: int,
    confirm: int,
    spurious: frozenset[tuple[int, int]] = frozenset(),
    drops: dict[int, int] | None = None,
) -> Bisection:
    """Run a search where every push from ``first_bad`` on fails (``n + 1``: none does; the
    primary's first failure was then intermittent), ``spurious`` ``(push, attempt)`` runs fail
    although the push is good, and ``drops`` maps a step to a push taken out before it."""
    found = Bisection.start(n, confirm, T0)
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


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, int, int, frozenset[tuple[int, int]], dict[int, int]]:
    n = draw(st.integers(0, 32))
    confirm = draw(st.integers(0, 3))
    # n + 1: nothing fails for good, the primary's failure was intermittent (needs a
    # confirmation to be told apart, and victims to search).
    top = n + 1 if confirm and n else n
    first_bad = draw(st.integers(0, top))
    # Intermittent failures of good pushes, at most ``confirm`` in a row for one push: more
    # would be indistinguishable from a real failure.
    spurious = draw(
        st.frozensets(
            st.tuples(st.integers(0, n), st.integers(0, max(0, confirm - 1))).filter(
                lambda ia: ia[0] < first_bad and ia[1] < confirm
            ),
            max_size=40,
        )
    )
    drops = draw(st.dictionaries(st.integers(0, 12), st.integers(0, max(0, n - 1)), max_size=4))
    if n == 0:
        drops = {}
    return n, first_bad, confirm, spurious, drops


@settings(max_examples=600, deadline=None)
@given(cases())
def test_the_culprit_is_always_the_first_failing_push_within_the_bound(
    case: tuple[int, int, int, frozenset[tuple[int, int]], dict[int, int]],
) -> None:
    n, first_bad, confirm, spurious, drops = case
    found = search(n, first_bad, confirm, spurious, drops)
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
        assert probed == set() and stood == {i: n for i in range(n) if i not in found.dropped}
        return
    culprit, good = found.culprit, found.last_good
    assert culprit is not None
    assert culprit >= first_bad  # truly failing: an intermittent failure is never blamed
    assert found.verdicts[culprit] is False and culprit not in found.intermittent
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
    with pytest.raises(ValueError, match="not the one to run"):
        found.record(0, True)


def test_expiring_deadlines() -> None:
    deadlines = {0: T0 + timedelta(minutes=5), 1: T0 + timedelta(hours=2), 2: T0}
    assert expiring(deadlines, T0, timedelta(minutes=10)) == [0, 2]
    assert expiring(deadlines, T0, timedelta(0)) == [2]
