"""The index's limits (COALESCER_MAX_KEYS, COALESCER_MAX_TASKS) against a key flood, on real
Redis and on the embedded store, through POST /v1/events."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from coalescer import upkeep
from coalescer.health import Health, watch_limits
from coalescer.observe import EVENTS_LIMITED, LIMITED_LOG_EVERY
from coalescer.settings import Settings
from coalescer.store import Store, open_store
from coalescer.store import keyset as stored
from coalescer.web.app import create_app
from tests.web.conftest import ids, post

LATER = "2030-01-01T00:05:00.000Z"


def limited_total(limit: str) -> float:
    return EVENTS_LIMITED.labels(limit)._value.get()


@pytest.fixture(params=["redis", "embedded"])
async def limited(
    request: pytest.FixtureRequest, redis_url: str, redis_client: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Store, Health]]:
    """A client of an app held to 3 keys and 5 tracked tasks."""
    environ = {"COALESCER_INGEST_TOKEN": "s3cret", "COALESCER_MAX_KEYS": "3"}
    environ["COALESCER_MAX_TASKS"] = "5"
    if request.param == "redis":  # (the Redis database is flushed around every test)
        environ["REDIS_URL"] = redis_url
    settings = Settings.from_environ(environ)
    store = await open_store(settings.redis_url, grace_seconds=3600)
    app = create_app(settings, store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        yield c, store, Health()
    await store.close()


def on(key: str, message: Callable[..., Any], task_id: str, *args: Any, **kw: Any) -> Any:
    return message(task_id, *args, routes=(f"coalesce.v1.{key}",), **kw)


async def test_a_key_flood_past_the_limit_is_refused_per_message_and_fails_open(
    limited: tuple[httpx.AsyncClient, Store, Health],
    message: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client, store, _ = limited
    before = limited_total("keys")
    tasks = ids(8)
    with caplog.at_level(logging.WARNING, logger="coalescer.observe"):
        # One request learns the index's size; then it is held to 3 keys.
        first = await post(client, on("k0", message, tasks[0]))
        results = await post(client, *(on(f"k{i}", message, tasks[i]) for i in range(1, 8)))
    assert first == [{"status": "applied", "taskId": tasks[0]}]
    assert [r["status"] for r in results] == ["applied"] * 2 + ["limited"] * 5
    assert results[2] == {"status": "limited", "taskId": tasks[3]}
    # Not indexed: the refused keys answer the task alone, are not listed, hold nothing.
    for i in range(3, 8):
        r = await client.get(f"/k{i}?taskId={tasks[i]}")
        assert r.json() == {"supersedes": [tasks[i]]}
    listed, known = await stored.recent(store, 0, 100)
    assert known == 3 and sorted(k for k, _ in listed) == ["k0", "k1", "k2"]
    assert not await store.all_known("k5")
    # A known task keeps updating, and a known key takes new tasks (within the task limit).
    newer = await post(client, on("k1", message, tasks[1], "running"))
    assert newer == [{"status": "applied", "taskId": tasks[1]}]
    assert (await store.all_known("k1"))[tasks[1]].state == "running"
    more = ids(1)[0]
    assert [r["status"] for r in await post(client, on("k2", message, more, scheduled=LATER))] == [
        "applied"
    ]
    assert (await client.get(f"/k2?taskId={tasks[2]}")).json() == {"supersedes": [tasks[2], more]}
    # What was refused: counted, in /v1/stats, the metric and one log line (then a summary).
    assert limited_total("keys") - before == 5
    stats = (await client.get("/v1/stats")).json()
    assert stats["events_limited"] == "5"
    metrics = (await client.get("/metrics")).text
    assert 'coalescer_events_limited_total{limit="keys"}' in metrics
    lines = [r.getMessage() for r in caplog.records if "at its limits" in r.getMessage()]
    assert len(lines) == 1 and "5 events not indexed" in lines[0]
    assert "COALESCER_MAX_KEYS=3" in lines[0]
    assert LIMITED_LOG_EVERY >= 1  # the rest of a flood: one summary line per interval
    # The heartbeat warns.
    app_health: Health = client._transport.app.state.health  # type: ignore[attr-defined]
    await watch_limits(store, app_health)
    beat = (await client.get("/__heartbeat__")).json()
    assert beat["status"] == "warning" and beat["checks"]["limits"] == "warning"
    assert beat["details"]["limits"].startswith("3 keys of COALESCER_MAX_KEYS=3")


async def test_past_the_task_limit_only_known_tasks_update(
    limited: tuple[httpx.AsyncClient, Store, Health], message: Callable[..., Any]
) -> None:
    client, store, health = limited
    tasks = ids(7)
    await post(client, on("a", message, tasks[0]))
    results = await post(client, *(on("a", message, t) for t in tasks[1:]))
    # 5 tracked: the sixth and seventh task are refused, the first five kept.
    assert [r["status"] for r in results] == ["applied"] * 4 + ["limited"] * 2
    updated = await post(
        client, on("a", message, tasks[0], "completed"), on("a", message, tasks[5])
    )
    assert [r["status"] for r in updated] == ["applied", "limited"]
    assert (await client.get(f"/a?taskId={tasks[6]}")).json() == {"supersedes": [tasks[6]]}
    # A task known under one key and new under another: applied (indexed where it is known),
    # and the other key answers it alone.
    both = message(tasks[1], "running", routes=("coalesce.v1.a", "coalesce.v1.b"))
    assert [r["status"] for r in await post(client, both)] == ["applied"]
    assert not await store.all_known("b")
    assert (await client.get(f"/b?taskId={tasks[1]}")).json() == {"supersedes": [tasks[1]]}
    # A duplicate of it is stale under a, refused under b: 'limited', so that nobody retries.
    assert [r["status"] for r in await post(client, both)] == ["limited"]
    await watch_limits(store, health)
    assert health.limited is not None and "5 tracked tasks of COALESCER_MAX_TASKS=5" in (
        health.limited
    )


async def test_the_census_counts_tracked_tasks_and_room_comes_back(
    limited: tuple[httpx.AsyncClient, Store, Health], message: Callable[..., Any]
) -> None:
    client, store, health = limited
    tasks = ids(6)
    await post(client, on("a", message, tasks[0]))
    await post(client, *(on("a", message, t) for t in tasks[1:]))
    await upkeep.count(store)
    assert (await stored.size(store))[:2] == (1, 5)
    await watch_limits(store, health)
    assert health.limited is not None
    assert await store.forget("a", tasks[:2]) == 2
    await upkeep.count(store)  # the census finds the room the queue's truth made
    await watch_limits(store, health)
    assert health.limited is None
    assert [r["status"] for r in await post(client, on("a", message, tasks[5]))] == ["applied"]
