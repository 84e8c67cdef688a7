"""The queue's own lags, as a recorded history shows them. Pure.

The queue makes a dependent pending a moment after its last dependency completes: its
dependency resolver polls for completions every few seconds (5 s on a real queue; none on the
emulator), so the gap is anywhere from nothing to the poll, and differs from dependent to
dependent. :func:`gaps` reads each dependent's own from the history, :func:`resolver_lag_ms`
their median, for the dependents the history never saw pending.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

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
    return [
        dataclasses.replace(t, lag_ms=own[t.task_id]) if t.task_id in own else t for t in tasks
    ]
