"""The synthetic history: a day starts at a quiet midnight and stays as it was; a history
shorter than the morning ends at the day's peak, so it holds pushes."""

from __future__ import annotations

import dataclasses
import hashlib

import orjson
import pytest

from coalescer.errors import InvalidInput
from coalescer.replay.synthetic import (
    EPOCH_MS,
    HOUR_MS,
    PEAK_HOUR,
    PRIORITY,
    Synthetic,
    generate,
)

#: Fields added to a task since the digests were taken, which a synthetic history leaves empty.
ADDED = ("group", "lag_ms", "wait_ms", "hold_ms")


def fingerprint(spec: Synthetic) -> str:
    history = generate(spec)
    # Every task's priority is one, raised from 0 since the digests were taken (the order among
    # the tasks is the same): taken as 0 here.
    assert {t.priority for t in history.tasks} == {PRIORITY}
    tasks = [
        {k: v for k, v in dataclasses.asdict(t).items() if k not in ADDED or v} | {"priority": 0}
        for t in history.tasks
    ]
    blob = orjson.dumps([tasks, dict(history.workers), history.source, history.intermittent])
    return hashlib.sha256(blob).hexdigest()


@pytest.mark.parametrize(
    ("spec", "digest"),
    [
        # The docs' figures (docs/how-to/replay.md, the replay's model) come from these.
        (Synthetic(), "1908fbf43cd97dcf2f96c80a615224c56c70c22f8cff890c657341f9cae6ae5a"),
        (
            Synthetic(regression_rate=0.05, intermittent_rate=0.02),
            "4b6ff51ba598a9294ccce284d1b47e900e522e7e4cd736527d5ca5a5d3cbff9a",
        ),
        (Synthetic(hours=12), "a56a018e14f8a7a6c6113235433c684e430368f111f7da6a6b1cffb5351cf702"),
        (Synthetic(hours=10), "e96c8cab7387cc14656b6ee2e1547039fc302e8fda4132d1f757862772222b16"),
        (
            Synthetic(hours=72, pushes_per_hour=30, seed=1),
            "6de6d9db6237b773fb2afb5d755e910d6c91f14fa0b5fbb9868157063d504641",
        ),
    ],
)
def test_a_history_of_the_peak_hour_or_longer_is_the_same_as_before(
    spec: Synthetic, digest: str
) -> None:
    assert fingerprint(spec) == digest


@pytest.mark.parametrize("hours", [0.25, 1, 3, 9.5])
def test_a_short_history_ends_at_the_peak_and_holds_pushes(hours: float) -> None:
    history = generate(Synthetic(hours=hours))
    start, end = EPOCH_MS + (PEAK_HOUR - hours) * HOUR_MS, EPOCH_MS + PEAK_HOUR * HOUR_MS
    times = [t.scheduled_ms for t in history.tasks]
    assert times and start <= min(times) and max(times) < end
    # about 11 pushes in the hour before the peak, at 12 an hour at the peak
    assert len(history.tasks) >= 8 * min(hours, 1) * Synthetic().tasks_per_push


def test_a_history_without_a_push_says_why_and_what_to_give() -> None:
    with pytest.raises(InvalidInput) as caught:
        generate(Synthetic(hours=1, pushes_per_hour=0.01))
    assert str(caught.value) == (
        "the synthetic history drew no push in its 1 h from 09:00 UTC (about 0.0095 expected "
        "at 0.01 pushes an hour at the peak): give more --hours or --pushes-per-hour, or "
        "another --seed"
    )
