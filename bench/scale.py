"""Benchmark: the query's cost as the index grows from 1,000 to 1,000,000 tracked tasks, and
Redis memory per tracked task.

    python bench/scale.py           (part of make bench; needs redis-server and wrk)

Each size has a private ``redis-server`` (tests/redis_server.py, never the shared one) and a
``coalescer serve`` of its own, so that the sizes are measured side by side, in alternating
rounds, as the other benchmarks compare their lines. Every server holds the same queried set:
:data:`QUERIED` keys x 50 pending tasks (1,000 tasks), wrk rotating over every (key, taskId)
of it. The larger indexes add keys of :data:`FILLER_PER_KEY` pending tasks each around it,
written through the store's batch write path (``Store.apply``, what ingest writes), to 100k
and 1M tracked tasks. Memory is Redis's ``used_memory`` (INFO memory) after minus before,
divided by the tasks tracked. SCALE_MAX_SECONDS (default 900) bounds the loading;
BENCH_ROUNDS and BENCH_SECONDS set the rounds and the length of each wrk run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving import (  # noqa: E402
    CONNECTIONS,
    ROUNDS,
    SECONDS,
    Run,
    alternate,
    check_mix,
    cpu_of,
    free_port,
    load,
    mix_events,
    mix_ids,
    mix_paths,
    redis_cpu,
    rotation_script,
    scratch,
    service,
    slug,
    write,
    wrk,
    wrk_run,
)

from coalescer.model import TaskEvent  # noqa: E402
from tests.redis_server import RedisServer, redis_server  # noqa: E402

QUERIED, PER_KEY = 20, 50
FILLER_PER_KEY = 100
SIZES = (1_000, 100_000, 1_000_000)
BUDGET = float(os.environ.get("SCALE_MAX_SECONDS", "900"))
TARGET_BYTES = 250


def filler(start: int, stop: int, now_ms: int) -> Iterator[TaskEvent]:
    """Filler tasks ``start``..``stop`` (counted over the whole filler), pending, 100 per key."""
    rng = random.Random(start)
    for i in range(start, stop):
        yield TaskEvent(
            slug(rng), 0, "pending", (f"fill.k{i // FILLER_PER_KEY}",), float(i),
            now_ms + 86_400_000, now_ms - 60_000,
        )  # fmt: skip


def main() -> int:
    started = time.monotonic()
    now_ms = int(time.time() * 1000)
    ids = mix_ids(QUERIED, PER_KEY, seed=5)
    paths = mix_paths(ids)
    queried = QUERIED * PER_KEY
    print(
        f"query cost by index size: {QUERIED} keys x {PER_KEY} tasks queried (wrk -t1 "
        f"-c{CONNECTIONS}, {len(paths)} URLs in turn), the rest in keys of {FILLER_PER_KEY}; a "
        f"private redis-server and serve process per size, median of {ROUNDS} alternating "
        f"rounds of {SECONDS} s",
        flush=True,
    )
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(scratch())
        script = rotation_script(paths, Path(tmp))
        runs: dict[str, Callable[[], Run]] = {}
        servers: dict[str, tuple[RedisServer, int, int]] = {}
        for size in SIZES:
            server = stack.enter_context(redis_server())
            empty = int(server.client.info("memory")["used_memory"])
            asyncio.run(write(server.url, mix_events(ids, now_ms)))
            if size > queried:
                load_filler(server.url, size - queried, now_ms, started)
            servers[f"{size:,}"] = (server, empty, size)
            port = free_port()
            proc = stack.enter_context(service(port, server.url))
            base = f"http://127.0.0.1:{port}"
            check_mix(base, paths)
            wrk(base, script=script, seconds=1)  # warm-up: connections, caches
            used = redis_cpu(server.url)
            runs[f"{size:,}"] = partial(
                wrk_run, base, script=script, cpu=cpu_of(proc.pid, used), redis=used
            )
        results = alternate(runs)
        # After the queries: the answers they logged for the pages count too.
        memory = {
            name: (int(server.client.info("memory")["used_memory"]) - empty) / size
            for name, (server, empty, size) in servers.items()
        }
    first = results[f"{SIZES[0]:,}"]
    print(f"\nsummary (medians; {load()}):")
    print(
        f"  {'tracked tasks':>14} {'requests/s':>11} {'vs 1k':>7} "
        f"{'CPU us/request (web + Redis)':>29} {'vs 1k':>7} {'Redis B/task':>13}"
    )
    for name, run in results.items():
        split = f"{run.cpu_us:.0f} ({run.cpu_us - run.redis_us:.0f} + {run.redis_us:.0f})"
        print(
            f"  {name:>14} {run.rps:11.0f} {run.rps / first.rps:6.2f}x {split:>29} "
            f"{run.cpu_us / first.cpu_us:6.2f}x {memory[name]:13.0f}"
        )
    print(
        f"  Redis bytes per tracked task at {SIZES[-1]:,}: {memory[f'{SIZES[-1]:,}']:.0f} "
        f"(target <= {TARGET_BYTES}; the answers logged for the pages included)"
    )
    return 0


def load_filler(url: str, count: int, now_ms: int, started: float) -> None:
    """Write ``count`` filler tasks to the Redis at ``url``, showing progress."""
    t0 = time.monotonic()

    def progress(done: int) -> None:
        if done % 100_000 == 0:
            rate = done / (time.monotonic() - t0)
            print(f"  loading: {done:,} filler tasks, {rate:,.0f}/s", flush=True)
        if time.monotonic() - started > BUDGET:
            raise SystemExit(f"loading took over {BUDGET:.0f} s: stopped")

    asyncio.run(write(url, filler(0, count, now_ms), progress=progress))
    rate = count / (time.monotonic() - t0)
    print(f"  loaded {count:,} filler tasks ({rate:,.0f} events/s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
