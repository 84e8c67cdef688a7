"""``coalescer listen`` as a real process says in its log when the index store is emptied under
it, once per emptying, whether it finds the store empty itself or another process (``serve``,
another ``listen``) found it first."""

# The broker and prefix fixtures are shared with test_pulse.py by importing them, which pytest
# supports and ruff takes for redefinitions.
# ruff: noqa: F811

from __future__ import annotations

import time
from pathlib import Path

import redis.asyncio as aioredis

from coalescer.store import Store, keys
from tests.integration.test_pulse import (  # noqa: F401  (fixtures)
    Broker,
    broker,
    eventually,
    prefix,
)
from tests.integration.test_pulse_churn import Listen, environ, processes  # noqa: F401

EMPTIED = "the index store was emptied"


async def test_listen_says_each_emptying_of_the_index_once(
    amqp_url: str,
    redis_url: str,
    redis_client: aioredis.Redis,
    store: Store,
    broker: Broker,
    prefix: str,
    tmp_path: Path,
    processes: list[Listen],
) -> None:
    listen = Listen(environ(amqp_url, redis_url, broker.queue, prefix), tmp_path)
    processes.append(listen)
    await listen.consuming()

    async def marked() -> bool:  # the marker is back: some process found the store empty
        return bool(await redis_client.exists(keys.INDEX_STATE))

    async def said(times: int) -> bool:
        assert listen.proc.poll() is None, listen.stderr()
        return listen.said(EMPTIED) >= times

    async def probed() -> bool:
        return bool(await redis_client.exists(keys.PROBE))

    async def another_round() -> None:
        """Wait until listen's store watcher has run a whole round more (each round starts by
        writing its probe key)."""
        for _ in range(2):
            await redis_client.delete(keys.PROBE)
            await eventually(probed, what="a round of listen's store watcher")

    await eventually(marked, what="listen's first look at the store")
    # Emptied, and found so first by another process watching the same store (serve's
    # store watcher does just this every 5 s).
    await redis_client.flushdb()
    assert (await store.index_state(int(time.time() * 1000))).created
    await eventually(lambda: said(1), what="listen to say the index was emptied")
    await another_round()
    assert listen.said(EMPTIED) == 1  # said once, not at every look
    # Emptied again, and found so by listen itself this time.
    await redis_client.flushdb()
    await eventually(marked, what="listen to find the store empty")
    await eventually(lambda: said(2), what="listen to say it again")
    await another_round()
    lines = [line for line in listen.lines() if EMPTIED in line["message"]]
    assert [line["level"] for line in lines] == ["error", "error"], lines
    assert "coalescer reconcile --rebuild" in lines[0]["message"]
    assert await listen.stop() == 0, listen.stderr()
