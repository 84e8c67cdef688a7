"""The soak's report: ``report.json`` (everything), ``report.html`` (the figures, the fault
timeline as a chart, the violations); the violations are printed too."""

from __future__ import annotations

import dataclasses
import html
import json
import time
from collections import Counter
from typing import Any, Protocol

from tests.soak.checker import Findings, percentile
from tests.soak.config import Config
from tests.soak.faults import Faults
from tests.soak.load import Prober, Pusher


class Soak(Protocol):
    """What the report reads of a soak that ran (``tests.soak.runner.Soak``)."""

    config: Config
    faults: Faults
    findings: Findings
    prober: Prober
    pusher: Pusher
    bursts: list[tuple[float, float]]
    samples: list[tuple[float, str, int, int]]
    notes: list[str]
    t0: float
    ended: float


#: faults during which a slow or failed query is expected (the store's, serve killed): the
#: burst p99 leaves them out
DISRUPTIVE = ("redis-", "cluster-", "sigkill serve")


def figures(soak: Soak) -> dict[str, Any]:
    faults = soak.faults.log
    probes = soak.prober.probes

    def disrupted(at: float) -> bool:
        return any(
            f"{f.kind} {f.detail}".startswith(DISRUPTIVE) and f.start - 1 <= at <= (f.end or at) + 5
            for f in faults
        )

    in_bursts = [
        p.seconds
        for p in probes
        if p.status == 200 and any(a <= p.at <= b for a, b in soak.bursts) and not disrupted(p.at)
    ]
    answered = [p.seconds for p in probes if p.status == 200]
    undisturbed = [p for p in probes if not disrupted(p.at)]
    p99 = percentile(in_bursts, 0.99)
    return {
        "duration s": soak.config.duration,
        "store": soak.config.store,
        "seed": soak.config.seed,
        "faults by kind": dict(Counter(f.kind for f in faults)),
        "faults": len(faults),
        "tasks": len(soak.pusher.tasks),
        "task creations failed": soak.pusher.failed,
        "events published": soak.findings.counts.get("events published"),
        "queries": len(probes),
        "query answers": dict(Counter(str(p.status) for p in probes)),
        "query p99 ms in bursts": None if p99 is None else round(p99 * 1000, 1),
        "query p50 ms in bursts": _ms(percentile(in_bursts, 0.5)),
        "query p99 ms overall": _ms(percentile(answered, 0.99)),
        "queries unanswered outside store faults and serve kills": sum(
            1 for p in undisturbed if p.status != 200
        ),
        "burst probes": len(in_bursts),
        "peak RSS MiB": {k: round(v / 2**20, 1) for k, v in getattr(soak, "peak", {}).items()},
        "bad input sent": {
            "requests": soak.faults.sent.bad_requests,
            "answers": soak.faults.sent.bad_answers,
            "invalid Pulse": soak.faults.sent.bad_pulse,
            "flood tasks": len(soak.faults.sent.flood_tasks),
        },
        **soak.findings.counts,
        "violations": len(soak.findings.violations),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def write(soak: Soak, started: float) -> int:
    out = soak.config.report_dir
    summary = figures(soak)
    body = {
        "summary": summary,
        "timeline": [
            dataclasses.asdict(f) | {"at": round(f.start - soak.t0, 1)} for f in soak.faults.log
        ],
        "violations": [dataclasses.asdict(v) for v in soak.findings.violations],
        "notes": soak.notes,
        "memory": [
            {"t": round(t - soak.t0, 1), "name": n, "pid": p, "rss": r}
            for t, n, p, r in soak.samples
        ],
        "wall s": round(time.time() - started, 1),
    }
    (out / "report.json").write_text(json.dumps(body, indent=2, default=str))
    (out / "report.html").write_text(_html(soak, summary, body))
    print(json.dumps(summary, indent=2, default=str))
    for note in soak.notes:
        print(f"note: {note}")
    by_invariant: dict[str, list[str]] = {}
    for v in soak.findings.violations:
        by_invariant.setdefault(v.invariant, []).append(v.detail)
    for invariant, details in by_invariant.items():  # the first few of each; all in report.json
        print(f"VIOLATED {len(details)} times: {invariant}")
        for detail in details[:5]:
            print(f"  - {detail[-800:]}")
    print(f"report: {out / 'report.html'}")
    return 1 if soak.findings.violations else 0


def _html(soak: Soak, summary: dict[str, Any], body: dict[str, Any]) -> str:
    span = max(1.0, soak.ended - soak.t0)
    width, row = 900, 18
    kinds = sorted({f.kind for f in soak.faults.log})
    bars = []
    for f in soak.faults.log:
        x = (f.start - soak.t0) / span * width
        w = max(2.0, ((f.end or f.start) - f.start) / span * width)
        y = kinds.index(f.kind) * row
        bars.append(
            f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 4}" fill="#c33">'
            f"<title>{html.escape(f.kind)} at {f.start - soak.t0:.1f} s: "
            f"{html.escape(f.detail)}</title></rect>"
        )
    labels = [
        f'<text x="{width + 6}" y="{i * row + 12}" font-size="11">{html.escape(k)}</text>'
        for i, k in enumerate(kinds)
    ]
    for a, b in soak.bursts:
        bars.append(
            f'<rect x="{(a - soak.t0) / span * width:.1f}" y="0" '
            f'width="{max(2.0, (b - a) / span * width):.1f}" height="{len(kinds) * row}" '
            'fill="#36c" opacity="0.12"><title>ingest burst</title></rect>'
        )
    chart = (
        f'<svg width="{width + 160}" height="{len(kinds) * row + 4}">'
        + "".join(bars + labels)
        + "</svg>"
    )
    memory = _memory_chart(soak, span, width)
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(json.dumps(v, default=str))}</td></tr>"
        for k, v in summary.items()
    )
    timeline = "".join(
        f"<tr><td>{e['at']}</td><td>{html.escape(e['kind'])}</td>"
        f"<td>{html.escape(e['detail'])}</td></tr>"
        for e in body["timeline"]
    )
    violations = (
        "".join(
            f"<li><b>{html.escape(v.invariant)}</b>: <pre>{html.escape(v.detail)}</pre></li>"
            for v in soak.findings.violations
        )
        or "<li>none</li>"
    )
    return (
        "<!doctype html><meta charset=utf-8><title>coalescer chaos soak</title>"
        "<style>body{font:14px sans-serif;margin:2em}td,th{text-align:left;padding:2px 8px;"
        "vertical-align:top}pre{white-space:pre-wrap;margin:0}</style>"
        f"<h1>Chaos soak: {summary['violations']} violations</h1>"
        f"<h2>Faults over time (blue: ingest bursts)</h2>{chart}"
        f"<h2>Resident memory (MiB; a line per process life)</h2>{memory}"
        f"<h2>Figures</h2><table>{rows}</table><h2>Violations</h2><ul>{violations}</ul>"
        f"<h2>Timeline (s from start)</h2><table>{timeline}</table>"
    )


def _memory_chart(soak: Soak, span: float, width: int, height: int = 160) -> str:
    lives: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for t, name, pid, rss in soak.samples:
        if rss:
            lives.setdefault((name, pid), []).append((t - soak.t0, rss))
    top = max((rss for life in lives.values() for _, rss in life), default=1) * 1.1
    colours = {"serve": "#c33", "listen-1": "#36c", "listen-2": "#39c", "enforce-1": "#393"}
    lines = []
    for (name, _), life in lives.items():
        points = " ".join(
            f"{t / span * width:.1f},{height - rss / top * height:.1f}" for t, rss in life
        )
        lines.append(
            f'<polyline points="{points}" fill="none" stroke="{colours.get(name, "#666")}">'
            f"<title>{html.escape(name)}</title></polyline>"
        )
    legend = "".join(
        f'<text x="{width + 6}" y="{12 + i * 14}" font-size="11" fill="{c}">{html.escape(n)}</text>'
        for i, (n, c) in enumerate(colours.items())
    )
    scale = f'<text x="0" y="10" font-size="10">{top / 2**20:.0f}</text>'
    return f'<svg width="{width + 160}" height="{height}">{"".join(lines)}{legend}{scale}</svg>'
