"""The replay's report: a table for the terminal, JSON for scripts, an HTML page for people."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jinja2

from coalescer.replay import charts
from coalescer.replay.history import History
from coalescer.replay.metrics import RuleSummary, Summary
from coalescer.replay.sheriffs import Reference


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    history: History
    summaries: tuple[Summary, ...]
    seconds: float  # how long the replay took
    #: The sheriffs' ways on one configuration's failures, shown beside the configurations.
    references: tuple[Reference, ...] = ()

    def history_json(self) -> dict[str, Any]:
        tasks = self.history.tasks
        return {
            "source": self.history.source,
            "tasks": len(tasks),
            "keys": len({k for t in tasks for k in t.keys}),
            "workers": dict(self.history.workers),
            "pools": {
                queue: {
                    "workers": n,
                    "sizedBy": self.history.sized.get(queue, "given"),
                    "curve": [
                        [(at - tasks[0].scheduled_ms) / 3_600_000, level]
                        for at, level in self.history.curves.get(queue, ())
                    ],
                }
                for queue, n in self.history.workers.items()
            },
            "hours": (tasks[-1].scheduled_ms - tasks[0].scheduled_ms) / 3_600_000,
            "recordedMakespanHours": _hours(self.history.recorded_makespan_ms()),
            "recorded": None if (seen := self.history.recorded()) is None else seen.to_json(),
            "uncheckedRuns": self.history.unchecked,
            "resolverLagSeconds": self.history.resolver_lag_ms / 1000,
            "claimWaitSeconds": self.history.claim_wait_ms / 1000,
            "holdSeconds": self.history.hold_ms / 1000,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "history": self.history_json(),
            "replaySeconds": round(self.seconds, 3),
            "configurations": [s.to_json() for s in self.summaries],
            "references": [r.to_json() for r in self.references],
        }


def _hours(ms: int | None) -> float | None:
    return None if ms is None else ms / 3_600_000


def duration(seconds: float | None) -> str:
    """``42s``, ``17m``, ``3.4h``; ``-`` when there is nothing to measure."""
    if seconds is None:
        return "-"
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


#: The table's rows: a label and how to show a summary's figure.
ROWS: tuple[tuple[str, Any], ...] = (
    ("worker-hours", lambda s: f"{s.worker_hours:,.1f}"),
    ("saved", lambda s: f"{s.saved_hours:,.1f}h {s.saved_share:.0%}" if s.saved_hours else "-"),
    ("tasks run", lambda s: f"{s.run:,}"),
    ("superseded", lambda s: f"{s.superseded:,}"),
    ("  of them canceled running", lambda s: f"{s.canceled:,}"),
    ("released, ran again", lambda s: f"{s.released:,}"),
    ("dependents never scheduled", lambda s: f"{s.never_scheduled:,}"),
    ("deadline exceeded", lambda s: f"{s.deadline_exceeded:,}"),
    ("canceled as recorded", lambda s: f"{s.withdrawn:,}"),
    ("pending p95", lambda s: duration(s.pending_p95_s)),
    ("push to result p50", lambda s: duration(s.ttr_p50_s)),
    ("push to result p95", lambda s: duration(s.ttr_p95_s)),
    ("pushes without own result", lambda s: f"{sum(k.no_own_result for k in s.keys):,}"),
    ("backlog peak", lambda s: f"{s.backlog_peak:,}"),
    ("makespan", lambda s: duration(s.makespan_hours * 3600)),
    ("wrong winners (must be 0)", lambda s: f"{s.wrong_winners}"),
    ("lost tasks (must be 0)", lambda s: f"{s.lost}"),
)


#: The row of culprits a recorded history cannot tell right or wrong (shown for those only).
UNKNOWN = "culprits unknown"

#: Rows after failed primaries, shown when the history has regressions or intermittent
#: failures, or a configuration spent extra runs.
FAILURE_ROWS: tuple[tuple[str, Any], ...] = (
    ("regressions", lambda s: f"{s.regressions:,}"),
    ("  seen failing", lambda s: f"{s.seen:,}"),
    ("  located to their push", lambda s: f"{s.located:,}"),
    ("culprits named wrongly", lambda s: f"{s.wrong_culprits:,}"),
    (UNKNOWN, lambda s: f"{s.culprits_unknown:,}"),
    ("bisections", lambda s: f"{s.bisections:,}"),
    ("extra runs", lambda s: f"{s.extra_runs:,}"),
    ("rounds, most in one search", lambda s: f"{s.rounds_most:,}"),
    ("failing run to culprit p50", lambda s: duration(s.locate_p50_s)),
    ("failing run to culprit p95", lambda s: duration(s.locate_p95_s)),
)

#: The rows a reference column (:class:`~coalescer.replay.sheriffs.Reference`) fills; the
#: others show ``-``.
REFERENCE_ROWS: dict[str, Any] = {
    "worker-hours": lambda r: f"{r.worker_hours:,.1f}",
    "regressions": lambda r: f"{r.regressions:,}",
    "  seen failing": lambda r: f"{r.seen:,}",
    "  located to their push": lambda r: f"{r.located:,}",
    "culprits named wrongly": lambda r: f"{r.wrong_culprits:,}",
    "extra runs": lambda r: f"{r.extra_runs:,}",
    "rounds, most in one search": lambda r: f"{r.rounds_most:,}",
    "failing run to culprit p50": lambda r: duration(r.locate_p50_s),
    "failing run to culprit p95": lambda r: duration(r.locate_p95_s),
}


def can_fail(history: History) -> bool:
    """Whether runs of the history can fail: regressions, intermittent or flaky failures."""
    return history.intermittent > 0 or bool(history.flaky) or any(t.broken for t in history.tasks)


def rows(report: Report) -> tuple[tuple[str, Any], ...]:
    """The table's rows for this report: :data:`ROWS`, then :data:`FAILURE_ROWS` when the
    history can fail (regressions, intermittent failures) or a configuration spent runs."""
    if can_fail(report.history) or any(s.extra_runs or s.regressions for s in report.summaries):
        recorded = report.history.is_recorded
        return ROWS + tuple(r for r in FAILURE_ROWS if recorded or r[0] != UNKNOWN)
    return ROWS


def columns(report: Report) -> list[str]:
    """The table's columns: the configurations, then the reference columns."""
    return [s.name for s in report.summaries] + [r.name for r in report.references]


