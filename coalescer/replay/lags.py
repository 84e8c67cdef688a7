"""The queue's own lags, as a recorded history shows them. Pure.

Claims: a worker waiting in ``claimWork`` is answered at the queue's next poll of its pending
tasks (every second on a real queue), so a task that becomes pending while a worker waits is
claimed anywhere from at once to a second later; one pending when a worker asks is claimed at
once. :func:`claim_waits` reads each such wait from the history. A worker shim that claims a
task asks the service and claims what it lists before it runs the newest: :func:`hold_times`
reads how long that took.

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
from typing import NamedTuple

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


class Run(NamedTuple):
    """A run a worker of the pool started, as :func:`claim_waits` and :func:`hold_times` read
    it."""

    task_id: str
    run_id: int
    keys: tuple[str, ...]
    #: Its task queue and the worker's ``workerGroup/workerId``.
    worker: tuple[str, str]
    pending: int
    started: int
    resolved: int | None
    #: How it resolved (``reasonResolved``; ``""``: not yet).
    reason: str = ""


def _by_worker(runs: Iterable[Run]) -> list[list[Run]]:
    found: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in runs:
        found[run.worker].append(run)
    return [sorted(own, key=lambda r: r.started) for own in found.values()]


def claim_waits(runs: Iterable[Run]) -> list[tuple[str, int, int, bool]]:
    """Each run's wait to be claimed once its worker could claim it, for the runs begun after
    their worker's previous run resolved, as ``(taskId, runId, wait, polled)``: from becoming
    pending, when the worker was waiting in ``claimWork`` then (``polled``: the queue answers
    at its next poll), else from that previous run's resolution (the worker's own time to
    resolve, claim and ask). A worker's first run is not one: nothing says since when it
    waited."""
    found = []
    for own in _by_worker(runs):
        for before, run in pairwise(own):
            if before.resolved is None or before.resolved > run.started:
                continue
            polled = run.pending >= before.resolved
            since = run.pending if polled else before.resolved
            found.append((run.task_id, run.run_id, run.started - since, polled))
    return found


def hold_times(runs: Iterable[Run]) -> dict[str, int]:
    """Each primary's time between its worker's first claim and its own run: a worker shim
    that claimed a task asks the service, claims what the answer lists and runs the newest,
    so the run it executes starts after the claims of the tasks of its key it holds (their
    runs, begun before it and still unresolved when it starts), for the runs that did their
    work (resolved ``completed`` or ``failed``)."""
    found: dict[str, int] = {}
    for own in _by_worker(runs):
        for n, run in enumerate(own):
            if run.reason not in ("completed", "failed"):
                continue
            held = [
                r.started
                for r in own[:n]
                if r.task_id != run.task_id
                and set(r.keys) & set(run.keys)
                and (r.resolved is None or r.resolved > run.started)
            ]
            if held:
                found.setdefault(run.task_id, run.started - min(held))
    return found


def with_waits(
    tasks: Sequence[TaskSpec], waits: Iterable[tuple[str, int, int, bool]], holds: Mapping[str, int]
) -> list[TaskSpec]:
    """``tasks``, each with its first run's claim wait as its ``wait_ms`` and its hold time as
    its ``hold_ms``."""
    first = {task_id: wait for task_id, run_id, wait, _ in waits if run_id == 0}
    return [
        dataclasses.replace(t, wait_ms=first.get(t.task_id), hold_ms=holds.get(t.task_id))
        if t.task_id in first or t.task_id in holds
        else t
        for t in tasks
    ]
