"""The pages' charts say their figures as a reader would, and tell the live count apart from
the sampled one."""

from __future__ import annotations

import pytest

from coalescer import history
from coalescer.history import Retention, Series
from coalescer.web.activity import _span, key_chart, overview_charts


@pytest.mark.parametrize(
    ("ms", "said"),
    [
        (5_000, "5 s"),
        (90_000, "90 s"),
        (154_800, "3 min"),
        (3_600_000, "60 min"),
        (86_400_000, "24 h"),
    ],
)
def test_durations_are_rounded_to_what_a_reader_says(ms: int, said: str) -> None:
    assert _span(ms) == said


def _series(name: str, points: list[tuple[int, float | None]]) -> Series:
    return Series(name, tuple(points))


def test_the_sampled_pending_chart_says_the_tile_counts_now() -> None:
    retention = Retention(5_000, 1440)
    points: list[tuple[int, float | None]] = [
        (i * 5_000, float(i)) for i in range(31)
    ]  # 2.58 min of samples
    found = {
        name: _series(name, points)
        for name in (history.PENDING, history.SUPERSEDED, history.SAVED_MS, history.ANSWERS)
    }
    pending, superseded, _, answers = overview_charts(found, retention)
    assert answers.summary.endswith("in the last 3 min"), answers.summary
    assert "the tile above counts them now" in pending.note
    assert superseded.summary.endswith("in the last 3 min"), superseded.summary
    assert "the tile above counts them now" in key_chart(found, retention).note
