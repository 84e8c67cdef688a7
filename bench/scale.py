"""Benchmark: the query's cost as the index grows from 1,000 to 1,000,000 tracked tasks, and
Redis memory per tracked task.

    python bench/scale.py           (part of make bench; needs redis-server and wrk)

Runs against a private ``redis-server`` (tests/redis_server.py), never the shared one. The
queried set stays the same at every size: :data:`QUERIED` keys x 50 pending tasks (1,000
tasks), wrk rotating over every (key, taskId) of it. The index then grows around it with keys
of :data:`FILLER_PER_KEY` pending tasks each, written through the store's batch write path
(``Store.apply``, what ingest writes), to 100k and then 1M tracked tasks; the query is measured
at each size. Memory is Redis's ``used_memory`` (INFO memory) after minus before, divided by
the tasks tracked. SCALE_MAX_SECONDS (default 900) bounds the loading; BENCH_SECONDS sets the
length of each wrk run (three per size, median).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving import (  # noqa: E402
    CONNECTIONS,
    SECONDS,
    Run,
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
from tests.redis_server import redis_server  # noqa: E402

QUERIED, PER_KEY = 20, 50
FILLER_PER_KEY = 100
SIZES = (1_000, 100_000, 1_000_000)
RUNS = 3
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
    results: list[tuple[int, Run, float]] = []
    with redis_server() as server, scratch() as tmp:
        used = lambda: int(server.client.info("memory")["used_memory"])  # noqa: E731
        empty = used()
        now_ms = int(time.time() * 1000)
        ids = mix_ids(QUERIED, PER_KEY, seed=5)
        asyncio.run(write(server.url, mix_events(ids, now_ms)))
        paths = mix_paths(ids)
        script = rotation_script(paths, Path(tmp))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        tracked = QUERIED * PER_KEY
        print(
            f"query cost by index size: {QUERIED} keys x {PER_KEY} tasks queried (wrk -t1 "
            f"-c{CONNECTIONS}, {len(paths)} URLs in turn, median of {RUNS} x {SECONDS} s), the "
            f"rest in keys of {FILLER_PER_KEY}; a private redis-server",
            flush=True,
        )
        with service(port, server.url) as proc:
            cpu = cpu_of(proc.pid, redis_cpu(server.url))
            check_mix(base, paths)
            for size in SIZES:
                if size > tracked:
                    t0, first = time.monotonic(), tracked - QUERIED * PER_KEY
                    last = size - QUERIED * PER_KEY

                    def progress(done: int, t0: float = t0, first: int = first) -> None:
                        if done % 100_000 == 0:
                            rate = done / (time.monotonic() - t0)
                            print(
                                f"  loading: {first + done:,} filler tasks, {rate:,.0f}/s",
                                flush=True,
                            )
                        if time.monotonic() - started > BUDGET:
                            raise SystemExit(f"loading took over {BUDGET:.0f} s: stopped")

                    asyncio.run(write(server.url, filler(first, last, now_ms), progress=progress))
                    rate = (last - first) / (time.monotonic() - t0)
                    tracked = size
                    print(f"  loaded {size:,} tracked tasks ({rate:,.0f} events/s)", flush=True)
                assert server.client.dbsize() > 0
                memory = (used() - empty) / tracked
                wrk(base, script=script, seconds=1)  # warm-up: connections, caches
                runs = [wrk_run(base, script=script, cpu=cpu) for _ in range(RUNS)]
                run = Run(
                    statistics.median(r.rps for r in runs),
                    statistics.median(r.cpu_us for r in runs),
                )
                results.append((size, run, memory))
                print(
                    f"  {size:>9,} tracked: {run.rps:7.0f} requests/s, {run.cpu_us:.0f} us CPU "
                    f"per request (runs {', '.join(f'{r.rps:.0f}' for r in runs)}; {load()})",
                    flush=True,
                )
            check_mix(base, paths, every=10)
    first = results[0][1]
    print(f"\nsummary (medians; {load()}):")
    print(
        f"  {'tracked tasks':>14} {'requests/s':>11} {'vs 1k':>7} "
        f"{'CPU us/request':>15} {'vs 1k':>7} {'Redis B/task':>13}"
    )
    for size, run, memory in results:
        print(
            f"  {size:>14,} {run.rps:11.0f} {run.rps / first.rps:6.2f}x {run.cpu_us:15.0f} "
            f"{run.cpu_us / first.cpu_us:6.2f}x {memory:13.0f}"
        )
    print(
        f"  Redis bytes per tracked task at {SIZES[-1]:,}: {results[-1][2]:.0f} "
        f"(target <= {TARGET_BYTES}; the answers logged for the pages included)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
