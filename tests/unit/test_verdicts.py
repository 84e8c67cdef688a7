"""Flake-aware verdicts: how sure a search is that a push is broken, and a key's flake rate."""

from __future__ import annotations

import pytest

from coalescer.verdicts import DEFAULT_FLAKE, broken_probability, flake_rate


def test_one_pass_makes_a_push_good() -> None:
    assert broken_probability(5, 1, 0.02) == 0.0


def test_each_failure_multiplies_the_odds_by_one_over_the_flake_rate() -> None:
    assert broken_probability(0, 0, 0.1) == pytest.approx(0.5)
    assert broken_probability(1, 0, 0.1) == pytest.approx(10 / 11)
    assert broken_probability(2, 0, 0.1) == pytest.approx(100 / 101)
    # The same failures say less on a flakier key.
    assert broken_probability(2, 0, 0.3) < broken_probability(2, 0, 0.1)


@pytest.mark.parametrize("bad", [(-1, 0, 0.1), (0, -1, 0.1), (1, 0, 0.0), (1, 0, 1.0)])
def test_bad_arguments_are_refused(bad: tuple[int, int, float]) -> None:
    with pytest.raises(ValueError):
        broken_probability(*bad)


def test_a_key_without_history_has_the_priors_rate() -> None:
    assert flake_rate([]) == DEFAULT_FLAKE == pytest.approx(0.05)


def test_failures_that_did_not_come_back_raise_a_keys_flake_rate() -> None:
    steady = [{"runs": [{"passed": True}] * 4, "intermittent": []}] * 5
    flaky = [{"runs": [{"passed": True}] * 4, "intermittent": [{"taskId": "x", "runId": 0}]}] * 5
    assert flake_rate(steady) < DEFAULT_FLAKE < flake_rate(flaky)
    # 5 failures that did not come back among 25 good runs, on a Beta(1, 19) prior.
    assert flake_rate(flaky) == pytest.approx(6 / 45)
