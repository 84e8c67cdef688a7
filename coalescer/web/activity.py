"""The pages' charts of activity over time: the history (:mod:`coalescer.history`) read from
the store and laid out as plots (:mod:`coalescer.charts`), drawn by ``charts.html``."""

from __future__ import annotations

import dataclasses

from coalescer import charts, history
from coalescer.history import Retention, Series
from coalescer.store import Store
from coalescer.store import history as stored_history


@dataclasses.dataclass(frozen=True, slots=True)
class Chart:
    series: str  # the history series drawn (``data-series`` of the SVG)
    title: str
    summary: str  # a figure over the window shown, beside the title
    note: str
    plot: charts.Plot


def _span(ms: int) -> str:
    """A duration as a reader says it: ``90 s``, ``3 min`` (not ``2.58 min``), ``24 h``."""
    if ms < 120_000:
        return f"{round(ms / 1000)} s"
    if ms < 7_200_000:
        return f"{round(ms / 60_000)} min"
    return f"{round(ms / 3_600_000)} h"


def _duration(ms: float) -> tuple[float, str]:
    """The scale and unit to show ``ms`` of worker time in."""
    if ms >= 2 * 3_600_000:
        return 1 / 3_600_000, " h"
    if ms >= 2 * 60_000:
        return 1 / 60_000, " min"
    return 1 / 1000, " s"


def overview_charts(found: dict[str, Series], retention: Retention) -> list[Chart]:
    """Pending tasks, tasks superseded, worker time saved and answers, over every key."""
    pending, superseded = found[history.PENDING], found[history.SUPERSEDED]
    saved, answers = found[history.SAVED_MS], found[history.ANSWERS]
    window = _span(len(pending.points) * retention.bucket_ms)
    width = retention.bucket_ms
    colours = charts.COLOURS
    peak = max((v for _, v in saved.points if v), default=0.0)
    scale, unit = _duration(peak)
    total_scale, total_unit = _duration(saved.total)
    latest = pending.latest
    return [
        Chart(
            history.PENDING,
            "Pending tasks",
            f"latest sample {latest:,.0f}" if latest is not None else "not sampled yet",
            "Over every key, as the background upkeep counts them (about every 15 s): the "
            "tile above counts them now, so the two differ while tasks come and go.",
            charts.timeline(pending, width, y_label="pending tasks", bars=False, colour=colours[0]),
        ),
        Chart(
            history.SUPERSEDED,
            "Tasks superseded",
            f"{superseded.total:,.0f} in the last {window}",
            "Resolutions exception/superseded the service applied, by when they were resolved.",
            charts.timeline(
                superseded, width, y_label="tasks superseded", bars=True, colour=colours[3]
            ),
        ),
        Chart(
            history.SAVED_MS,
            "Worker time saved",
            f"{saved.total * total_scale:,.3g}{total_unit} in the last {window}",
            "An estimate: each superseded task counts the median run time of its key's recent "
            "completed or failed runs that this service saw (a key with none yet counts "
            "nothing).",
            charts.timeline(
                saved,
                width,
                y_label=f"worker time ({unit.strip()})",
                bars=True,
                scale=scale,
                unit=unit,
                colour=colours[2],
            ),
        ),
        Chart(
            history.ANSWERS,
            "Answers",
            f"{answers.total:,.0f} in the last {window}",
            "Superseding queries answered, every reason (superseding, alone, unknown task).",
            charts.timeline(answers, width, y_label="answers", bars=True, colour=colours[1]),
        ),
    ]


def key_chart(found: dict[str, Series], retention: Retention) -> Chart:
    """A key's pending tasks over time."""
    pending = found[history.PENDING]
    keyed = retention.per_key()
    latest = pending.latest
    return Chart(
        history.PENDING,
        "Pending tasks",
        f"latest sample {latest:,.0f}" if latest is not None else "not sampled yet",
        f"As the background upkeep counts them, one point per {_span(keyed.bucket_ms)} "
        f"(the last {_span(keyed.span_ms)} at most); the tile above counts them now, so the "
        "two differ while tasks come and go.",
        charts.timeline(pending, keyed.bucket_ms, y_label="pending tasks", bars=False),
    )


async def for_overview(store: Store, retention: Retention, now_ms: int) -> list[Chart]:
    return overview_charts(await stored_history.read(store, retention, now_ms=now_ms), retention)


async def for_key(store: Store, retention: Retention, key: str, now_ms: int) -> Chart:
    found = await stored_history.read(store, retention, now_ms=now_ms, key=key)
    return key_chart(found, retention)
