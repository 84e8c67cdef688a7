"""The real work of the worker shim's searches. Pure.

A worker that bisects after a failed primary (``--on-primary-failure bisect``) keeps the
claims of the pushes it held and runs them one after another: on the queue, each such run
starts when the worker first claimed it and resolves when the search ends, so its span says
nothing of its work. The finding the worker reports (``POST /v1/bisections``) lists the runs
in the order they ran, each with its end: each began when the one before it ended, the first
(the primary's failing run) when the worker claimed it. :func:`apply` gives those tasks their
own runs instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from coalescer.model import parse_time_ms
from coalescer.replay.history import TaskSpec

#: A finding's ``by`` when a worker shim ran the search (the enforcer's probes are tasks'
#: own runs on the queue, already read as such).
WORKER = "worker "


def spans(findings: Iterable[Mapping[str, Any]]) -> dict[str, list[tuple[int, int]]]:
    """Each task's own runs in the workers' searches, ``(start, end)`` in order; the first
    run of a search starts at -1 (when its worker claimed it: not in the finding)."""
    found: dict[str, list[tuple[int, int]]] = {}
    for finding in findings:
        if not str(finding.get("by", "")).startswith(WORKER):
            continue
        start = -1
        for run in finding.get("runs") or ():
            if not run.get("ended"):
                break  # the search stopped here: what followed did not run
            end = parse_time_ms(run["ended"])
            found.setdefault(str(run["taskId"]), []).append((start, end))
            start = end
    return found


def apply(tasks: Sequence[TaskSpec], findings: Iterable[Mapping[str, Any]]) -> list[TaskSpec]:
    """``tasks`` with the runs of the workers' searches as their real runs, and the first of
    them as the duration the replay gives them."""
    own = spans(findings)
    found = []
    for t in tasks:
        if (runs := own.get(t.task_id)) and t.started_ms:
            real = tuple((t.started_ms if s < 0 else s, e) for s, e in runs)
            first = real[0][1] - real[0][0]
            t = dataclasses.replace(t, real_runs=real, duration_ms=first)
        found.append(t)
    return found
