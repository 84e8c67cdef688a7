"""What the pages read from the store, and what is written for them, stays bounded."""

from __future__ import annotations

import logging

import pytest
import redis.asyncio as aioredis

from coalescer import logs
from coalescer.store import Store, keys, views


def answer(key: str, ids: list[str], at: int) -> tuple[str, str, list[str], str, int]:
    return (key, ids[0], ids, "ok", at)


async def test_a_tasks_newest_listing_wins_and_names_the_newest_task(
    store: Store, redis_client: aioredis.Redis
) -> None:
    await store.remember_answers([answer("k", ["A", "B"], 1), answer("k", ["A", "B", "C"], 2)])
    raw = await redis_client.hmget(keys.answered("k")[0], ["A", "B", "C"])
    a, b, c = (views.parse_listing(r.decode()) for r in raw)
    assert (a.newest, a.position, a.count, a.at_ms) == ("C", 0, 3, 2)
    assert (b.newest, b.task_ids) == ("C", [])
    assert c.task_ids == ["A", "B", "C"]  # the newest carries what it would supersede


async def test_remembered_listings_are_capped_per_key_oldest_dropped_first(
    store: Store, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(views, "ANSWERED_PER_KEY", 3)
    await store.remember_answers([answer("k", [f"T{i}"], i) for i in range(5)])
    a, ax = keys.answered("k")
    assert sorted(await redis_client.hkeys(a)) == [b"T2", b"T3", b"T4"]
    assert await redis_client.zcard(ax) == 3
    assert 0 < await redis_client.pttl(a) <= views.ANSWERED_TTL_MS


def test_a_flush_unpacks_only_a_busy_keys_newest_answers() -> None:
    many = [answer("k", [f"A{i}", f"B{i}"], i) for i in range(100)]
    records = views.answer_records(reversed(many))
    assert len(records["k"]) == 2 * views.ANSWERS_PER_KEY_PER_FLUSH
    assert {r[0] for r in records["k"]} >= {"A99", "B99"}


def test_uvicorn_lines_go_through_the_json_handler_once_set_up() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    uvicorn = logging.getLogger("uvicorn")
    uvicorn.handlers[:] = [logging.NullHandler()]
    uvicorn.propagate = False
    try:
        root.handlers[:] = [logging.NullHandler()]
        logs.adopt_uvicorn()  # not set up for JSON (tests, embedding): leave uvicorn alone
        assert uvicorn.handlers and not uvicorn.propagate
        logs.setup("INFO", json=True)
        logs.adopt_uvicorn()
        assert not uvicorn.handlers and uvicorn.propagate
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
        uvicorn.propagate = True
