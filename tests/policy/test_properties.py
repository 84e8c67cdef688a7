"""Property: superseding decisions do not depend on how the events arrive. Whatever the delivery
(shuffled, duplicated, batched, shared between two service processes), each victim is decided
exactly once, the victims are every task but the strategy's primary, each decision points the
right way, and every chain of decisions ends at that primary."""

from __future__ import annotations

import asyncio
import itertools
import uuid

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from coalescer.model import TaskEvent
from coalescer.store import Store, open_store
from coalescer.store import lineage as records
from tests.conftest import REDIS_URL
from tests.policy.support import rule

pytestmark = pytest.mark.integration

NOW = 1_893_456_000_000
TASKS = [f"T{i:02d}AAAAAAAQACAAAAAAAAAA" for i in range(8)]


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[dict[str, float], list[list[TaskEvent]]]:
    """Pending tasks with orders (ties broken by taskId) and how their events reach the index:
    every event at least once, in any order, in batches, split between two processes."""
    tasks = draw(st.lists(st.sampled_from(TASKS), min_size=1, max_size=6, unique=True))
    orders = {t: float(draw(st.integers(0, 4))) for t in tasks}
    key = f"prop.{uuid.uuid4().hex[:12]}"
    events = [
        TaskEvent(t, 0, "pending", (key,), order, NOW + 3_600_000, NOW - 1000)
        for t, order in orders.items()
    ]
    repeats = draw(st.lists(st.sampled_from(events), max_size=len(events)))
    delivered = draw(st.permutations(events + repeats))
    cuts = sorted(draw(st.lists(st.integers(0, len(delivered)), max_size=3)))
    bounds = [0, *cuts, len(delivered)]
    return orders, [delivered[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def primary_of(orders: dict[str, float], strategy: str) -> str:
    ranked = sorted(orders, key=lambda t: (orders[t], t))
    return ranked[-1] if strategy == "latest-wins" else ranked[0]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    delivery=deliveries(),
    strategy=st.sampled_from(["latest-wins", "first-wins"]),
    processes=st.integers(1, 2),
)
def test_decisions_do_not_depend_on_delivery(
    delivery: tuple[dict[str, float], list[list[TaskEvent]]], strategy: str, processes: int
) -> None:
    orders, batches = delivery
    key = batches[0][0].keys[0]
    policy = rule("prop.*", strategy=strategy)
    primary = primary_of(orders, strategy)

    async def run() -> None:
        stores = [await open_store(REDIS_URL, grace_seconds=3600) for _ in range(processes)]
        try:
            # Batches go to the processes in turn, concurrently: as competing consumers would.
            await asyncio.gather(
                *(
                    stores[i % processes].apply(batch, now_ms=NOW, policy=policy)
                    for i, batch in enumerate(batches)
                )
            )
            await check(stores[0])
        finally:
            await stores[0].client.flushdb()
            for s in stores:
                await s.close()

    async def check(store: Store) -> None:
        raw = await store.client.xrange(f"co:{{{key}}}:o")
        victims = [fields[b"v"].decode() for _, fields in raw]
        assert sorted(victims) == sorted(t for t in orders if t != primary)  # each once
        assert [t.task_id for t in await store.pending(key, now_ms=NOW)] == [primary]
        for victim in victims:
            decided = await records.decision(store, key, victim)
            assert decided is not None
            rank = (orders[decided.by], decided.by) > (orders[victim], victim)
            assert rank if strategy == "latest-wins" else not rank  # points the right way
            end, seen = victim, set()
            while (step := await records.decision(store, key, end)) is not None:
                assert end not in seen  # no cycle
                seen.add(end)
                end = step.by
            assert end == primary

    asyncio.run(run())


@st.composite
def lifecycles(draw: st.DrawFn) -> list[list[TaskEvent]]:
    """Tasks that run and resolve, their events delivered at least once or lost, in any order,
    in batches: what a key's decisions see in production."""
    key = f"prop.{uuid.uuid4().hex[:12]}"
    events: list[TaskEvent] = []
    for task in draw(st.lists(st.sampled_from(TASKS), min_size=2, max_size=6, unique=True)):
        order = float(draw(st.integers(0, 4)))
        states = ["pending", "running", draw(st.sampled_from(["completed", "failed"]))]
        for state in states[: draw(st.integers(1, 3))]:
            started = NOW - 500 if state != "pending" else 0
            events.append(
                TaskEvent(task, 0, state, (key,), order, NOW + 3_600_000, NOW - 1000, "", started)
            )
    delivered = draw(st.permutations(draw(st.lists(st.sampled_from(events), max_size=12))))
    if not delivered:
        delivered = events[:1]
    size = draw(st.integers(1, 4))
    return [delivered[i : i + size] for i in range(0, len(delivered), size)]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=lifecycles(),
    strategy=st.sampled_from(["latest-wins", "first-wins"]),
    running=st.booleans(),
)
def test_decisions_stay_sound_while_tasks_run_and_resolve(
    batches: list[list[TaskEvent]], strategy: str, running: bool
) -> None:
    """However the life-cycle events arrive: each victim is decided once (under latest-wins by
    a newer task), chains have no cycles and end at a task nobody superseded."""
    key = batches[0][0].keys[0]
    orders = {e.task_id: e.order for batch in batches for e in batch}
    policy = rule("prop.*", strategy=strategy, supersede_running=running)

    async def run() -> None:
        store = await open_store(REDIS_URL, grace_seconds=3600)
        try:
            for batch in batches:
                await store.apply(batch, now_ms=NOW, policy=policy)
            raw = await store.client.xrange(f"co:{{{key}}}:o")
            victims = [fields[b"v"].decode() for _, fields in raw]
            assert len(victims) == len(set(victims))
            for victim in victims:
                decided = await records.decision(store, key, victim)
                assert decided is not None
                if strategy == "latest-wins":  # first-wins: a younger *running* task may win
                    assert (orders[decided.by], decided.by) > (orders[victim], victim)
                end, seen = victim, set()
                while (step := await records.decision(store, key, end)) is not None:
                    assert end not in seen
                    seen.add(end)
                    end = step.by
                assert end not in victims
        finally:
            await store.client.flushdb()
            await store.close()

    asyncio.run(run())
