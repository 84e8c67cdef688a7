"""The index on a Redis Cluster whose master is killed and replaced by its replica, under one
open store: writes and answers go on after the failover, without restarting the process."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

from coalescer.errors import StoreUnavailable
from coalescer.model import TaskEvent
from coalescer.store import keys, open_store
from coalescer.store import policy as outbox
from tests.soak.stores import Cluster

NOW = 1_893_456_000_000
KEYS = [f"k{i}" for i in range(24)]
T = TypeVar("T")


def ev(task: str, order: float, key: str, state: str = "pending") -> TaskEvent:
    return TaskEvent(task, 0, state, (key,), order, NOW + 3_600_000, NOW)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    nodes = Cluster(random.Random(7))
    nodes.start()
    try:
        yield nodes
    finally:
        nodes.stop()


async def sent_through_a_failover(
    cluster: Cluster, slot_key: str, send: Callable[[], Awaitable[T]]
) -> T:
    """``send()`` to the master of ``slot_key`` while it is frozen longer than the node timeout
    and its replica promoted; thawed, it rejoins as a replica. What the store reports done must
    survive that: a failure (not done) is sent again, and must land on the new master."""
    cluster.replicated()
    port = cluster.master_of(slot_key)
    cluster.freeze_port(port)
    try:
        sent = asyncio.create_task(send())
        await asyncio.to_thread(cluster.failed_over, slot_key, port)
    finally:
        await asyncio.to_thread(cluster.thaw)
    failures = 0
    try:
        return await sent
    except StoreUnavailable:
        pass  # not done: sent again below
    finally:
        await asyncio.to_thread(cluster.demoted, port)
    while True:
        try:
            return await send()
        except StoreUnavailable:
            failures += 1
            assert failures <= 3, "the store did not follow the failover"


async def test_the_store_follows_a_failover_without_a_restart(cluster: Cluster) -> None:
    store = await open_store(cluster.url, grace_seconds=3600)
    try:
        await store.apply([ev(f"a{i}", 1, k) for i, k in enumerate(KEYS)], now_ms=NOW)
        # Redis replicates asynchronously: a write a master acknowledged but its replica had
        # not received yet dies with the master (an index rebuild recovers it). Here the
        # replicas have them all before the kill, so that only the failover itself is tested.
        cluster.replicated()
        said = cluster.kill_master()  # promoted, then the old master back as a replica
        assert "promoted" in said
        # Writes on every slot, the killed master's included, go to the new masters. A batch
        # that was written to the killed master before it died fails (it may have run there,
        # and is not sent again behind the caller's back): the caller applies it again, as
        # ingest does, and the map read after the failure sends it to the new masters.
        batch = [ev(f"b{i}", 2, k) for i, k in enumerate(KEYS)]
        failures = 0
        while True:
            try:
                outcomes = await store.apply(batch, now_ms=NOW)
                break
            except StoreUnavailable:
                failures += 1
                assert failures <= 3, "the store did not follow the failover"
        # The new masters lack the scripts: the batch runs again once they are loaded, and the
        # events it had applied already answer stale (applied, as the index below shows).
        assert set(outcomes) <= {"applied", "stale"}
        counts = await store.pending_counts(KEYS, now_ms=NOW)
        assert counts == {k: 2 for k in KEYS}
        for i, key in enumerate(KEYS):
            snap = await store.snapshot(key, f"a{i}", now_ms=NOW, cap=32)
            assert snap.newest == [f"b{i}", f"a{i}"]
    finally:
        await store.close()


async def test_no_write_is_acknowledged_that_a_failover_then_loses(cluster: Cluster) -> None:
    """A master frozen longer than the node timeout is replaced by its replica. A write sent
    to it meanwhile waits in its socket; thawed, it runs that write and answers before it
    learns that it lost its slots, then rejoins as a replica of the new master and drops
    what it ran. The store must not report that write applied (ingest would acknowledge
    it): it fails, and the caller's retry lands on the new master."""
    store = await open_store(cluster.url, grace_seconds=3600)
    try:
        await store.apply([ev("a", 1, "frozen")], now_ms=NOW)
        await sent_through_a_failover(
            cluster,
            keys.group("frozen")[0],
            lambda: store.apply([ev("b", 2, "frozen")], now_ms=NOW),
        )
        assert set(await store.all_known("frozen")) == {"a", "b"}
    finally:
        await store.close()


async def test_no_enforcer_step_is_reported_done_that_a_failover_then_loses(
    cluster: Cluster,
) -> None:
    """The same frozen master, under a step of the enforcer's (here a search beginning): the
    queue calls that follow a step act on it, so a step the failover drops must fail, not
    answer done."""
    store = await open_store(cluster.url, grace_seconds=3600)
    key = "frozen"

    async def begin(primary: str) -> bool:
        return await outbox.search_step(
            store, key, primary, expected="", record=f"{primary}'s", now_ms=NOW
        )

    try:
        assert await begin("p1")
        # Sent again after a failure, the step answers False if the first one did land.
        await sent_through_a_failover(cluster, keys.settled(key)[0], lambda: begin("p2"))
        assert set(await outbox.searches(store, key)) == {"p1", "p2"}
    finally:
        await store.close()
