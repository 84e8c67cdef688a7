"""Chart geometry for the HTML report, on :mod:`coalescer.charts`. Pure.

Three charts: the backlog over time (a line per configuration), worker-hours (a bar each) and
the time from a push to its result (a cumulative distribution per configuration).
"""

from __future__ import annotations

from collections.abc import Sequence

from coalescer.charts import (
    BOTTOM,
    COLOURS,
    HEIGHT,
    LEFT,
    RIGHT,
    TOP,
    WIDTH,
    Bar,
    Line,
    Plot,
    frame,
    nice_top,
    ticks,
)
from coalescer.replay.metrics import Summary

__all__ = ["COLOURS", "backlog", "time_to_result", "worker_hours"]


def backlog(summaries: Sequence[Summary]) -> Plot:
    x_max = max((s.backlog[-1][0] for s in summaries if s.backlog), default=1.0) or 1.0
    y_max = nice_top(float(max((s.backlog_peak for s in summaries), default=1) or 1))
    sx, sy = frame(x_max, y_max)
    lines = tuple(
        Line(
            s.name,
            COLOURS[n % len(COLOURS)],
            " ".join(f"{LEFT + h * sx:.1f},{HEIGHT - BOTTOM - v * sy:.1f}" for h, v in s.backlog),
        )
        for n, s in enumerate(summaries)
    )
    return Plot(
        x_ticks=ticks(x_max, sx, LEFT, "g", 1),
        y_ticks=ticks(y_max, sy, HEIGHT - BOTTOM, "g", -1),
        x_label="hours since the first task",
        y_label="pending tasks",
        lines=lines,
    )


def time_to_result(summaries: Sequence[Summary]) -> Plot:
    """The share of pushes with a result within x hours, per configuration."""
    x_max = max((max(s.ttr_s, default=0) for s in summaries), default=0) / 3600 or 1.0
    sx, sy = frame(x_max, 100)
    lines = []
    for n, s in enumerate(summaries):
        values = sorted(s.ttr_s)
        if not values:
            continue
        # At most ~300 steps: every k-th value of the sorted list.
        k = max(1, len(values) // 300)
        picks = [*range(0, len(values), k), len(values) - 1]
        points = [f"{LEFT:.1f},{HEIGHT - BOTTOM:.1f}"]
        for i in picks:
            x = LEFT + values[i] / 3600 * sx
            points.append(f"{x:.1f},{HEIGHT - BOTTOM - (i + 1) / len(values) * 100 * sy:.1f}")
        lines.append(Line(s.name, COLOURS[n % len(COLOURS)], " ".join(points)))
    return Plot(
        x_ticks=ticks(x_max, sx, LEFT, "g", 1),
        y_ticks=ticks(100, sy, HEIGHT - BOTTOM, "g", -1),
        x_label="hours from a push to a result at least as new",
        y_label="% of pushes",
        lines=tuple(lines),
    )


def worker_hours(summaries: Sequence[Summary]) -> tuple[Plot, tuple[Bar, ...]]:
    """Horizontal bars, one per configuration, with their height in the plot."""
    top = nice_top(max((s.worker_hours for s in summaries), default=1.0) or 1.0)
    left = 180
    scale = (WIDTH - left - RIGHT - 150) / top
    bars = tuple(
        Bar(
            s.name,
            COLOURS[n % len(COLOURS)],
            TOP + n * 34,
            s.worker_hours * scale,
            f"{s.worker_hours:,.0f} h"
            + (f" (saves {s.saved_share:.0%})" if s.saved_hours > 0 else ""),
        )
        for n, s in enumerate(summaries)
    )
    height = int(TOP + len(summaries) * 34 + BOTTOM)
    plot = Plot(
        x_ticks=ticks(top, scale, left, ",g", 1),
        y_ticks=(),
        x_label="worker-hours",
        y_label="",
        height=height,
        left=left,
        bottom=height - BOTTOM,
        right=left + top * scale,
    )
    return plot, bars
