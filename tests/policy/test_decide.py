"""Decisions in the store (real Redis): atomic with the event, at most once per task run,
independent of duplication, re-ordering and of how many processes apply the events."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import redis.asyncio as aioredis

from coalescer.ingest.events import Message, to_event
from coalescer.model import TaskEvent
from coalescer.store import Store, open_store
from coalescer.store import lineage as records
from coalescer.store import policy as outbox_store
from coalescer.store.redis import _Commands
from tests.conftest import make_message
from tests.policy.support import rule

pytestmark = pytest.mark.integration

IDS = [f"{c}AAAAAAAQACAAAAAAAAAAA" for c in "ABCDEFGH"]
NOW = 1_893_456_000_000  # 2030-01-01T00:00:00Z, the messages' scheduled time
LATEST = rule("k", strategy="latest-wins")


def event(task_id: str, state: str = "pending", *, at: int = 0, **kw: Any) -> TaskEvent:
    """A task's event, scheduled ``at`` seconds after NOW (its order)."""
    stamp = f"2030-01-01T00:{at // 60:02d}:{at % 60:02d}.000Z"
    message = Message.from_json(make_message(task_id, state, scheduled=stamp, **kw))
    ev = to_event(message, prefix="coalesce.v1")
    assert ev is not None
    return ev


async def outbox(client: aioredis.Redis, key: str = "k") -> list[dict[str, str]]:
    entries: Any = await client.xrange(f"co:{{{key}}}:o")
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]


async def test_on_claim_keys_cost_the_same_commands_with_or_without_a_policy(
    store: Store, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []
    original = store._batch

    async def spy(fill: Any) -> list[Any]:
        def counting(pipe: Any) -> None:
            fill(pipe)
            # The lean writer's batch, or redis-py's pipeline (no lean connection).
            sizes.append(len(pipe.commands if isinstance(pipe, _Commands) else pipe.command_stack))

        return await original(counting)

    monkeypatch.setattr(store, "_batch", spy)
    events = [event(IDS[0], at=1), event(IDS[1], at=2), event(IDS[0], "completed", at=1)]
    await store.apply(events, now_ms=NOW)
    on_claim_only = rule("elsewhere.*", strategy="latest-wins")
    await store.apply(events, now_ms=NOW, policy=on_claim_only)
    assert sizes[0] == sizes[1]
    assert not await redis_client.exists("co:outbox", "co:{k}:v", "co:{k}:o")


async def test_latest_wins_decides_once_whatever_the_order_and_duplication(
    store: Store, redis_client: aioredis.Redis
) -> None:
    events = [event(t, at=i + 1) for i, t in enumerate(IDS[:5])]
    shuffled = events * 3
    random.Random(7).shuffle(shuffled)
    for ev in shuffled:
        await store.apply([ev], now_ms=NOW, policy=LATEST)
    entries = await outbox(redis_client)
    assert sorted(e["v"] for e in entries) == IDS[:4]  # each victim exactly once
    assert {e["a"] for e in entries} == {"supersede"}
    snap = await store.pending("k", now_ms=NOW)
    assert [t.task_id for t in snap] == [IDS[4]]
    # Whatever superseded each victim directly, every chain ends at the newest task.
    for victim in IDS[:4]:
        by = victim
        while (d := await records.decision(store, "k", by)) is not None:
            assert d.rule == "rule-1" and d.reason.startswith("latest-wins: newer task")
            by = d.by
        assert by == IDS[4]


async def test_two_service_processes_applying_the_same_events_decide_once(
    store: Store, redis_client: aioredis.Redis, redis_url: str
) -> None:
    other = await open_store(redis_url, grace_seconds=3600)
    try:
        events = [event(t, at=i + 1) for i, t in enumerate(IDS)]
        await asyncio.gather(
            *(s.apply([ev], now_ms=NOW, policy=LATEST) for ev in events for s in (store, other))
        )
    finally:
        await other.close()
    assert sorted(e["v"] for e in await outbox(redis_client)) == IDS[:-1]
    assert await redis_client.zscore("co:outbox", "k") == NOW


async def test_size_and_age_thresholds_hold_decisions_back(
    store: Store, redis_client: aioredis.Redis
) -> None:
    policy = rule("k", strategy="latest-wins", size=2, age=60)
    await store.apply([event(IDS[0], at=1), event(IDS[1], at=2)], now_ms=NOW, policy=policy)
    await store.apply([event(IDS[2], at=3)], now_ms=NOW + 30_000, policy=policy)
    assert await outbox(redis_client) == []  # 3 > size pending, but not waiting > 60 s yet
    args = policy.script_args("k")
    assert args is not None
    made = await outbox_store.tick(store, {"k": args}, now_ms=NOW + 62_000)
    assert made == {"k": 2}
    assert sorted(e["v"] for e in await outbox(redis_client)) == IDS[:2]


async def test_first_wins_keeps_the_running_task_and_supersedes_later_duplicates(
    store: Store, redis_client: aioredis.Redis
) -> None:
    policy = rule("k", strategy="first-wins")
    await store.apply([event(IDS[1], "running", at=2)], now_ms=NOW, policy=policy)
    await store.apply([event(IDS[0], at=1), event(IDS[2], at=3)], now_ms=NOW, policy=policy)
    entries = await outbox(redis_client)
    assert sorted(e["v"] for e in entries) == [IDS[0], IDS[2]]
    assert {e["p"] for e in entries} == {IDS[1]}
    decision = await records.decision(store, "k", IDS[2])
    assert decision is not None and decision.reason == f"first-wins: duplicate of running {IDS[1]}"


async def test_running_victims_are_canceled_unless_protected(
    store: Store, redis_client: aioredis.Redis
) -> None:
    policy = rule("k", strategy="latest-wins", supersede_running=True, protect_running_after=60)
    # Both started at NOW (the messages' `started`): at NOW + 30 s one has run 30 s.
    await store.apply([event(IDS[0], "running", at=1)], now_ms=NOW + 30_000, policy=policy)
    await store.apply([event(IDS[1], at=2)], now_ms=NOW + 30_000, policy=policy)
    [entry] = await outbox(redis_client)
    assert (entry["a"], entry["v"], entry["p"], entry["pt"]) == ("cancel", IDS[0], IDS[1], "60000")
    await store.apply([event(IDS[2], "running", at=3)], now_ms=NOW + 90_000, policy=policy)
    await store.apply([event(IDS[3], at=4)], now_ms=NOW + 90_000, policy=policy)
    victims = [e["v"] for e in await outbox(redis_client)]
    assert IDS[2] not in victims  # ran 90 s > 60 s: protected
    assert IDS[1] in victims  # pending, older than IDS[3]
