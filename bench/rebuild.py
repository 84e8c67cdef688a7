"""How fast ``coalescer reconcile --rebuild`` rebuilds an emptied index from the queue.

Starts a queue emulator in its own process with ``--tasks`` pending tasks over ``--keys``
coalescing keys in ``--task-queues`` task queues, then times whole
rebuilds into an emptied Redis (``REDIS_URL``; ``scripts/with_services.py`` starts one) as the
command runs them (task queues found by ``listTaskQueues``, 500 statuses per request, 4
requests in flight), and prints tasks/s.

    .venv/bin/python scripts/with_services.py .venv/bin/python bench/rebuild.py \\
        [--tasks 20000] [--keys 200] [--task-queues 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection

import taskcluster
import taskcluster.aio

from coalescer.emulator.harness import QueueEmulator
from coalescer.emulator.runtime import EmulatorOptions
from coalescer.ingest.rebuild import rebuild, sources, task_queue_ids
from coalescer.ingest.reconcile import queue_fetcher
from coalescer.store import open_store


def serve_emulator(conn: Connection, n: int, keys: int, task_queues: int) -> None:
    """In a child process: an emulator holding ``n`` pending tasks, until told to stop. The
    tasks go straight into its state: creating them through the API costs a scan of every task
    per request, which is not what is measured here."""
    with QueueEmulator(EmulatorOptions()) as em:
        bodies = {
            taskcluster.slugid.nice(): em.task_definition(
                taskQueueId=f"bench/rebuild-{i % task_queues}",
                routes=[f"coalesce.v1.bench.k{i % keys}"],
            )
            for i in range(n)
        }

        def populate() -> None:
            state, now = em.emulator.state, em.emulator.clock.now()
            for task_id, body in bodies.items():
                state.create_task(task_id, body, now)
            state.changed()

        em.call(populate, timeout=600)
        conn.send(em.root_url)
        conn.recv()


async def bench(root: str, redis_url: str, args: argparse.Namespace) -> None:
    store = await open_store(redis_url, grace_seconds=3600)
    async with taskcluster.aio.createSession() as session:
        queue = taskcluster.aio.Queue({"rootUrl": root, "maxRetries": 3}, session=session)
        rates = []
        for _ in range(args.rounds):
            await store.client.flushdb()  # Redis restarted empty
            started = time.monotonic()
            listings = sources(await task_queue_ids(queue), [])
            summary = await rebuild(
                store, queue, listings, queue_fetcher(queue), prefix="coalesce.v1"
            )
            seconds = time.monotonic() - started
            assert summary.complete and summary.indexed == args.tasks, summary.line()
            assert len(summary.keys) == args.keys, summary.line()
            rates.append(args.tasks / seconds)
            print(f"{summary.line()}: {args.tasks / seconds:,.0f} tasks/s")
    await store.close()
    print(f"median {statistics.median(rates):,.0f} tasks/s over {args.rounds} rebuilds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--task-queues", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    redis_url = os.environ.get("COALESCER_TEST_REDIS_URL") or os.environ.get("REDIS_URL")
    if not redis_url:
        sys.exit("set REDIS_URL, or run under scripts/with_services.py")
    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(
        target=serve_emulator, args=(theirs, args.tasks, args.keys, args.task_queues)
    )
    child.start()
    try:
        started = time.monotonic()
        root = ours.recv()
        print(f"{args.tasks} pending tasks in the emulator in {time.monotonic() - started:.1f} s")
        asyncio.run(bench(root, redis_url, args))
    finally:
        ours.send("stop")
        child.join(30)


if __name__ == "__main__":
    main()