def table_rows(report: Report) -> list[tuple[str, list[str]]]:
    """Each row's label and cells, the configurations' then the references' (``-`` where a
    reference has no such figure)."""
    found = []
    for label, show in rows(report):
        mine = [show(s) for s in report.summaries]
        theirs = REFERENCE_ROWS.get(label, lambda r: "-")
        found.append((label, mine + [theirs(r) for r in report.references]))
    return found


def references_line(report: Report) -> str | None:
    """Which configuration's failures the reference columns worked on."""
    if not report.references:
        return None
    names = ", ".join(r.name for r in report.references)
    return (
        f"{names}: what sheriffs do today, on the failures of {report.references[0].base} "
        "(their runs added to its own)"
    )


def recorded(history: History) -> str | None:
    """What really happened, in one line, for a recorded history."""
    seen = history.recorded()
    if seen is None:
        return None
    line = (
        f"recorded (what really happened): {seen.worker_ms / 3_600_000:,.1f} worker-hours, "
        f"{seen.run:,} tasks run, {seen.superseded:,} superseded"
    )
    if seen.cascaded:
        line += f", {seen.cascaded:,} canceled with a superseded dependency"
    if seen.canceled:
        line += f", {seen.canceled:,} canceled by a person"
    return line + f", makespan {duration(seen.makespan_ms / 1000)}"


#: How a task queue's workers were found, for the pools line (:func:`pools`).
SIZED_BY = {
    "given": "{n} (--workers)",
    "history": "{span} over time, as the history's workers came and went",
    "peak": "{n}, the peak of its recorded runs",
    "default": "{n} (--workers N)",
    "borrowed": "{n}, borrowed (it never ran)",
}


