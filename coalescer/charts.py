"""Chart geometry: plain numbers that templates draw as inline SVG (``templates/charts.html``
holds the one drawing of axes). Pure.

Used by the replay's report (:mod:`coalescer.replay.charts`) and by the service's pages, whose
charts show a history over time (:func:`timeline`).
"""

from __future__ import annotations

import dataclasses
import math
from datetime import UTC, datetime

from coalescer.history import Series, rebin

WIDTH, HEIGHT = 720, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 12, 36
#: Colour-blind-safe (Okabe-Ito), one per configuration.
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
#: A timeline draws at most this many points or bars (buckets are merged to fit).
MAX_POINTS = 120
#: Time steps for a timeline's x axis, in minutes.
_TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 180, 360, 720, 1440)


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
class Column:
    """A vertical bar of a timeline: one (merged) bucket."""

    x: float
    y: float
    width: float
    height: float
    title: str


@dataclasses.dataclass(frozen=True, slots=True)
class Dot:
    """A point of a line with no neighbour to join (a polyline of one point draws nothing)."""

    x: float
    y: float
    colour: str


@dataclasses.dataclass(frozen=True, slots=True)
class Plot:
    x_ticks: tuple[Tick, ...]
    y_ticks: tuple[Tick, ...]
    x_label: str
    y_label: str
    lines: tuple[Line, ...] = ()
    columns: tuple[Column, ...] = ()
    dots: tuple[Dot, ...] = ()
    colour: str = COLOURS[0]
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


def nice_top(value: float) -> float:
    """``value`` rounded up to a whole :func:`nice_step` (1 for nothing)."""
    if value <= 0:
        return 1.0
    return nice_step(value) * math.ceil(value / nice_step(value))


def ticks(
    top: float, scale: float, origin: float, fmt: str, sign: int, *, whole: bool = False
) -> tuple[Tick, ...]:
    """Ticks along an axis of ``top`` units; ``whole``: at whole numbers only (counts)."""
    step = max(1.0, nice_step(top)) if whole else nice_step(top)
    count = int(top / step + 1e-9)
    return tuple(
        Tick(origin + sign * i * step * scale, format(i * step, fmt)) for i in range(count + 1)
    )


def frame(x_max: float, y_max: float) -> tuple[float, float]:
    """Pixels per unit on each axis."""
    return (WIDTH - LEFT - RIGHT) / (x_max or 1), (HEIGHT - TOP - BOTTOM) / (y_max or 1)


def clock(ms: int) -> str:
    """``14:05`` (UTC), for a time axis."""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%H:%M")


def _time_ticks(t0: int, t1: int, scale: float) -> tuple[Tick, ...]:
    span_min = (t1 - t0) / 60_000
    step = next((s for s in _TIME_STEPS if s * 6 >= span_min), _TIME_STEPS[-1]) * 60_000
    first = -(-t0 // step) * step
    room = WIDTH - RIGHT - 14  # a label centred further right would be cut off
    return tuple(
        Tick(LEFT + (at - t0) * scale, clock(at))
        for at in range(first, t1 + 1, step)
        if LEFT + (at - t0) * scale <= room
    )


def timeline(
    series: Series,
    bucket_ms: int,
    *,
    y_label: str,
    bars: bool,
    scale: float = 1.0,
    unit: str = "",
    colour: str = COLOURS[0],
) -> Plot:
    """One series over time: a line (a gauge) or a bar per bucket (a count), its values
    multiplied by ``scale``; buckets merged so that at most :data:`MAX_POINTS` are drawn."""
    width = max(1, math.ceil(len(series.points) / MAX_POINTS))
    merged = rebin(series, width)
    span = bucket_ms * width
    t0 = merged.points[0][0] if merged.points else 0
    t1 = (merged.points[-1][0] + span) if merged.points else span
    values = [None if v is None else v * scale for _, v in merged.points]
    y_max = nice_top(max((v for v in values if v is not None), default=0.0))
    sx, sy = (WIDTH - LEFT - RIGHT) / (t1 - t0), (HEIGHT - TOP - BOTTOM) / y_max
    bottom = HEIGHT - BOTTOM
    lines: list[Line] = []
    columns: list[Column] = []
    dots: list[Dot] = []
    segment: list[tuple[float, float]] = []

    def end_segment() -> None:
        if len(segment) == 1:
            dots.append(Dot(*segment[0], colour))
        elif segment:
            lines.append(
                Line(series.name, colour, " ".join(f"{x:.1f},{y:.1f}" for x, y in segment))
            )
        segment.clear()

    for (at, _), value in zip(merged.points, values, strict=True):
        if bars:
            if value:
                h = value * sy
                title = f"{clock(at)} to {clock(at + span)} UTC: {value:,.4g}{unit}"
                x = LEFT + (at - t0) * sx
                columns.append(Column(x, bottom - h, max(1.0, span * sx - 1), h, title))
            continue
        if value is None:
            end_segment()
        else:
            segment.append((LEFT + (at + span / 2 - t0) * sx, bottom - value * sy))
    end_segment()
    return Plot(
        x_ticks=_time_ticks(t0, t1, sx),
        y_ticks=ticks(y_max, sy, bottom, ",g", -1, whole=scale == 1.0),
        x_label=f"time (UTC), {_per(span)}" if bars else "time (UTC)",
        y_label=y_label,
        lines=tuple(lines),
        columns=tuple(columns),
        dots=tuple(dots),
        colour=colour,
    )


def _per(span_ms: int) -> str:
    seconds = span_ms // 1000
    if seconds % 3600 == 0:
        return f"per {seconds // 3600} h" if seconds > 3600 else "per hour"
    if seconds % 60 == 0:
        return f"per {seconds // 60} min" if seconds > 60 else "per minute"
    return f"per {seconds} s"
