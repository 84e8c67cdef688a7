"""The store misbehaving, for real: a ``redis-server`` of the test's own is filled (OOM), frozen
(SIGSTOP), emptied (restarted without persistence) or set to evict. Nothing is half-applied,
lost or blamed on the events; queries fail fast and clearly; the process says what is wrong."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import taskcluster

from coalescer.errors import StoreUnavailable
from coalescer.health import Health, watch_store
from coalescer.settings import Settings
from coalescer.store import Store, open_store
from coalescer.web.app import create_app
from tests.conftest import make_message
from tests.redis_server import RedisServer, redis_server

AUTH = {"Authorization": "Bearer s3cret"}


def ids(n: int) -> list[str]:
    return [taskcluster.slugid.nice() for _ in range(n)]


def now_ms() -> int:
    return int(time.time() * 1000)


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 20.0) -> None:
    give_up = time.monotonic() + within
    while not await check():
        assert time.monotonic() < give_up, f"not true within {within:.0f} s"
        await asyncio.sleep(0.05)


@pytest.fixture
async def server() -> AsyncIterator[RedisServer]:
    with redis_server() as s:
        yield s


@pytest.fixture
async def store(server: RedisServer) -> AsyncIterator[Store]:
    s = await open_store(server.url, grace_seconds=3600, query_timeout=0.5)
    yield s
    await s.close()


def settings_for(server: RedisServer, **extra: str) -> Settings:
    return Settings.from_environ(
        {"REDIS_URL": server.url, "COALESCER_INGEST_TOKEN": "s3cret", **extra}
    )


def client_for(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")  # type: ignore[arg-type]


# -- a full Redis (maxmemory, noeviction) ------------------------------------------------------
async def test_a_full_redis_refuses_a_whole_event_never_half_of_it(
    server: RedisServer, store: Store
) -> None:
    from coalescer.ingest.events import Message, to_event

    def event(task_id: str, state: str) -> object:
        return to_event(Message.from_json(make_message(task_id, state)), prefix="coalesce.v1")

    a = ids(1)[0]
    await store.apply([event(a, "pending")])  # type: ignore[list-item]
    server.fill()
    b = ids(1)[0]
    for task_id, state in ((a, "running"), (b, "pending")):
        with pytest.raises(StoreUnavailable) as caught:
            await store.apply([event(task_id, state)])  # type: ignore[list-item]
        assert caught.value.reason == "full" and caught.value.outcomes == [None]
    # Reads still work, and show nothing half-done: a still pending, b unknown.
    assert [t.task_id for t in await store.pending("k", now_ms=now_ms())] == [a]
    assert await store.known("k", [b]) == {}
    server.unfill()
    assert await store.apply([event(a, "running"), event(b, "pending")]) == ["applied"] * 2  # type: ignore[list-item]
    assert [t.task_id for t in await store.pending("k", now_ms=now_ms())] == [b]


async def test_http_ingest_into_a_full_redis_is_a_503_saying_what_was_applied(
    server: RedisServer, store: Store
) -> None:
    """Room for some of a request's events: the answer says which were applied, the client
    retries the others once Redis has room, and every event is then applied exactly once."""
    app = create_app(settings_for(server), store)
    tasks = ids(1000)
    body = [make_message(t, routes=(f"coalesce.v1.key{i}",)) for i, t in enumerate(tasks)]
    used = int(server.client.info("memory")["used_memory"])
    server.client.config_set("maxmemory", used + 96 * 1024)  # room for a fraction of them
    async with client_for(app) as client:
        r = await client.post("/v1/events", json=body, headers=AUTH)
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        results = r.json()["results"]
        applied = [t for t, res in zip(tasks, results, strict=True) if res["status"] == "applied"]
        refused = [
            t for t, res in zip(tasks, results, strict=True) if res["status"] == "unavailable"
        ]
        assert applied and refused and len(applied) + len(refused) == len(tasks)
        server.unfill()
        again = [m for m in body if m["payload"]["status"]["taskId"] in set(refused)]
        r = await client.post("/v1/events", json=again, headers=AUTH)
        assert r.status_code == 200
        assert {res["status"] for res in r.json()["results"]} == {"applied"}
    for i, task_id in enumerate(tasks):  # each exactly once, under its own key
        assert list(await store.known(f"key{i}", [task_id])) == [task_id]


async def test_http_ingest_into_a_full_redis_applies_nothing_and_loses_nothing(
    server: RedisServer, store: Store
) -> None:
    app = create_app(settings_for(server), store)
    batches = [ids(500) for _ in range(5)]
    server.fill()
    async with client_for(app) as client:
        for batch in batches:
            r = await client.post("/v1/events", json=[make_message(t) for t in batch], headers=AUTH)
            assert r.status_code == 503, r.text
            assert {res["status"] for res in r.json()["results"]} == {"unavailable"}
        assert (await client.get("/__heartbeat__")).json()["checks"]["writable"] == "error"
        assert await store.known("k", [t for b in batches for t in b]) == {}
        server.unfill()
        for batch in batches:  # the client's retry
            r = await client.post("/v1/events", json=[make_message(t) for t in batch], headers=AUTH)
            assert r.status_code == 200
    assert len(await store.pending("k", now_ms=now_ms(), limit=10_000)) == 2500


# -- a frozen Redis (SIGSTOP) -------------------------------------------------------------------
async def test_a_frozen_redis_is_a_quick_503_not_a_hung_worker(
    server: RedisServer, store: Store
) -> None:
    app = create_app(settings_for(server, COALESCER_QUERY_TIMEOUT="0.5"), store)
    task = ids(1)[0]
    async with client_for(app) as client:
        await client.post("/v1/events", json=[make_message(task)], headers=AUTH)
        assert (await client.get(f"/k?taskId={task}")).json() == {"supersedes": [task]}
        server.freeze()
        try:
            started = time.monotonic()
            r = await client.get(f"/k?taskId={task}")
            waited = time.monotonic() - started
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert "timeout" in r.json()["error"]
            # The query timeout (0.5 s), not the 10 s socket timeout; far below a worker's 5 s.
            assert waited < 3.0, waited
            assert (await client.get("/__heartbeat__")).status_code == 503
        finally:
            server.thaw()

        async def answers() -> bool:
            return (await client.get(f"/k?taskId={task}")).status_code == 200

        await eventually(answers)


# -- an emptied Redis -----------------------------------------------------------------------------
async def test_an_emptied_store_is_found_and_said_loudly(
    server: RedisServer, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    health = Health()
    await watch_store(store, health)
    assert health.index is not None and health.index.state == "lost"  # new: never rebuilt
    # A rebuild that started before the store was found empty does not count...
    assert (
        await store.mark_rebuilt(now_ms(), started_ms=health.index.since_ms - 1)
    ).state == "lost"
    started = now_ms()  # ...one that started after does
    await store.mark_rebuilt(now_ms(), started_ms=started)
    await watch_store(store, health)
    assert health.index is not None and health.index.state == "ok"
    assert "rebuilt" in caplog.text
    server.restart_empty()
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        await eventually(lambda: _watched(store, health))
    assert health.index is not None and health.index.state == "lost"
    assert "the index store was emptied" in caplog.text
    assert health.report()["checks"]["index"] == "warning"
    # A rebuild that started before the loss does not cover it.
    state = await store.mark_rebuilt(now_ms(), started_ms=started)
    assert state.state == "lost"


async def _watched(store: Store, health: Health) -> bool:
    try:
        await watch_store(store, health)
    except StoreUnavailable:
        return False
    return True


async def test_the_overview_and_heartbeat_say_the_index_needs_a_rebuild(
    server: RedisServer,
) -> None:
    app = create_app(settings_for(server))
    async with app.router.lifespan_context(app), client_for(app) as client:

        async def warned() -> bool:
            return (await client.get("/__heartbeat__")).json()["checks"]["index"] == "warning"

        await eventually(warned)
        beat = (await client.get("/__heartbeat__")).json()
        assert beat["status"] == "warning" and "reconcile --rebuild" in beat["details"]["index"]
        page = await client.get("/", headers={"Accept": "text/html"})
        assert "reconcile --rebuild" in page.text
        metrics = (await client.get("/metrics")).text
        assert "coalescer_index_complete 0.0" in metrics


# -- background tasks ---------------------------------------------------------------------------
async def test_the_web_process_background_tasks_survive_a_store_outage(
    server: RedisServer,
) -> None:
    """The flusher (answers for the pages, query metrics) fails while Redis is full, says so in
    the heartbeat, and catches up once Redis has room: counters never freeze."""
    app = create_app(settings_for(server))
    task = ids(1)[0]
    async with app.router.lifespan_context(app), client_for(app) as client:
        await client.post("/v1/events", json=[make_message(task)], headers=AUTH)
        health: Health = app.state.health
        server.fill()
        await client.get(f"/k?taskId={task}")  # an answer to remember

        async def failing() -> bool:
            return health.loops["flush"].total_failures > 0

        await eventually(failing)
        server.unfill()

        async def caught_up() -> bool:  # the answer written, and the loop's failures reset
            flushed = bool(await app.state.store.history("k"))
            return flushed and health.loops["flush"].failures == 0

        await eventually(caught_up, within=30)
        beat = (await client.get("/__heartbeat__")).json()
        assert beat["checks"]["background"] == "ok"
        assert beat["details"]["background"]["flush"]["failures"] >= 1


# -- an evicting Redis ---------------------------------------------------------------------------
async def test_an_evicting_redis_is_a_loud_warning(caplog: pytest.LogCaptureFixture) -> None:
    with redis_server("--maxmemory-policy", "allkeys-lru") as server:
        app = create_app(settings_for(server))
        async with app.router.lifespan_context(app), client_for(app) as client:

            async def warned() -> bool:
                return (await client.get("/__heartbeat__")).json()["checks"][
                    "eviction"
                ] == "warning"

            await eventually(warned)
            assert "maxmemory-policy is allkeys-lru" in caplog.text
            assert "coalescer_store_evicting 1.0" in (await client.get("/metrics")).text