def pools(history: History) -> str | None:
    """Which workers each task queue of a recorded history was replayed with."""
    if not history.is_recorded:
        return None
    found = []
    for queue, n in sorted(history.workers.items()):
        curve = history.curves.get(queue, ())
        low = min((level for _, level in curve if level), default=n)
        span = f"{low}-{n}" if low < n else str(n)
        found.append(
            f"{queue} " + SIZED_BY[history.sized.get(queue, "given")].format(n=n, span=span)
        )
    return "workers: " + "; ".join(found)


def table(report: Report) -> str:
    """Configurations side by side (then what really happened, for a recorded history), then
    each key's push-to-result p50/p95 and pushes without a result of their own."""
    names = [s.name for s in report.summaries]
    lines = [["", *columns(report)]]
    lines += [[label, *row] for label, row in table_rows(report)]
    text = _grid(lines)
    if (line := references_line(report)) is not None:
        text += "\n" + line
    if (line := recorded(report.history)) is not None:
        text += "\n" + line
    if (line := pools(report.history)) is not None:
        text += "\n" + line
    key_rows = [["key: p50/p95 (no own result)", *names]]
    for n, key in enumerate(report.summaries[0].keys):
        cells = []
        for s in report.summaries:
            k = s.keys[n]
            cells.append(f"{duration(k.ttr_p50_s)}/{duration(k.ttr_p95_s)} ({k.no_own_result})")
        key_rows.append([key.key, *cells])
    text += "\n\n" + _grid(key_rows)
    for summary in report.summaries:
        if by_rule(summary):
            text += "\n\n" + _grid(
                [[f"rules of {summary.name}", *RULE_COLUMNS], *map(rule_cells, summary.rules)]
            )
    return text


def by_rule(summary: Summary) -> bool:
    """Whether a configuration is a policy file's, whose figures are shown per rule."""
    return summary.name.startswith("policy ")


RULE_COLUMNS = (
    "tasks",
    "run",
    "superseded",
    "canceled",
    "never scheduled",
    "worker-hours",
    "saved",
    "push to result p50/p95",
    "no own result",
)


def rule_cells(rule: RuleSummary) -> list[str]:
    """A rule's row: its name and strategy, then :data:`RULE_COLUMNS`."""
    return [
        f"{rule.rule} ({rule.strategy})",
        f"{rule.tasks:,}",
        f"{rule.run:,}",
        f"{rule.superseded:,}",
        f"{rule.canceled:,}",
        f"{rule.never_scheduled:,}",
        f"{rule.worker_hours:,.1f}",
        f"{rule.saved_hours:,.1f}h" if rule.saved_hours else "-",
        f"{duration(rule.ttr_p50_s)}/{duration(rule.ttr_p95_s)}",
        f"{rule.no_own_result:,}",
    ]


def _grid(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [
            row[0].ljust(widths[0]),
            *(v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)),
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


_env = jinja2.Environment(
    loader=jinja2.ChoiceLoader(
        [
            jinja2.PackageLoader("coalescer.replay", "templates"),
            jinja2.PackageLoader("coalescer", "templates"),  # charts.html
        ]
    ),
    autoescape=True,
    trim_blocks=True,
    lstrip_blocks=True,
    undefined=jinja2.StrictUndefined,
)


def html(report: Report) -> str:
    bars_plot, bars = charts.worker_hours(report.summaries)
    return _env.get_template("report.html").render(
        report=report,
        history=report.history_json(),
        recorded=recorded(report.history),
        columns=columns(report),
        rows=table_rows(report),
        references=references_line(report),
        rule_tables=[
            (s.name, [rule_cells(r) for r in s.rules]) for s in report.summaries if by_rule(s)
        ],
        rule_columns=RULE_COLUMNS,
        backlog=charts.backlog(report.summaries),
        ttr=charts.time_to_result(report.summaries),
        bars_plot=bars_plot,
        bars=bars,
        colours=charts.COLOURS,
        duration=duration,
    )
