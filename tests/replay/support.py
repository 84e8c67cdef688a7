"""Small histories for the replay's tests."""

from __future__ import annotations

from coalescer.replay.history import History, TaskSpec

T0 = 1_893_456_000_000
MIN = 60_000


def task(
    task_id: str,
    at: float = 0,
    minutes: float | None = 10,
    *,
    key: str | None = "k",
    queue: str = "q",
    order: float | None = None,
    priority: int = 0,
    after: tuple[str, ...] = (),
    outcome: str = "completed",
    canceled: float | None = None,
) -> TaskSpec:
    """A task scheduled ``at`` minutes in, running ``minutes`` (``None``: never ran), canceled
    ``canceled`` minutes in (as the history records it)."""
    scheduled = T0 + int(at * MIN)
    return TaskSpec(
        task_id=task_id,
        task_queue=queue,
        keys=(key,) if key else (),
        order=float(scheduled if order is None else order),
        scheduled_ms=scheduled,
        deadline_ms=scheduled + 24 * 60 * MIN,
        priority=priority,
        dependencies=after,
        duration_ms=None if minutes is None else int(minutes * MIN),
        outcome=outcome,
        canceled_ms=0 if canceled is None else T0 + int(canceled * MIN),
    )


def history(*tasks: TaskSpec, workers: int = 1) -> History:
    return History.build(tasks, workers={t.task_queue: workers for t in tasks})


def minutes(ms: int) -> float:
    return (ms - T0) / MIN
