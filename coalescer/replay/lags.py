"""The queue's own lags, as a recorded history shows them. Pure.

Claims: a worker waiting in ``claimWork`` is answered at the queue's next poll of its pending
tasks (every second on a real queue), so a task that becomes pending while a worker waits is
claimed anywhere from at once to a second later; one pending when a worker asks is claimed at
once. :func:`claim_waits` reads each such wait from the history.

The queue makes a dependent pending a moment after its last dependency completes: its
dependency resolver polls for completions every few seconds (5 s on a real queue; none on the
emulator), so the gap is anywhere from nothing to the poll, and differs from dependent to
dependent. :func:`gaps` reads each dependent's own from the history, :func:`resolver_lag_ms`
their median, for the dependents the history never saw pending.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise

from coalescer.replay.history import TaskSpec, percentile


def gaps(tasks: Sequence[TaskSpec], pending_ms: Mapping[str, int]) -> dict[str, int]:
    """Each dependent's gap between the completion of its last dependency and the moment its
    first run became pending (``pending_ms``, by taskId), for the dependents whose
    dependencies all completed in the history (recorded events give no dependencies)."""
    done = {t.task_id: t.resolved_ms for t in tasks if t.outcome == "completed" and t.resolved_ms}
    found = {}
    for t in tasks:
        if not t.dependencies or t.task_id not in pending_ms:
            continue
        if all(d in done for d in t.dependencies):
            gap = pending_ms[t.task_id] - max(done[d] for d in t.dependencies)
            if gap >= 0:
                found[t.task_id] = gap
    return found


def resolver_lag_ms(tasks: Sequence[TaskSpec], pending_ms: Mapping[str, int]) -> int:
    """The median of :func:`gaps`; 0 when none shows one."""
    return int(percentile(list(gaps(tasks, pending_ms).values()), 0.5) or 0)


def with_gaps(tasks: Sequence[TaskSpec], pending_ms: Mapping[str, int]) -> list[TaskSpec]:
    """``tasks``, each dependent with its own gap as its ``lag_ms``."""
    own = gaps(tasks, pending_ms)
    return [dataclasses.replace(t, lag_ms=own[t.task_id]) if t.task_id in own else t for t in tasks]


#: A run as :func:`claim_waits` reads it: its task, its worker (task queue and name), when
#: it became pending, started and resolved (``None``: not yet).
Run = tuple[str, tuple[str, str], int, int, int | None]


def claim_waits(runs: Iterable[Run]) -> dict[str, int]:
    """Each task's wait between becoming pending and being claimed, for the runs that became
    pending while their worker was idle (its previous run had resolved): the first such run
    of each task. A worker's first run is not one: nothing says since when it waited."""
    by_worker: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in runs:
        by_worker[run[1]].append(run)
    found: dict[str, int] = {}
    for own in by_worker.values():
        own.sort(key=lambda r: r[3])
        for before, run in pairwise(own):
            task_id, _, pending, started, _ = run
            if before[4] is not None and before[4] <= pending <= started:
                found.setdefault(task_id, started - pending)
    return found


def with_waits(tasks: Sequence[TaskSpec], waits: Mapping[str, int]) -> list[TaskSpec]:
    """``tasks``, each with its recorded claim wait as its ``wait_ms``."""
    return [
        dataclasses.replace(t, wait_ms=waits[t.task_id]) if t.task_id in waits else t for t in tasks
    ]
