"""Property: whatever the delivery (shuffled, duplicated, partly dropped, with retried runs), the
index and its answers equal a simple model that folds the delivered events by version."""

from __future__ import annotations

import asyncio
import uuid

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from coalescer import model
from coalescer.model import TaskEvent
from coalescer.store import open_store
from tests.conftest import REDIS_URL

NOW = 1_893_456_000_000
TASKS = [f"task{i:02d}" for i in range(8)]


@st.composite
def histories(draw: st.DrawFn) -> list[TaskEvent]:
    """The true life of a few tasks: runs pending → running → resolved, retried sometimes."""
    events: list[TaskEvent] = []
    for task in draw(st.lists(st.sampled_from(TASKS), min_size=1, max_size=6, unique=True)):
        order = float(draw(st.integers(0, 5)))  # small range: ties happen, broken by taskId
        deadline = NOW + draw(st.sampled_from([-1000, 60_000, 3_600_000]))
        for run in range(draw(st.integers(1, 3))):
            steps = draw(st.integers(1, 3))  # 1: pending, 2: running, 3: resolved
            for rank, state in list(
                enumerate(
                    [
                        "pending",
                        "running",
                        draw(st.sampled_from(["completed", "failed", "exception"])),
                    ],
                    1,
                )
            )[:steps]:
                events.append(
                    TaskEvent(task, run, state, ("k",), order, deadline, NOW - 1000 * run)
                )
                del rank
            if steps < 3:
                break
    return events


def fold(delivered: list[TaskEvent]) -> dict[str, TaskEvent]:
    newest: dict[str, TaskEvent] = {}
    for ev in delivered:
        if ev.task_id not in newest or ev.version > newest[ev.task_id].version:
            newest[ev.task_id] = ev
    return newest


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), history=histories())
def test_index_equals_the_model_under_any_delivery(
    data: st.DataObject, history: list[TaskEvent]
) -> None:
    # At-least-once, out of order, some lost: any sub-multiset in any order.
    delivered = (
        data.draw(st.lists(st.sampled_from(history), max_size=len(history) * 2)) if history else []
    )
    delivered = data.draw(st.permutations(delivered))
    batch = data.draw(st.integers(1, 5))
    initial = data.draw(st.sampled_from(TASKS))
    cap = data.draw(st.integers(2, 6))
    key = f"prop.{uuid.uuid4().hex}"
    delivered = [
        TaskEvent(e.task_id, e.run_id, e.state, (key,), e.order, e.deadline_ms, e.pending_since_ms)
        for e in delivered
    ]

    newest = fold(delivered)
    expected_pending = sorted(
        (ev.order, tid)
        for tid, ev in newest.items()
        if ev.state == "pending" and ev.deadline_ms > NOW
    )

    async def run() -> None:
        store = await open_store(REDIS_URL, grace_seconds=3600)
        try:
            for i in range(0, len(delivered), batch):
                await store.apply(delivered[i : i + batch], now_ms=NOW)
            got = [t.task_id for t in await store.pending(key, now_ms=NOW)]
            assert got == [tid for _, tid in expected_pending]
            snap = await store.snapshot(key, initial, now_ms=NOW, cap=cap)
            answer, reason = model.supersedes(initial, snap, now_ms=NOW, cap=cap)
            if initial not in newest:
                assert (answer, reason) == ([initial], "unknown")
            else:
                # The task keeps the order its first applied event gave it: every event carries it.
                others = [(o, t) for o, t in expected_pending if t != initial][-(cap - 1) :]
                want = sorted([*others, (newest[initial].order, initial)])
                assert answer == [t for _, t in want]
                assert answer[-1] == want[-1][1]
        finally:
            await store.client.delete(*[f"co:{{{key}}}:{s}" for s in "tpwdx"], f"co:{{{key}}}:log")
            await store.client.zrem("co:keys", key)
            await store.close()

    asyncio.run(run())
