"""Bisection findings in the store: recorded once however often written, found by any task they
name, the newest kept per key, on real Redis and on the embedded store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from coalescer.store import Store, bisections, open_store


@pytest.fixture(params=["redis", "embedded"])
async def store(
    request: pytest.FixtureRequest, redis_client: aioredis.Redis, redis_url: str
) -> AsyncIterator[Store]:
    opened = await open_store(redis_url if request.param == "redis" else None, grace_seconds=3600)
    try:
        yield opened
    finally:
        await opened.close()


def finding(primary: str, culprit: str, good: str, key: str = "k") -> dict[str, Any]:
    ref = lambda t: {"taskId": t, "runId": 0}  # noqa: E731
    return {
        "key": key,
        "by": "worker g/w",
        "primary": ref(primary),
        "held": 3,
        "culprit": ref(culprit),
        "lastGood": ref(good),
        "runs": [
            {**ref(t), "attempt": 0, "passed": t == good, "ended": "x"} for t in (culprit, good)
        ],
        "intermittent": [],
        "standsFor": [{**ref("older" + primary), "by": ref(good)}],
        "extraRuns": 2,
        "located": "2030-01-01T00:00:00.000Z",
    }


async def test_a_finding_is_found_by_every_task_it_names(store: Store) -> None:
    one = finding("P1", "C1", "G1")
    assert await bisections.record(store, one, 1000)
    assert not await bisections.record(store, one, 1000)  # a retry changes nothing
    for task_id in ("P1", "C1", "G1", "olderP1"):
        [found] = await bisections.for_task(store, ["other", "k"], task_id)
        assert found["culprit"]["taskId"] == "C1"
        assert set(found["tasks"]) == {"P1", "C1", "G1", "olderP1"}
    assert await bisections.for_task(store, ["k"], "nobody") == []
    assert [f["primary"]["taskId"] for f in await bisections.recent(store, "k")] == ["P1"]


async def test_only_the_newest_findings_of_a_key_are_kept(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bisections, "KEEP", 2)
    for i in range(4):
        await bisections.record(store, finding(f"P{i}", f"C{i}", f"G{i}"), 1000 + i)
    newest = [f["primary"]["taskId"] for f in await bisections.recent(store, "k")]
    assert newest == ["P3", "P2"]
    assert await bisections.for_task(store, ["k"], "C0") == []
    assert await bisections.for_task(store, ["k"], "C1") == []
    assert len(await bisections.for_task(store, ["k"], "C2")) == 1
