"""The one retry policy: exponential backoff with jitter."""

from __future__ import annotations

import random

import pytest

from coalescer.backoff import Backoff


def test_waits_double_up_to_the_maximum_and_start_again_after_a_success() -> None:
    backoff = Backoff(0.5, maximum=3.0, jitter=0)
    assert [backoff.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next() == 0.5


def test_each_wait_is_jittered_between_half_and_all_of_it() -> None:
    waits = [Backoff(2.0, rng=random.Random(seed)).next() for seed in range(200)]
    assert all(1.0 <= w <= 2.0 for w in waits)
    assert max(waits) - min(waits) > 0.8  # spread: clients that failed together drift apart
    assert len({round(w, 6) for w in waits}) > 150


def test_the_same_seed_gives_the_same_waits() -> None:
    first = Backoff(1.0, rng=random.Random(7))
    second = Backoff(1.0, rng=random.Random(7))
    assert [first.next() for _ in range(6)] == [second.next() for _ in range(6)]


@pytest.mark.parametrize("kwargs", [{"initial": 0}, {"initial": 5, "maximum": 1}, {"jitter": 1}])
def test_a_policy_that_never_waits_or_shrinks_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**{"initial": 1.0, **kwargs})
