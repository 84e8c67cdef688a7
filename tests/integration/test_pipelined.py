"""The query path's auto-pipelined Redis connection, on real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from coalescer.errors import StoreUnavailable
from coalescer.model import TaskEvent
from coalescer.store import Store, keys
from coalescer.store.pipelined import PipelinedClient

NOW = 1_893_456_000_000


def ev(task: str, order: float) -> TaskEvent:
    return TaskEvent(task, 0, "pending", ("k",), order, NOW + 3_600_000, NOW)


def test_only_plain_urls_take_the_lean_path() -> None:
    assert PipelinedClient.supports("redis://127.0.0.1:6379/0")
    assert PipelinedClient.supports("rediss://:pw@h:6380/2?ssl_cert_reqs=none")
    assert not PipelinedClient.supports("redis://h/0?socket_timeout=1")
    assert not PipelinedClient.supports("unix:///run/redis.sock")
    client = PipelinedClient("rediss://user:p%40ss@h:6380/2?ssl_cert_reqs=none")
    assert (client.username, client.password, client.db) == ("user", "p@ss", 2)
    assert client.ssl is not None and not client.ssl.check_hostname


async def test_concurrent_queries_share_one_connection_and_get_their_own_answers(
    store: Store,
) -> None:
    assert store.fast is not None
    await store.apply([ev(f"t{i}", i) for i in range(5)], now_ms=NOW)
    snaps = await asyncio.gather(
        *(store.snapshot("k", f"t{i}", now_ms=NOW, cap=32) for i in range(5))
    )
    assert [s.newer for s in snaps] == [4, 3, 2, 1, 0]


async def test_a_lost_script_falls_back_and_reloads(
    store: Store, redis_client: aioredis.Redis
) -> None:
    await store.apply([ev("a", 1)], now_ms=NOW)
    await redis_client.script_flush()
    assert (await store.snapshot("k", "a", now_ms=NOW, cap=32)).newer == 0
    assert (await store.snapshot("k", "a", now_ms=NOW, cap=32)).newer == 0


async def test_a_killed_connection_fails_in_flight_queries_then_reconnects(
    store: Store, redis_client: aioredis.Redis
) -> None:
    await store.apply([ev("a", 1)], now_ms=NOW)
    await store.snapshot("k", "a", now_ms=NOW, cap=32)  # connects the lean path
    await redis_client.client_kill_filter(_type="normal", skipme=True)
    for _ in range(2):  # the first may see the dead socket; the next one reconnects
        try:
            snap = await store.snapshot("k", "a", now_ms=NOW, cap=32)
        except StoreUnavailable:
            continue
        assert snap.newer == 0
        return
    pytest.fail("the lean path did not reconnect")


async def test_redis_down_is_store_unavailable() -> None:
    client = PipelinedClient("redis://127.0.0.1:1/0", timeout=2)
    with pytest.raises(StoreUnavailable, match="unreachable"):
        await client.execute("PING")
    await client.close()


def answers(n: int) -> list[tuple[str, str, tuple[str, ...], str, int]]:
    return [(f"k{i % 3}", f"t{i}", (f"t{i}", f"u{i}"), "ok", NOW + i) for i in range(n)]


async def logged(redis_client: aioredis.Redis) -> dict[str, list[bytes]]:
    return {k: await redis_client.lrange(keys.log(k), 0, -1) for k in ("k0", "k1", "k2")}


async def test_answers_for_the_pages_are_written_over_the_lean_writer(
    store: Store, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert store.writer is not None
    await store.load_scripts()

    def no_redis_py(*args: object, **kwargs: object) -> None:
        raise AssertionError("the batch went through redis-py")

    monkeypatch.setattr(store, "pipeline", no_redis_py)
    await store.remember_answers(answers(9))
    log = await logged(redis_client)
    assert [len(v) for v in log.values()] == [3, 3, 3]
    assert log["k0"][0].decode().startswith(f"{NOW + 6}|answer|t6|2|ok|t6,u6")
    assert await redis_client.hget(keys.answered("k2")[0], "u8")


async def test_a_lost_script_on_the_writer_reruns_only_what_failed(
    store: Store, redis_client: aioredis.Redis
) -> None:
    await store.load_scripts()
    await redis_client.script_flush()
    await store.remember_answers(answers(6))
    # The log entries went through once (not again with the scripts), the records after the
    # reload.
    assert [len(v) for v in (await logged(redis_client)).values()] == [2, 2, 2]
    assert await redis_client.hlen(keys.answered("k0")[0]) == 4


async def test_events_and_counters_are_written_over_the_lean_writer(
    store: Store, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert store.writer is not None and store.writer is not store.fast
    await store.load_scripts()

    def no_redis_py(*args: object, **kwargs: object) -> None:
        raise AssertionError("the batch went through redis-py")

    monkeypatch.setattr(store, "pipeline", no_redis_py)
    done = TaskEvent("a", 0, "completed", ("k",), 1, NOW + 3_600_000, NOW)
    assert await store.apply([ev("a", 1), ev("b", 2), done], now_ms=NOW) == ["applied"] * 3
    await store.count({"events_applied": 3, "events_stale": 0})
    assert await redis_client.hgetall(keys.STATS) == {b"events_applied": b"3"}
    assert await redis_client.zrange(keys.group("k")[1], 0, -1) == [b"b"]
    assert await redis_client.llen(keys.resolutions("k")) == 1


async def test_a_lost_script_runs_the_batch_of_events_again(
    store: Store, redis_client: aioredis.Redis
) -> None:
    assert await store.apply([ev("a", 1), ev("b", 2)], now_ms=NOW) == ["applied", "applied"]
    await redis_client.script_flush()
    assert await store.apply([ev("a", 1), ev("c", 3)], now_ms=NOW) == ["stale", "applied"]
