"""The queue's own lags, as a recorded history shows them. Pure.

The queue makes a dependent pending a moment after its last dependency completes (its
dependency resolver works through the completions in the background: 1 to 5 seconds on a real
queue, none on the emulator). :func:`resolver_lag_ms` reads that moment from the history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from coalescer.replay.history import TaskSpec, percentile


def resolver_lag_ms(tasks: Sequence[TaskSpec], pending_ms: Mapping[str, int]) -> int:
    """The median gap between the completion of a dependent's last dependency and the moment
    the dependent's first run became pending (``pending_ms``, by taskId), over the dependents
    whose dependencies all completed in the history; 0 when none shows one (recorded events,
    which give no dependencies)."""
    done = {t.task_id: t.resolved_ms for t in tasks if t.outcome == "completed" and t.resolved_ms}
    gaps = []
    for t in tasks:
        if not t.dependencies or t.task_id not in pending_ms:
            continue
        if all(d in done for d in t.dependencies):
            gap = pending_ms[t.task_id] - max(done[d] for d in t.dependencies)
            if gap >= 0:
                gaps.append(gap)
    return int(percentile(gaps, 0.5) or 0)
