"""The index on a real three-node Redis Cluster, started for this module."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest

from coalescer import upkeep
from coalescer.model import TaskEvent
from coalescer.settings import Settings
from coalescer.store import Store, keys, open_store
from coalescer.store import policy as stored_policy
from coalescer.store.admission import POOL_SIZE
from coalescer.store.cluster import ClusterRouter
from coalescer.web.app import create_app
from tests.redis_cluster import ClusterFailed, redis_cluster
from tests.web.conftest import AUTH, at, ids

NOW = 1_893_456_000_000


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    try:
        with redis_cluster() as url:
            yield url
    except ClusterFailed as exc:
        pytest.fail(str(exc))


@pytest.fixture
async def cluster_store(cluster_url: str) -> AsyncIterator[Store]:
    store = await open_store(cluster_url, grace_seconds=3600)
    yield store
    await store.client.flushall()
    await store.close()


def ev(task: str, order: float, key: str, state: str = "pending") -> TaskEvent:
    return TaskEvent(task, 0, state, (key,), order, NOW + 3_600_000, NOW)


async def test_a_cluster_is_recognised_and_keys_spread_over_its_nodes(cluster_store: Store) -> None:
    keys = [f"k{i}" for i in range(20)]
    await cluster_store.apply([ev(f"t{i}", 1.0, key) for i, key in enumerate(keys)], now_ms=NOW)
    nodes = {cluster_store.client.get_node_from_key(f"co:{{{k}}}:p").name for k in keys}  # type: ignore[attr-defined]
    assert len(nodes) == 3
    counts = await cluster_store.pending_counts(keys, now_ms=NOW)
    assert set(counts.values()) == {1}


async def test_events_and_answers_on_a_cluster(cluster_store: Store) -> None:
    await cluster_store.apply([ev("a", 1, "x"), ev("b", 2, "x"), ev("c", 3, "x")], now_ms=NOW)
    await cluster_store.apply([ev("b", 2, "x", "running"), ev("b", 2, "x", "pending")], now_ms=NOW)
    assert [t.task_id for t in await cluster_store.pending("x", now_ms=NOW)] == ["a", "c"]
    snap = await cluster_store.snapshot("x", "b", now_ms=NOW, cap=32)
    assert (snap.pending, snap.newer, snap.newest) == (2, 1, ["c", "a"])


async def test_queries_go_to_each_keys_node_over_the_lean_connections(
    cluster_store: Store,
) -> None:
    router = cluster_store.fast
    assert isinstance(router, ClusterRouter)
    keys = [f"q{i}" for i in range(12)]
    await cluster_store.apply([ev(f"t{i}", float(i), k) for i, k in enumerate(keys)], now_ms=NOW)
    asked: list[str] = []
    route = router.execute

    def counted(*args: Any) -> Any:
        asked.append(args[3])
        return route(*args)

    router.execute = counted  # type: ignore[method-assign]
    for i, key in enumerate(keys):
        snap = await cluster_store.snapshot(key, f"t{i}", now_ms=NOW, cap=32)
        assert (snap.pending, snap.newest) == (1, [f"t{i}"])
    assert len(asked) == len(keys)  # none fell back to redis-py
    assert len(router._clients) == 3  # one lean connection per node


async def test_as_many_round_trips_at_once_as_a_process_lets_in_on_one_node(
    cluster_store: Store,
) -> None:
    # Store.admission lets POOL_SIZE round trips in at once; on a Cluster they may all go to
    # one node, whose connection pool must hold as many (redis-py's default is smaller).
    await cluster_store.apply([ev("a", 1, "burst")], now_ms=NOW)
    pending = keys.group("burst")[1]
    replies = await asyncio.gather(
        *(cluster_store.pipeline(lambda pipe: pipe.zcard(pending)) for _ in range(POOL_SIZE))
    )
    assert replies == [[1]] * POOL_SIZE


async def test_a_query_sent_to_the_wrong_node_is_redirected_through_redis_py(
    cluster_store: Store,
) -> None:
    """While slots move, a node answers MOVED: the answer still comes, by redis-py."""
    router = cluster_store.fast
    assert isinstance(router, ClusterRouter)
    await cluster_store.apply([ev("a", 1, "m"), ev("b", 2, "m")], now_ms=NOW)
    cluster: Any = cluster_store.client
    owner = cluster.get_node_from_key("co:{m}:p")
    wrong = next(n for n in cluster.get_primaries() if n.name != owner.name)
    router._cluster = _Pinned(wrong)  # type: ignore[assignment]
    snap = await cluster_store.snapshot("m", "a", now_ms=NOW, cap=32)
    assert (snap.pending, snap.newer, snap.newest) == (2, 1, ["b", "a"])
    assert list(router._clients) == [wrong.name]  # it was asked, and said MOVED


class _Pinned:
    """A slot map that sends every key to one node."""

    def __init__(self, node: Any) -> None:
        self.node = node

    def get_node_from_key(self, key: str) -> Any:
        return self.node


async def test_the_http_api_over_a_cluster(
    cluster_url: str, cluster_store: Store, message: Callable[..., dict[str, Any]]
) -> None:
    settings = Settings.from_environ({"REDIS_URL": cluster_url, "COALESCER_INGEST_TOKEN": "s3cret"})
    app = create_app(settings, cluster_store)
    a, b = ids(2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        posted = await c.post(
            "/v1/events",
            json=[message(t, scheduled=at(i)) for i, t in enumerate((a, b))],
            headers=AUTH,
        )
        assert [r["status"] for r in posted.json()["results"]] == ["applied", "applied"]
        assert (await c.get(f"/k?taskId={a}")).json() == {"supersedes": [a, b]}
        assert (await c.get("/v1/stats")).json()["pending_count"] == "2"


async def test_keys_are_forgotten_and_counted_on_a_cluster(cluster_store: Store) -> None:
    names = [f"k{i}" for i in range(20)]
    await cluster_store.apply([ev(f"t{i}", 1.0, key) for i, key in enumerate(names)], now_ms=NOW)
    tally = await upkeep.count(cluster_store, now_ms=NOW, step=5)
    assert (tally.with_pending, tally.pending) == (20, 20)
    assert await upkeep.sweep(cluster_store, now_ms=NOW + 2 * 3_600_000 + 1, step=5) == 20
    assert await cluster_store.keys() == []


async def test_the_history_and_its_charts_on_a_cluster(
    cluster_url: str, cluster_store: Store
) -> None:
    """The ring over every key lives in the slot of ``{co:keys}``, each key's in its own."""
    from coalescer import history
    from coalescer.store import history as stored_history

    retention = history.Retention()
    names = [f"k{i}" for i in range(10)]
    await cluster_store.apply([ev(f"t{i}", 1.0, key) for i, key in enumerate(names)], now_ms=NOW)
    await upkeep.count(cluster_store, now_ms=NOW, step=4, retention=retention)
    start = retention.start(NOW)
    await cluster_store.count(
        {"events_applied": 1}, history={(history.SUPERSEDED, start): 3}, retention=retention
    )
    found = await stored_history.read(cluster_store, retention, now_ms=NOW)
    assert found[history.PENDING].latest == 10 and found[history.SUPERSEDED].total == 3
    for key in names:
        keyed = await stored_history.read(cluster_store, retention, now_ms=NOW, key=key)
        assert keyed[history.PENDING].latest == 1

    settings = Settings.from_environ({"REDIS_URL": cluster_url})
    app = create_app(settings, cluster_store)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        for path in ("/", "/k3"):
            page = await c.get(path, headers={"Accept": "text/html"})
            assert page.status_code == 200 and 'data-series="pending"' in page.text


async def test_the_enforcer_reads_the_outbox_of_a_key_on_any_node(cluster_store: Store) -> None:
    """``XREADGROUP`` names its group before its stream: it goes to the stream's node, not to
    the node of the group's name (which answered ``MOVED`` until the enforcer gave up)."""
    names = [f"k{i}" for i in range(12)]
    nodes = {cluster_store.client.get_node_from_key(keys.policy(k)[5]).name for k in names}  # type: ignore[attr-defined]
    assert len(nodes) == 3
    for key in names:
        assert await stored_policy.read(cluster_store, key, "enforce-1") == []
