"""What the anonymous endpoints cost with many coalescing keys, and what the index holds.

Indexes ``--keys`` keys (one pending task each, plus one task under the most recently active
key) in Redis (``REDIS_URL``; ``scripts/with_services.py`` starts one), counts the index as the
web process's background upkeep does, then times ``/metrics``, the overview (plain and
filtered), ``/v1/list``, ``/v1/stats`` and a task page through the app in this process (median
of ``--rounds``), and prints Redis's memory and this process's peak RSS.

    .venv/bin/python scripts/with_services.py .venv/bin/python bench/keyset.py \\
        [--keys 70000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import time

import httpx
import redis.asyncio as aioredis
import taskcluster

from coalescer import upkeep
from coalescer.model import TaskEvent
from coalescer.settings import Settings
from coalescer.store import open_store
from coalescer.web.app import create_app

BATCH = 5000


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=70_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    url = os.environ.get("REDIS_URL") or os.environ["COALESCER_TEST_REDIS_URL"]
    raw = aioredis.Redis.from_url(url)
    await raw.flushdb()
    store = await open_store(url, grace_seconds=3600)
    now = int(time.time() * 1000)
    deadline = now + 86_400_000
    started = time.perf_counter()
    for first in range(0, args.keys, BATCH):
        events = [
            TaskEvent(
                taskcluster.slugid.nice(), 0, "pending", (f"bench.k{i}",), float(i), deadline, now
            )
            for i in range(first, min(first + BATCH, args.keys))
        ]
        await store.apply(events, now_ms=now)
    task = taskcluster.slugid.nice()
    await store.apply(  # the most recently active key
        [TaskEvent(task, 0, "pending", ("bench.busy",), 1.0, deadline, now)], now_ms=now + 1
    )
    print(f"indexed {args.keys} keys in {time.perf_counter() - started:.1f} s")
    memory = (await raw.info("memory"))["used_memory"]
    print(f"redis used_memory: {memory / 1e6:.1f} MB")
    started = time.perf_counter()
    await upkeep.count(store)  # what the web process does in the background
    print(f"counted the index in {time.perf_counter() - started:.1f} s (background)")
    app = create_app(Settings.from_environ({"REDIS_URL": url}), store)
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
        paths = ("/metrics", "/", "/?q=k123", "/v1/list", "/v1/stats", f"/tasks/{task}")
        for path in paths:
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                r = await client.get(path)
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200, (path, r.status_code, r.text[:200])
            print(f"{path:<32} median {statistics.median(times) * 1000:8.1f} ms")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this process: {rss:.0f} MB")
    await raw.flushdb()
    await raw.aclose()
    await store.close()


if __name__ == "__main__":
    asyncio.run(main())
