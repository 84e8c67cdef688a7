"""How long ``coalescer replay`` takes on 100,000 tasks under four configurations.

A synthetic history (two platforms, a build and three tests each per push, 60 pushes an hour at
the daily peak, a pool sized to back up at peak) is replayed under ``off``,
``age=3600,size=5``, ``age=600,size=2`` and ``on-claim``, concurrently, through Redis
(``--redis-url``, ``REDIS_URL`` or ``COALESCER_TEST_REDIS_URL``, which
``scripts/with_services.py`` sets), as ``coalescer replay`` does. Prints
the wall time of the replay (generation and metrics apart) and each configuration's figures.

    .venv/bin/python scripts/with_services.py .venv/bin/python bench/replay.py [--tasks 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from coalescer.replay import metrics, report, runner, synthetic
from coalescer.store import open_store

CONFIGS = ("off", "age=3600,size=5", "age=600,size=2", "on-claim")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL") or os.environ.get("COALESCER_TEST_REDIS_URL"),
    )
    args = parser.parse_args()
    pushes = args.tasks / 8
    mean_rate = 60 * sum(synthetic.DAILY) / 24
    spec = synthetic.Synthetic(
        hours=pushes / mean_rate * 1.01,
        pushes_per_hour=60,
        build_workers=25,
        test_workers=30,
        seed=1,
    )
    started = time.perf_counter()
    history = synthetic.generate(spec)
    generated = time.perf_counter() - started
    configs = [runner.Config.parse(c) for c in CONFIGS]
    store = await open_store(args.redis_url, grace_seconds=3600)
    try:
        started = time.perf_counter()
        outcomes = await runner.replay(history, configs, store)
        replayed = time.perf_counter() - started
    finally:
        await store.close()
    base = outcomes[0].worker_ms / 3_600_000
    summaries = tuple(
        metrics.summarize(history, c.name, o, base) for c, o in zip(configs, outcomes, strict=True)
    )
    print(report.table(report.Report(history, summaries, replayed)).split("\n\n")[0])
    asked = sum(s.asked for s in summaries)
    print(
        f"\n{len(history.tasks):,} tasks x {len(configs)} configurations on "
        f"{'Redis' if args.redis_url else 'the embedded store'}: generated in {generated:.1f} s, "
        f"replayed in {replayed:.1f} s ({asked:,} questions to the index, "
        f"{asked / replayed:,.0f}/s)"
    )


if __name__ == "__main__":
    asyncio.run(main())
