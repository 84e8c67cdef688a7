"""The index on real Redis: versions, retries, deadlines, forgetting, several keys, one slot."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.crc import key_slot

from coalescer import model
from coalescer.model import TaskEvent
from coalescer.store import Store, keys

NOW = 1_893_456_000_000  # 2030-01-01
HOUR = 3_600_000


def ev(
    task: str,
    run: int = 0,
    state: str = "pending",
    *,
    order: float = 1.0,
    keys_: tuple[str, ...] = ("k",),
    deadline: int = NOW + 24 * HOUR,
    since: int = NOW,
) -> TaskEvent:
    return TaskEvent(task, run, state, keys_, order, deadline, since)


async def pending(store: Store, key: str = "k", now: int = NOW) -> list[str]:
    return [t.task_id for t in await store.pending(key, now_ms=now)]


async def test_pending_tasks_are_listed_in_order_not_arrival(store: Store) -> None:
    await store.apply([ev("C", order=3), ev("A", order=1), ev("B", order=2)], now_ms=NOW)
    assert await pending(store) == ["A", "B", "C"]


async def test_older_or_equal_versions_change_nothing(store: Store) -> None:
    assert await store.apply([ev("A", state="running")], now_ms=NOW) == ["applied"]
    assert await store.apply([ev("A", state="pending"), ev("A", state="running")], now_ms=NOW) == [
        "stale",
        "stale",
    ]
    assert await pending(store) == []


async def test_a_retried_run_is_pending_again_in_its_original_place(store: Store) -> None:
    await store.apply([ev("A", order=1), ev("B", order=2)], now_ms=NOW)
    await store.apply([ev("A", 0, "running"), ev("A", 0, "exception")], now_ms=NOW)
    assert await pending(store) == ["B"]
    # The retry's event carries a later scheduled time; the task keeps its first place.
    await store.apply([ev("A", 1, "pending", order=5, since=NOW + 1000)], now_ms=NOW)
    assert await pending(store) == ["A", "B"]


async def test_resolution_arriving_before_pending_wins(store: Store) -> None:
    await store.apply([ev("A", state="completed")], now_ms=NOW)
    assert await store.apply([ev("A")], now_ms=NOW) == ["stale"]
    assert await pending(store) == []


async def test_a_task_past_its_deadline_is_never_offered(store: Store) -> None:
    await store.apply([ev("A", deadline=NOW + 1000), ev("B", order=2)], now_ms=NOW)
    snap = await store.snapshot("k", "B", now_ms=NOW + 2000, cap=32)
    assert snap.newest == ["B"]
    assert snap.pending == 1


async def test_knowledge_is_kept_until_deadline_plus_grace_then_forgotten(
    store: Store, redis_client: aioredis.Redis
) -> None:
    await store.apply([ev("A", state="completed", deadline=NOW + 1000)], now_ms=NOW)
    # A late duplicate of the pending event, within grace: still known as resolved, stale.
    assert await store.apply([ev("A", deadline=NOW + 1000)], now_ms=NOW + 2000) == ["stale"]
    # After deadline + grace: the task is forgotten and a late event cannot resurrect it.
    later = NOW + 1000 + store.grace_ms + 1
    assert await store.apply([ev("A", deadline=NOW + 1000)], now_ms=later) == ["expired"]
    assert await redis_client.hget(keys.group("k")[0], "A") is None


async def test_every_key_expires_after_its_newest_deadline_plus_grace(
    store: Store, redis_client: aioredis.Redis
) -> None:
    await store.apply([ev("A", deadline=NOW + HOUR)], now_ms=NOW)
    for name in keys.group("k")[:4]:
        ttl = await redis_client.pttl(name)
        assert 0 < ttl <= HOUR + store.grace_ms


async def test_a_task_with_several_routes_is_indexed_under_each(store: Store) -> None:
    await store.apply([ev("A", keys_=("k1", "k2"))], now_ms=NOW)
    assert await pending(store, "k1") == ["A"] and await pending(store, "k2") == ["A"]
    await store.apply([ev("A", state="running", keys_=("k1", "k2"))], now_ms=NOW)
    assert await pending(store, "k1") == [] and await pending(store, "k2") == []


async def test_one_batch_applies_each_event_in_turn_as_separate_calls_would(
    store: Store, redis_client: aioredis.Redis
) -> None:
    # A task's whole life and its redeliveries in one batch, with another task in between.
    batch = [
        ev("A"),
        ev("B", order=2),
        ev("A", state="running"),
        ev("A"),
        ev("A", state="completed"),
        ev("A", state="running"),
        ev("A", state="completed"),
        ev("A", 1, "pending", order=5),
    ]
    outcomes = ["applied", "applied", "applied", "stale", "applied", "stale", "stale", "applied"]
    assert await store.apply(batch, now_ms=NOW) == outcomes
    # The retry is pending again in the task's first place.
    assert await pending(store) == ["A", "B"]
    record = await redis_client.hget(keys.group("k")[0], "A")
    assert record == f"1|1|1.0|{NOW + 24 * HOUR}|{NOW}|pending|".encode()
    # Every resolution delivered is logged, newest first, as separate calls would log them.
    logged = await redis_client.lrange(keys.resolutions("k"), 0, -1)
    assert [entry.decode().split("|")[1:5] for entry in logged] == [
        ["resolved", "A", "0", "completed"],
        ["resolved", "A", "0", "completed"],
    ]
    ttl = await redis_client.pttl(keys.resolutions("k"))
    assert 0 < ttl <= 24 * HOUR + store.grace_ms


def test_one_key_lives_in_one_cluster_hash_slot() -> None:
    names = (*keys.group("a.b"), keys.log("a.b"), keys.resolutions("a.b"))
    slots = {key_slot(name.encode()) for name in names}
    assert len(slots) == 1
    assert key_slot(keys.group("c.d")[0].encode()) not in slots


async def test_snapshot_reads_count_oldest_wait_and_initial_order(store: Store) -> None:
    await store.apply(
        [ev("A", order=1, since=NOW - 5000), ev("B", order=2, since=NOW - 1000)], now_ms=NOW
    )
    await store.apply([ev("C", order=3, state="running")], now_ms=NOW)
    snap = await store.snapshot("k", "C", now_ms=NOW, cap=32)
    assert snap.pending == 2
    assert snap.oldest_since_ms == NOW - 5000
    assert snap.newer == 0
    assert snap.newest == ["B", "A"]
    assert not snap.initial_resolved
    unknown = await store.snapshot("k", "Z", now_ms=NOW, cap=32)
    assert unknown.newer is None and unknown.newest == ["B", "A"]
    assert not unknown.initial_resolved
    await store.apply([ev("C", order=3, state="completed")], now_ms=NOW)
    resolved = await store.snapshot("k", "C", now_ms=NOW, cap=32)
    assert resolved.initial_resolved and resolved.newer == 0


async def test_a_snapshot_without_the_wait_is_the_same_but_for_the_oldest_wait(
    store: Store,
) -> None:
    await store.apply(
        [ev("A", order=1, since=NOW - 5000), ev("B", order=2, since=NOW - 1000)], now_ms=NOW
    )
    with_wait = store.snapshot_soon("k", "A", now_ms=NOW, cap=32)
    without = store.snapshot_soon("k", "A", now_ms=NOW, cap=32, wait=False)
    assert with_wait is not None and without is not None  # the lean connection reads them
    await asyncio.wait([with_wait, without])
    read, lean = Store.snapshot_of(with_wait), Store.snapshot_of(without)
    assert read is not None and read.oldest_since_ms == NOW - 5000
    assert lean == read._replace(oldest_since_ms=None)


async def answer(store: Store, initial: str, cap: int = 32) -> list[str]:
    snap = await store.snapshot("k", initial, now_ms=NOW, cap=cap)
    return model.supersedes(initial, snap, now_ms=NOW, cap=cap)[0]


async def test_the_initial_task_is_placed_by_order_then_task_id(store: Store) -> None:
    await store.apply(
        [ev("b", order=1), ev("d", order=1), ev("a", order=0), ev("e", order=2)], now_ms=NOW
    )
    await store.apply([ev("c", order=1, state="running")], now_ms=NOW)
    assert await answer(store, "c") == ["a", "b", "c", "d", "e"]
    assert await answer(store, "b") == ["a", "b", "d", "e"]
    assert (await store.snapshot("k", "c", now_ms=NOW, cap=32)).newer == 2


async def test_the_cap_keeps_the_newest_and_the_initial_task(store: Store) -> None:
    await store.apply([ev(f"t{i}", order=i) for i in range(6)], now_ms=NOW)
    assert await answer(store, "t0", cap=3) == ["t0", "t4", "t5"]
    assert await answer(store, "t5", cap=3) == ["t3", "t4", "t5"]
    assert await answer(store, "t4", cap=3) == ["t3", "t4", "t5"]
    assert (await store.snapshot("k", "", now_ms=NOW, cap=3)).newest == ["t5", "t4", "t3"]
