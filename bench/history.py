"""What the pages' history costs the web process's flush of answers, and the pages that draw it.

Buffers ``--answers`` answers (a second's worth at a busy service, over 500 keys), then times,
side by side in one run (median of ``--rounds``): writing them for the pages as before (the
keys' logs and per-task records), the same write carrying the history's counts (and the
counting itself), and the overview page with a full day of history, against Redis
(``COALESCER_TEST_REDIS_URL`` or ``REDIS_URL``; ``scripts/with_services.py`` starts one; the
database is flushed).

    .venv/bin/python scripts/with_services.py .venv/bin/python bench/history.py \\
        [--answers 10000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx
import redis.asyncio as aioredis

from coalescer import history
from coalescer.history import Retention, Tally
from coalescer.settings import Settings
from coalescer.store import history as stored_history
from coalescer.store import open_store
from coalescer.web.app import create_app


async def main(answers: int, rounds: int) -> None:
    url = os.environ.get("COALESCER_TEST_REDIS_URL") or os.environ["REDIS_URL"]
    client = aioredis.Redis.from_url(url)
    await client.flushdb()
    store = await open_store(url, grace_seconds=3600)
    retention = Retention()
    now = int(time.time() * 1000)
    batch = [
        (f"key{i % 500}", f"T{i}", (f"T{i - 1}", f"T{i}"), "ok", now + i % 1000)
        for i in range(answers)
    ]
    plain: list[float] = []
    counted: list[float] = []

    async def as_before() -> None:
        started = time.perf_counter()
        await store.remember_answers(batch)
        plain.append(time.perf_counter() - started)

    async def with_history() -> None:
        started = time.perf_counter()
        tally = Tally(retention)
        tally.add_each(history.ANSWERS, (a[4] for a in batch))
        await store.remember_answers(batch, history=tally.take(), retention=retention)
        counted.append(time.perf_counter() - started)

    alone: list[float] = []

    async def history_alone() -> None:
        started = time.perf_counter()
        tally = Tally(retention)
        tally.add_each(history.ANSWERS, (a[4] for a in batch))
        await store.count({}, history=tally.take(), retention=retention)
        alone.append(time.perf_counter() - started)

    for n in range(rounds):  # in turn first, so that neither always finds the other's data
        for run in (as_before, with_history) if n % 2 else (with_history, as_before):
            await run()
        await history_alone()
    # A full day of history over every key, and the overview that draws it.
    for n in range(retention.buckets):
        at = now - n * retention.bucket_ms
        counts = {(s, retention.start(at)): n for s in history.SERIES if s != history.PENDING}
        await store.count({}, history=counts, retention=retention)
        await stored_history.sample_pending(store, retention, now_ms=at, total=n)
    app = create_app(Settings.from_environ({"REDIS_URL": url}), store)
    pages = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://b") as c:
        for _ in range(rounds):
            started = time.perf_counter()
            r = await c.get("/", headers={"Accept": "text/html"})
            pages.append(time.perf_counter() - started)
            assert r.status_code == 200 and r.text.count('<svg class="chart"') == 4
    a, b = statistics.median(plain), statistics.median(counted)
    print(f"flush of {answers:,} answers, median of {rounds}:")
    print(f"  as before                 {a * 1000:8.2f} ms")
    print(f"  with the history's counts {b * 1000:8.2f} ms   ratio {b / a:.3f}")
    print(
        f"  the history alone         {statistics.median(alone) * 1000:8.2f} ms"
        "   (counting, and a round trip of its own)"
    )
    print(f"overview with 24 h of history: {statistics.median(pages) * 1000:.1f} ms")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    await client.flushdb()
    await client.aclose()
    await store.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=9)
    ns = parser.parse_args()
    asyncio.run(main(ns.answers, ns.rounds))
