"""How fast ``coalescer reconcile`` checks the index against the queue: bulk ``statuses``
requests against ``status`` task by task (a queue without the bulk endpoint), in one run.

Starts a queue emulator (``coalescer emulator``) in its own process, creates ``--tasks`` tasks in
it, indexes them in Redis (``REDIS_URL``; ``scripts/with_services.py`` starts one), then times
whole reconcile passes the two ways, alternating, and prints tasks/s medians and their ratio.

    .venv/bin/python scripts/with_services.py .venv/bin/python bench/reconcile.py \\
        [--tasks 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

import taskcluster
import taskcluster.aio
from decision import free_port, start
from taskcluster.exceptions import TaskclusterRestFailure

from coalescer.ingest.reconcile import indexed_tasks, queue_fetcher, reconcile
from coalescer.model import TaskEvent
from coalescer.store import open_store

KEYS = 50


class OneByOne:
    """The queue client as an older queue offers it: no bulk ``statuses`` endpoint."""

    def __init__(self, queue: Any) -> None:
        self.status = queue.status

    async def statuses(self, **_: Any) -> Any:
        raise TaskclusterRestFailure("no such endpoint", superExc=None, status_code=404)


async def create(queue: Any, n: int) -> list[str]:
    ids = [taskcluster.slugid.nice() for _ in range(n)]
    deadline = taskcluster.stringDate(taskcluster.fromNow("2 hours"))
    sem = asyncio.Semaphore(32)

    async def one(i: int, task_id: str) -> None:
        async with sem:
            await queue.createTask(
                task_id,
                {
                    "taskQueueId": "bench/reconcile",
                    "created": taskcluster.stringDate(taskcluster.fromNow("0 seconds")),
                    "deadline": deadline,
                    "routes": [f"coalesce.v1.bench.k{i % KEYS}"],
                    "payload": {},
                    "metadata": {
                        "name": "bench",
                        "description": "-",
                        "owner": "b@example.com",
                        "source": "https://example.com",
                    },
                },
            )

    await asyncio.gather(*(one(i, t) for i, t in enumerate(ids)))
    return ids


async def bench(root: str, redis_url: str, n: int, rounds: int) -> None:
    store = await open_store(redis_url, grace_seconds=3600)
    await store.client.flushdb()
    async with taskcluster.aio.createSession() as session:
        options = {"rootUrl": root, "maxRetries": 3}  # as `coalescer reconcile` has it
        queue = taskcluster.aio.Queue(options, session=session)
        started = time.monotonic()
        ids = await create(queue, n)
        print(f"created {n} tasks in the emulator in {time.monotonic() - started:.1f} s")
        now = int(time.time() * 1000)
        # The index thinks they all run: every pass has something to check, nothing to fix
        # after the first, so each pass does the same work.
        events = [
            TaskEvent(t, 0, "running", (f"bench.k{i % KEYS}",), float(i), now + 7_200_000, now)
            for i, t in enumerate(ids)
        ]
        for start in range(0, n, 1000):
            await store.apply(events[start : start + 1000])
        _, tasks = await indexed_tasks(store)
        ways = {
            "bulk statuses (500 per request, 4 in flight)": (queue, {"batch": 500}),
            "status task by task (16 in flight)": (OneByOne(queue), {"batch": 4}),
        }
        rates: dict[str, list[float]] = {name: [] for name in ways}
        await reconcile(store, tasks, queue_fetcher(queue))  # warm up; the first pass fixes
        for _ in range(rounds):
            for name, (client, options) in ways.items():
                summary = await reconcile(
                    store, tasks, queue_fetcher(client), concurrency=4, **options
                )
                assert summary.failed == 0 and summary.tasks == n, summary
                rates[name].append(n / summary.seconds)
    await store.close()
    medians = {name: statistics.median(r) for name, r in rates.items()}
    base = medians["status task by task (16 in flight)"]
    print(f"{'way':<46} {'tasks/s (median)':>17} {'ratio':>7}")
    for name, rate in medians.items():
        print(f"{name:<46} {rate:>17,.0f} {rate / base:>6.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    redis_url = os.environ.get("COALESCER_TEST_REDIS_URL") or os.environ.get("REDIS_URL")
    if not redis_url:
        sys.exit("set REDIS_URL, or run under scripts/with_services.py")
    port = free_port()
    proc = start([sys.executable, "-m", "coalescer.cli", "emulator", "--port", str(port)], port)
    try:
        asyncio.run(bench(f"http://127.0.0.1:{port}", redis_url, args.tasks, args.rounds))
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
