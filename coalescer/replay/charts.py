"""Chart geometry for the HTML report: plain numbers the template draws as SVG. Pure.

Three charts: the backlog over time (a line per configuration), worker-hours (a bar each) and
the time from a push to its result (a cumulative distribution per configuration).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from coalescer.replay.metrics import Summary

WIDTH, HEIGHT = 720, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 12, 36
#: Colour-blind-safe (Okabe-Ito), one per configuration.
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")


@dataclasses.dataclass(frozen=True, slots=True)
class Tick:
    at: float  # pixels along the axis
    label: str


@dataclasses.dataclass(frozen=True, slots=True)
class Line:
    name: str
    colour: str
    points: str  # SVG polyline points


@dataclasses.dataclass(frozen=True, slots=True)
class Bar:
    name: str
    colour: str
    y: float
    width: float
    label: str


@dataclasses.dataclass(frozen=True, slots=True)
class Plot:
    x_ticks: tuple[Tick, ...]
    y_ticks: tuple[Tick, ...]
    x_label: str
    y_label: str
    lines: tuple[Line, ...] = ()
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    bottom: float = HEIGHT - BOTTOM
    right: float = WIDTH - RIGHT


def nice_step(span: float, count: int = 5) -> float:
    """A 1-2-5 step that cuts ``span`` into about ``count`` pieces."""
    if span <= 0:
        return 1.0
    raw = span / count
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1.0, 2.0, 5.0, 10.0) if m * power >= raw)


def _ticks(top: float, scale: float, origin: float, fmt: str, sign: int) -> tuple[Tick, ...]:
    step = nice_step(top)
    count = int(top / step + 1e-9)
    return tuple(
        Tick(origin + sign * i * step * scale, format(i * step, fmt)) for i in range(count + 1)
    )


def _frame(x_max: float, y_max: float) -> tuple[float, float]:
    """Pixels per unit on each axis."""
    return (WIDTH - LEFT - RIGHT) / (x_max or 1), (HEIGHT - TOP - BOTTOM) / (y_max or 1)


def backlog(summaries: Sequence[Summary]) -> Plot:
    x_max = max((s.backlog[-1][0] for s in summaries if s.backlog), default=1.0) or 1.0
    y_max = float(max((s.backlog_peak for s in summaries), default=1) or 1)
    y_max = nice_step(y_max) * math.ceil(y_max / nice_step(y_max))
    sx, sy = _frame(x_max, y_max)
    lines = tuple(
        Line(
            s.name,
            COLOURS[n % len(COLOURS)],
            " ".join(f"{LEFT + h * sx:.1f},{HEIGHT - BOTTOM - v * sy:.1f}" for h, v in s.backlog),
        )
        for n, s in enumerate(summaries)
    )
    return Plot(
        x_ticks=_ticks(x_max, sx, LEFT, "g", 1),
        y_ticks=_ticks(y_max, sy, HEIGHT - BOTTOM, "g", -1),
        x_label="hours since the first task",
        y_label="pending tasks",
        lines=lines,
    )


def time_to_result(summaries: Sequence[Summary]) -> Plot:
    """The share of pushes with a result within x hours, per configuration."""
    x_max = max((max(s.ttr_s, default=0) for s in summaries), default=0) / 3600 or 1.0
    sx, sy = _frame(x_max, 100)
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
        x_ticks=_ticks(x_max, sx, LEFT, "g", 1),
        y_ticks=_ticks(100, sy, HEIGHT - BOTTOM, "g", -1),
        x_label="hours from a push to a result at least as new",
        y_label="% of pushes",
        lines=tuple(lines),
    )


def worker_hours(summaries: Sequence[Summary]) -> tuple[Plot, tuple[Bar, ...]]:
    """Horizontal bars, one per configuration, with their height in the plot."""
    top = max((s.worker_hours for s in summaries), default=1.0) or 1.0
    top = nice_step(top) * math.ceil(top / nice_step(top))
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
        x_ticks=_ticks(top, scale, left, ",g", 1),
        y_ticks=(),
        x_label="worker-hours",
        y_label="",
        height=height,
        left=left,
        bottom=height - BOTTOM,
        right=left + top * scale,
    )
    return plot, bars
