"""Benchmark: ``coalescer serve --workers 2`` against one process, on the rotating mix.

    python scripts/with_services.py python bench/workers.py     (part of make bench)

Both serve the same index (bench/serving.py's mix) from the same Redis; wrk drives each with 32
connections from one thread, in alternating rounds. On a 2-core box the load generator and
Redis share the cores with the web processes, so two processes cannot reach twice one's rate.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import redis
from serving import (
    CONNECTIONS,
    ROUNDS,
    SECONDS,
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
    write,
    wrk_run,
)

REDIS_URL = os.environ.get("COALESCER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
#: What two processes must reach against one on 2 cores (the load generator takes its share).
TARGET = 1.3


def main() -> int:
    client = redis.Redis.from_url(REDIS_URL)
    if client.dbsize():
        raise SystemExit(
            f"{REDIS_URL} is not empty: point COALESCER_TEST_REDIS_URL at an empty one"
        )
    ids = mix_ids()
    asyncio.run(write(REDIS_URL, mix_events(ids, int(time.time() * 1000))))
    paths = mix_paths(ids)
    one, two = free_port(), free_port()
    try:
        with (
            scratch() as tmp,
            service(one, REDIS_URL) as one_proc,
            service(two, REDIS_URL, "--workers", "2") as two_proc,
        ):
            used = redis_cpu(REDIS_URL)
            cpu = {"one": cpu_of(one_proc.pid, used), "two": cpu_of(two_proc.pid, used)}
            script = rotation_script(paths, Path(tmp))
            for port in (one, two):
                check_mix(f"http://127.0.0.1:{port}", paths, every=13)
            print(
                f"web processes, rotating mix, requests/s: median of {ROUNDS} alternating "
                f"rounds of {SECONDS} s, wrk -t1 -c{CONNECTIONS}; {os.cpu_count()} CPUs",
                flush=True,
            )
            med = alternate(
                {
                    "--workers 2": lambda: wrk_run(
                        f"http://127.0.0.1:{two}", script=script, cpu=cpu["two"]
                    ),
                    "one process": lambda: wrk_run(
                        f"http://127.0.0.1:{one}", script=script, cpu=cpu["one"]
                    ),
                }
            )
    finally:
        client.flushdb()
        client.close()
    one_run, two_run = med["one process"], med["--workers 2"]
    print(f"\nsummary (medians; {load()}):")
    print(
        f"  {'':16} {'requests/s':>10} {'ratio':>7} {'CPU us/request (web + Redis)':>29} "
        f"{'machine idle':>12}"
    )
    for name, run in (("one process", one_run), ("--workers 2", two_run)):
        ratio = f"{run.rps / one_run.rps:6.2f}x" if run is two_run else ""
        print(f"  {name:16} {run.rps:10.0f} {ratio:>7} {run.cpu_us:29.0f} {run.idle:12.0%}")
    # Two processes only have the CPU that one leaves idle. Per request, the machine spends
    # what the web processes and Redis spend, and the rest (the load generator, the kernel):
    # with the first as two processes spend it, all the cores busy reach at most this.
    cores = os.cpu_count() or 1
    busy_us = (1 - one_run.idle) * cores * 1e6 / one_run.rps  # per request, every process's
    ceiling = cores * 1e6 / (two_run.cpu_us + busy_us - one_run.cpu_us) / one_run.rps
    print(
        f"  target >= {TARGET}x; the idle CPU one process leaves, at the CPU per request two "
        f"take, allows at most {ceiling:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
