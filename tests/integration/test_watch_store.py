"""Every process that watches the store (``serve``'s and ``listen``'s watcher alike) says each
emptying of the index once, whether it found the store empty itself or another process did."""

from __future__ import annotations

import logging
import time

import pytest
import redis.asyncio as aioredis

from coalescer.health import Health, watch_store
from coalescer.store import Store

EMPTIED = "the index store was emptied"


def said(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


async def test_each_emptying_is_said_once_whoever_found_it(
    store: Store, redis_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="coalescer")
    health = Health()
    await store.index_state(int(time.time() * 1000))  # another process made the marker first
    await watch_store(store, health)
    # At start, an index waiting for its rebuild is a warning; not an emptying.
    [incomplete] = said(caplog, "the index is incomplete")
    assert incomplete.levelno == logging.WARNING and not said(caplog, EMPTIED)

    # Emptied, and found so first by another process.
    await redis_client.flushdb()
    assert (await store.index_state(int(time.time() * 1000))).created
    await watch_store(store, health)
    await watch_store(store, health)
    [first] = said(caplog, EMPTIED)
    assert first.levelno == logging.ERROR and "coalescer reconcile --rebuild" in first.getMessage()

    # Emptied again, found by this watcher itself: said once more.
    await redis_client.flushdb()
    await watch_store(store, health)
    await watch_store(store, health)
    assert len(said(caplog, EMPTIED)) == 2
