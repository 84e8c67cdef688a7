"""The key set on real Redis: keys are forgotten with their last task, and every anonymous
endpoint reads a page of keys, not every key, with 100,000 keys present."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import hiredis
import httpx
import pytest
import redis.asyncio as aioredis
import redis.exceptions
import taskcluster
from prometheus_client.parser import text_string_to_metric_families
from redis.crc import key_slot

from coalescer import keyset, upkeep
from coalescer.health import Health, Supervisor
from coalescer.model import TaskEvent
from coalescer.settings import Settings
from coalescer.store import Store, keys, open_store
from coalescer.store import keyset as stored
from coalescer.web.app import create_app
from tests.ports import free_port

NOW = 1_893_456_000_000  # 2030-01-01
MINUTE = 60_000
GRACE = 3_600_000  # the store fixture's grace period
MANY = 100_000


def ev(task: str, key: str, deadline: int, state: str = "pending") -> TaskEvent:
    return TaskEvent(task, 0, state, (key,), 1.0, deadline, NOW)


async def known(redis_client: aioredis.Redis) -> tuple[int, int]:
    return await redis_client.zcard(keys.KEYS_INDEX), await redis_client.zcard(keys.KEYS_EXPIRY)


def test_the_key_set_and_its_upkeep_records_share_one_slot() -> None:
    slot = key_slot(keys.KEYS_INDEX.encode())
    for name in (keys.KEYS_EXPIRY, keys.CENSUS, keys.UPKEEP_LEASE):
        assert key_slot(name.encode()) == slot


async def test_a_key_is_forgotten_with_its_last_task(
    store: Store, redis_client: aioredis.Redis
) -> None:
    await store.apply([ev("A", "k", NOW + MINUTE), ev("B", "k", NOW + 2 * MINUTE)], now_ms=NOW)
    await store.apply([ev("C", "other", NOW + MINUTE)], now_ms=NOW)
    assert await known(redis_client) == (2, 2)

    # A's deadline plus grace has passed, B's not: "k" stays, with its last activity.
    assert await upkeep.sweep(store, now_ms=NOW + MINUTE + GRACE + 1) == 1
    assert await store.keys() == [("k", NOW)]
    assert await upkeep.sweep(store, now_ms=NOW + 2 * MINUTE + GRACE + 1) == 1
    assert await known(redis_client) == (0, 0)


async def test_an_expired_event_lists_no_key(store: Store, redis_client: aioredis.Redis) -> None:
    assert await store.apply([ev("A", "k", NOW - GRACE)], now_ms=NOW) == ["expired"]
    assert await known(redis_client) == (0, 0)


async def test_a_key_that_got_a_task_while_being_swept_is_kept(
    store: Store, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.apply([ev("A", "k", NOW)], now_ms=NOW)
    later = NOW + GRACE + 1
    real = store.pipeline
    calls = 0

    async def pipeline(fill: Callable[[Any], object], **options: Any) -> list[Any]:
        nonlocal calls
        calls += 1
        replies = await real(fill, **options)
        if calls == 2:  # the sweeper has read the key's data: a new task arrives
            await real_apply([ev("B", "k", later + MINUTE)], now_ms=later)
        return replies

    real_apply = store.apply
    monkeypatch.setattr(store, "pipeline", pipeline)
    assert await stored.sweep(store, now_ms=later) == (0, 0)
    monkeypatch.undo()
    assert await store.keys() == [("k", later)]
    assert await redis_client.zscore(keys.KEYS_EXPIRY, "k") == later + MINUTE + GRACE


async def test_keys_listed_without_an_expiry_get_one_and_are_forgotten(
    store: Store, redis_client: aioredis.Redis
) -> None:
    await store.apply([ev("A", "live", NOW + MINUTE)], now_ms=NOW)
    # Listed by an older version: activity only.
    await redis_client.zrem(keys.KEYS_EXPIRY, "live")
    await redis_client.zadd(keys.KEYS_INDEX, {"gone": NOW - MINUTE})
    tally = await upkeep.count(store, now_ms=NOW, step=1)
    assert (tally.with_pending, tally.pending) == (1, 1)
    assert await upkeep.sweep(store, now_ms=NOW) == 1
    assert await store.keys() == [("live", NOW)]
    assert await redis_client.zscore(keys.KEYS_EXPIRY, "live") == NOW + MINUTE + GRACE


async def test_the_overview_pages_through_the_keys_most_recent_first(store: Store) -> None:
    for i in range(250):
        await store.apply([ev(f"T{i}", f"key.{i:03d}", NOW + MINUTE)], now_ms=NOW + i)
    app = create_app(Settings.from_environ({}), store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        first = (await c.get("/")).json()
        assert [r["key"] for r in first["keys"]][:2] == ["key.249", "key.248"]
        assert len(first["keys"]) == keyset.PAGE_SIZE and first["next"] == "?page=2"
        last = (await c.get("/?page=3")).json()
        assert [r["key"] for r in last["keys"]][-1] == "key.000"
        assert len(last["keys"]) == 50 and last["next"] is None and last["total"] == 250
        page = (await c.get("/?page=2", headers={"Accept": "text/html"})).text
        assert "Keys 101" in page and "200 of 250" in page and 'href="?page=3"' in page
        assert (await c.get("/?page=0")).status_code == 400
        found = (await c.get("/?q=key.1*")).json()
        assert len(found["keys"]) == 100 and found["next"] is None
    # A search examines a bounded number of keys per page, and goes on from its cursor.
    seen: set[str] = set()
    at, rounds = 0, 0
    while True:
        found_keys, at = await stored.search(store, lambda k: k.endswith("7"), at, budget=1)
        seen |= {k for k, _ in found_keys}
        rounds += 1
        if at == 0:
            break
    assert rounds > 1 and seen == {f"key.{i:03d}" for i in range(250) if i % 10 == 7}


async def test_v1_list_is_capped(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(5):
        await store.apply([ev(f"T{i}", f"k{i}", NOW + 10 * MINUTE)], now_ms=NOW + i)
    monkeypatch.setattr(keyset, "LIST_CAP", 3)
    app = create_app(Settings.from_environ({}), store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        listed = (await c.get("/v1/list")).json()["coalesce.v1."]
    assert sorted(listed) == ["k2", "k3", "k4"]  # the most recently active


class _RedisServer:
    """A private redis-server on ``port``."""

    def __init__(self, port: int) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
            stdout=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


async def eventually(check: Callable[[], Awaitable[bool]], seconds: float = 20) -> None:
    give_up = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < give_up, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_upkeep_rounds_survive_an_unreachable_store_and_go_on() -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    store = await open_store(url, grace_seconds=3600)
    health = Health()
    supervisor = Supervisor(health)
    supervisor.every("upkeep", 0.05, upkeep.rounds(store, every=0.05))
    server = None
    raw = aioredis.Redis.from_url(url)
    try:
        await eventually(lambda: _true(health.loop("upkeep").failures > 1))
        server = _RedisServer(port)
        # A key whose data expired long ago: a round forgets it, and counts.
        await eventually(lambda: _reachable(raw))
        await raw.zadd(keys.KEYS_INDEX, {"old": 1})
        await raw.zadd(keys.KEYS_EXPIRY, {"old": 1})
        await eventually(lambda: _forgotten_and_counted(raw), seconds=60)
        assert health.loop("upkeep").failures == 0
    finally:
        await supervisor.stop()
        await store.close()
        await raw.aclose()
        if server is not None:
            server.stop()


async def test_the_web_process_runs_the_upkeep_and_stops_it_on_shutdown(
    store: Store, redis_client: aioredis.Redis, redis_url: str
) -> None:
    await redis_client.zadd(keys.KEYS_INDEX, {"old": 1})
    await redis_client.zadd(keys.KEYS_EXPIRY, {"old": 1})
    settings = Settings.from_environ({"REDIS_URL": redis_url, "COALESCER_UPKEEP_SECONDS": "0.2"})
    app = create_app(settings, store)
    async with app.router.lifespan_context(app):
        await eventually(lambda: _forgotten_and_counted(redis_client))
        # The next rounds come COALESCER_UPKEEP_SECONDS apart (15 s unless set).
        await redis_client.zadd(keys.KEYS_INDEX, {"older": 1})
        await redis_client.zadd(keys.KEYS_EXPIRY, {"older": 1})
        await eventually(lambda: _forgotten_and_counted(redis_client), seconds=10)
    running = [t for t in asyncio.all_tasks() if t.get_name() == "upkeep"]
    assert running == []


async def _true(value: bool) -> bool:
    return value


async def _reachable(raw: aioredis.Redis) -> bool:
    try:
        return bool(await raw.ping())
    except redis.exceptions.ConnectionError:
        return False


async def _forgotten_and_counted(raw: aioredis.Redis) -> bool:
    return await raw.zcard(keys.KEYS_INDEX) == 0 and bool(await raw.exists(keys.CENSUS))


# -- 100,000 keys -----------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def raw_transport(store: Store, redis_url: str) -> AsyncIterator[None]:
    """The store's round trips over plain connections: redis-py queues each round trip's
    commands exactly as the store sends them, hiredis packs them and reads the replies, and
    redis-py's reply callbacks shape them. The same commands, without redis-py's per-command
    cost, so that 100,000 keys are written and walked in seconds. Concurrent round trips take
    a connection each (up to two), so that one is built while Redis runs the other."""
    url = urlsplit(redis_url)
    free: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    real = store.pipeline

    async def send(
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], commands: list[tuple[Any, ...]]
    ) -> list[Any]:
        reader, writer = conn
        writer.write(b"".join(hiredis.pack_command(args) for args in commands))
        parser = hiredis.Reader()
        replies: list[Any] = []
        while len(replies) < len(commands):
            parser.feed(await reader.read(1 << 20))
            while (reply := parser.gets()) is not False:
                replies.append(reply)
        return replies

    # Replies as redis-py's own connections get them, for its callbacks: RESP3 from redis-py 8
    # on, RESP2 before.
    pool = store.client.connection_pool
    protocol = int(pool.connection_class(**pool.connection_kwargs).protocol or 2)
    for _ in range(2):
        conn = await asyncio.open_connection(url.hostname, url.port)
        await send(conn, [("HELLO", protocol), ("SELECT", url.path.strip("/") or "0")])
        free.put_nowait(conn)

    async def pipeline(fill: Callable[[Any], object], **_: Any) -> list[Any]:
        pipe: Any = store.client.pipeline(transaction=False)
        fill(pipe)
        stack = [(args, dict(options)) for args, options in pipe.command_stack]
        conn = await free.get()
        try:
            replies = await send(conn, [args for args, _ in stack])
        finally:
            free.put_nowait(conn)
        out = []
        for (args, options), reply in zip(stack, replies, strict=True):
            assert not isinstance(reply, hiredis.ReplyError), (args[:2], reply)
            options.pop("keys", None)
            callback = store.client.response_callbacks.get(args[0])
            out.append(callback(reply, **options) if callback else reply)
        return out

    store.pipeline = pipeline  # type: ignore[method-assign]
    try:
        yield
    finally:
        store.pipeline = real  # type: ignore[method-assign]
        while not free.empty():
            _, writer = free.get_nowait()
            writer.close()
            await writer.wait_closed()


async def commands(redis_client: aioredis.Redis) -> int:
    info = await redis_client.info("stats")
    return int(info["total_commands_processed"])


async def test_100k_keys_cost_a_page_per_request_and_are_forgotten_with_their_tasks(
    store: Store, redis_client: aioredis.Redis, redis_url: str
) -> None:
    tasks = [taskcluster.slugid.nice() for _ in range(MANY + 1)]
    late = tasks[MANY]
    async with raw_transport(store, redis_url):
        started = time.perf_counter()
        # One batch after another: all twenty at once would leave the last replies waiting
        # behind 100,000 scripts, past the store's 10 s timeout on a busy machine.
        for first in range(0, MANY, 5000):
            await store.apply(
                [ev(tasks[i], f"many.k{i}", NOW + MINUTE) for i in range(first, first + 5000)],
                now_ms=NOW,
            )
        await store.apply([ev(late, "late.key", NOW + 10 * MINUTE)], now_ms=NOW + 1)
        written = time.perf_counter() - started
        assert await known(redis_client) == (MANY + 1, MANY + 1)

        app = create_app(Settings.from_environ({}), store)
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

            async def cost(path: str, **headers: str) -> tuple[int, httpx.Response]:
                before = await commands(redis_client)
                response = await client.get(path, headers=headers)
                assert response.status_code == 200, (path, response.text[:300])
                return await commands(redis_client) - before - 1, response

            # Before the first background count: the keys are known, the rest is not counted.
            spent, r = await cost("/metrics")
            values = gauges(r.text)
            assert spent <= 5 and values["coalescer_keys"] == MANY + 1
            assert "coalescer_pending_tasks" not in values

            await upkeep.count(store, now_ms=int(time.time() * 1000) - 5000)  # 5 s ago
            spent, r = await cost("/metrics")
            values = gauges(r.text)
            assert spent <= 5
            assert values["coalescer_pending_tasks"] == MANY + 1
            assert values["coalescer_keys_with_pending"] == MANY + 1
            assert values["coalescer_index_count_age_seconds"] >= 5

            spent, r = await cost("/v1/stats")
            assert spent <= 5 and r.json()["pending_count"] == str(MANY + 1)
            # Commands run by scripts count too: a few per key shown.
            spent, r = await cost("/", Accept="text/html")
            assert spent <= 5 * keyset.PAGE_SIZE and "late.key" in r.text
            spent, r = await cost("/v1/list")
            assert spent <= keyset.LIST_CAP + 5 and len(r.json()["coalesce.v1."]) == keyset.LIST_CAP
            # A task page looks under the most recently active keys, or under the key it names.
            spent, r = await cost(f"/tasks/{late}")
            assert spent <= 2 * keyset.TASK_PAGE_KEYS + 5
            assert [k["key"] for k in r.json()["keys"]] == ["late.key"]
            spent, r = await cost(f"/tasks/{tasks[500]}?key=many.k500", Accept="text/html")
            assert spent <= 5 and "many.k500" in r.text
            r = await client.get(f"/tasks/{tasks[0]}")
            assert r.status_code == 404 and "?key=" in r.json()["error"]

        # Every task's deadline plus grace passes: every key is forgotten, the late one last.
        swept = time.perf_counter()
        assert await upkeep.sweep(store, now_ms=NOW + MINUTE + GRACE + 1) == MANY
        assert await store.keys() == [("late.key", NOW + 1)]
        assert await upkeep.sweep(store, now_ms=NOW + 10 * MINUTE + GRACE + 1) == 1
        assert await known(redis_client) == (0, 0)
        print(
            f"wrote {MANY} keys in {written:.1f} s, swept them in {time.perf_counter() - swept:.1f} s"
        )


def gauges(text: str) -> dict[str, float]:
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


async def test_a_key_page_links_its_tasks_with_their_key(store: Store) -> None:
    await store.apply([ev("A", "some.key", NOW + MINUTE)], now_ms=NOW)
    app = create_app(Settings.from_environ({}), store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        page = (await c.get("/some.key", headers={"Accept": "text/html"})).text
    assert 'href="/tasks/A?key=some.key"' in page
