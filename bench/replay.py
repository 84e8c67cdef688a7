"""How long ``coalescer replay`` takes on 100,000 tasks under four configurations, and on a
smaller history under a policy file.

A synthetic history (two platforms, a build and three tests each per push, 60 pushes an hour at
the daily peak, a pool sized to back up at peak) is replayed under ``off``,
``age=3600,size=5``, ``age=600,size=2`` and ``on-claim``, concurrently, through Redis
(``--redis-url``, ``REDIS_URL`` or ``COALESCER_TEST_REDIS_URL``, which
``scripts/with_services.py`` sets), as ``coalescer replay`` does. Then the first
``--policy-tasks`` of the same history are replayed under ``off`` and :data:`POLICY` (builds
latest-wins, holding victims until their primary ends; one platform's tests latest-wins,
canceling running ones that started less than 5 minutes before; the other's tests on claim),
which needs an empty database. Prints the wall time of each replay
(generation and metrics apart), each configuration's figures and the load average.

    .venv/bin/python scripts/with_services.py .venv/bin/python bench/replay.py [--tasks 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from coalescer.policy import rules
from coalescer.replay import metrics, report, runner, synthetic
from coalescer.replay.history import History
from coalescer.store import Store, open_store
from coalescer.store.replay import holds_nothing

CONFIGS = ("off", "age=3600,size=5", "age=600,size=2", "on-claim")
POLICY = """\
rules:
  - name: builds
    keys: "build.*"
    strategy: latest-wins
    on-primary-failure: release
  - name: tests-p1
    keys: "test.p1.*"
    strategy: latest-wins
    supersede-running: true
    protect-running-after: 5m
"""


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cores)"


async def timed(
    history: History, configs: list[runner.Config], store: Store
) -> tuple[list[metrics.Summary], float]:
    started = time.perf_counter()
    outcomes = await runner.replay(history, configs, store)
    replayed = time.perf_counter() - started
    base = outcomes[0].worker_ms / 3_600_000
    summaries = [
        metrics.summarize(history, c.name, o, base, rule_of=c.rule_for, baseline=outcomes[0])
        for c, o in zip(configs, outcomes, strict=True)
    ]
    return summaries, replayed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL") or os.environ.get("COALESCER_TEST_REDIS_URL"),
    )
    parser.add_argument("--policy-tasks", type=int, default=20_000, help="0: no policy replay")
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
        print(load())
        summaries, replayed = await timed(history, configs, store)
        text = report.table(report.Report(history, tuple(summaries), replayed))
        print(text.split("\n\n")[0])
        asked = sum(s.asked for s in summaries)
        print(
            f"\n{len(history.tasks):,} tasks x {len(configs)} configurations on "
            f"{'Redis' if args.redis_url else 'the embedded store'}: generated in "
            f"{generated:.1f} s, replayed in {replayed:.1f} s ({asked:,} questions to the "
            f"index, {asked / replayed:,.0f}/s); {load()}"
        )
        if args.policy_tasks and args.redis_url and not await holds_nothing(store):
            print("\nno policy replay: the database holds keys (it needs an empty one)")
        elif args.policy_tasks:
            part = History.build(
                history.tasks[: args.policy_tasks], workers=history.workers, source="bench"
            )
            policy = runner.Config.from_policy(rules.loads(POLICY, "bench", toml=False), "bench")
            summaries, replayed = await timed(part, [runner.Config(False), policy], store)
            text = report.table(report.Report(part, tuple(summaries), replayed))
            print("\n" + text.split("\n\n")[0] + "\n\n" + text.split("\n\n")[-1])
            print(
                f"\n{len(part.tasks):,} tasks under off and a policy file: replayed in "
                f"{replayed:.1f} s ({len(part.tasks) / replayed:,.0f} tasks/s, both "
                f"configurations at once); {load()}"
            )
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(main())
