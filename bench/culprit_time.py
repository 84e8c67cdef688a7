"""Where a culprit's hours go: each regression's time from its first failing run to its located
culprit, beside the least time any search over the same gap could take on the same pool, and
what the runs on the way did (waited for a worker, built, tested).

A congested synthetic day (``coalescer replay``'s options; the defaults are the day of
``docs/explanation/replay-model.md``) is replayed under one configuration (default
``latest-wins,on-primary-failure=bisect``) on each ``--seeds``, on the embedded store, as
``coalescer replay`` does; every task event is recorded on the way.

* **Located**: ``failing run to culprit`` as the replay reports it
  (:func:`coalescer.replay.metrics.located`).
* **Floor**: at the regression's first failing run, the key's pushes after the newest one that
  had passed by then and before the failing one are the gap: ``g`` pushes, and the culprit is
  one of ``g + 1``. Runs ``w`` at a time cut them into at most ``w + 1`` parts a round, so
  any search takes at least ``ceil(log(g + 1, w + 1))`` rounds, each at least as long as the
  shortest run it needs: the shortest of the gap's runs, after the shortest of their
  dependencies' when no push of the gap has its dependency completed (a test whose build was
  superseded needs the build first; a task that never ran takes its key's shortest run), ``w`` then being the peak workers of the dependency's task queue,
  else of the key's. No wait for a worker, no confirmation: a floor, not a forecast. A task
  already running at the first failure can narrow the gap sooner, so a regression may be
  located faster than its floor (counted: ``under its floor``); the percentiles are what
  compare.
* **Seen, not located, by cause** (:func:`unlocated`): the culprit's test, or the one of the
  push before it, never ran because its dependency is broken (no run of any configuration can
  locate it) or failed on its own; a search over it named an older culprit in the same gap (a
  breakage fixed, then another: the search takes the first failing push, and the newer
  breakage's failure is stood for by it); a search ended inconclusive; or none covered it.
* **The runs on the way** (regressions whose time is at or above the configuration's p75):
  every run of the key's pushes in the gap (the failing one included) and of their
  dependencies that began between the first failing run and the culprit: how long each waited
  to start once pending, and how long it ran, builds (dependencies) and tests apart.

    .venv/bin/python bench/culprit_time.py [--seeds 0 1 2] [--config CONFIG] [--flaky SHARE:RATE]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence

from coalescer.errors import InvalidInput
from coalescer.policy import PrimaryFailure
from coalescer.replay import metrics, runner, synthetic
from coalescer.replay.history import History, TaskSpec, percentile
from coalescer.replay.pool import Outcome, Pool, State
from coalescer.store import Store, open_store

MINUTE = 60_000


class Recording:
    """An index that records every task event (``(task, run)`` -> pending, start and end in
    ms) on the way to the configuration's own index."""

    def __init__(self, inner: runner.StoreIndex) -> None:
        self.inner = inner
        self.runs: dict[tuple[str, int], list[int]] = {}

    def asks(self, task: TaskSpec) -> bool:
        return self.inner.asks(task)

    def record(
        self, task: TaskSpec, run: int, state: str, at_ms: int, since_ms: int, reason: str
    ) -> None:
        times = self.runs.setdefault((task.task_id, run), [since_ms, -1, -1])
        if state == "running":
            times[1] = at_ms
        elif state != "pending":
            times[2] = at_ms
        self.inner.record(task, run, state, at_ms, since_ms, reason)

    async def ask(self, task: TaskSpec, now_ms: int) -> list[str]:
        return await self.inner.ask(task, now_ms)

    async def enforce(self, pool: Pool, now_ms: int) -> None:
        await self.inner.enforce(pool, now_ms)


async def replay(
    history: History, config: runner.Config, store: Store
) -> tuple[Outcome, Recording]:
    """One configuration's replay, as :func:`coalescer.replay.runner.replay` runs it."""
    kind = runner.PolicyIndex if config.on_arrival else runner.StoreIndex
    index = kind(store, "bench.", config)
    recording = Recording(index)
    try:
        out = await Pool(
            history,
            recording,
            on_failure=config.on_failure or PrimaryFailure.SUPERSEDE,
            bisect_confirm=config.bisect_confirm,
        ).run()
    finally:
        await index.forget()
    return out, recording


def floor_ms(history: History, out: Outcome, regression: metrics.Regression) -> int:
    """The least time any search over the regression's gap could take (the module's doc)."""
    _, _, broken = regression
    tasks = history.tasks
    failed = [j for j in broken if out.failed_ms[j] >= 0]
    first = min(failed, key=lambda j: out.failed_ms[j])
    at = out.failed_ms[first]
    key = tasks[first].keys[0]
    mine = sorted(
        (
            i
            for i, t in enumerate(tasks)
            if t.keys and t.keys[0] == key and t.order < tasks[first].order
        ),
        key=lambda i: tasks[i].order,
    )
    passed = [i for i in mine if out.state[i] == State.COMPLETED and 0 <= out.resolved_ms[i] <= at]
    low = tasks[passed[-1]].order if passed else float("-inf")
    gap = [i for i in mine if tasks[i].order > low]
    if not gap:
        return 0
    pos = {t.task_id: i for i, t in enumerate(tasks)}
    shortest = _shortest(tasks)
    deps = [[pos[d] for d in tasks[i].dependencies if d in pos] for i in gap]
    built = any(
        all(out.state[d] == State.COMPLETED and 0 <= out.resolved_ms[d] <= at for d in ds)
        for ds in deps
    )

    def run_ms(i: int) -> int:
        return tasks[i].duration_ms or shortest[tasks[i].keys[0]]

    round_ms, queue = min(run_ms(i) for i in gap), tasks[first].task_queue
    if not built:
        needed = [d for ds in deps for d in ds]
        round_ms += min(run_ms(d) for d in needed)
        queue = tasks[needed[0]].task_queue
    workers = history.workers[queue]
    rounds = math.ceil(math.log(len(gap) + 1, workers + 1) - 1e-9)
    return rounds * round_ms


def _shortest(tasks: Sequence[TaskSpec]) -> dict[str, int]:
    """Each key's shortest recorded run (for a task that never ran)."""
    found: dict[str, int] = {}
    for t in tasks:
        if t.keys and t.duration_ms is not None:
            found[t.keys[0]] = min(found.get(t.keys[0], t.duration_ms), t.duration_ms)
    return found


def runs_on_the_way(
    history: History,
    out: Outcome,
    recording: Recording,
    regression: metrics.Regression,
    located_ms: int,
) -> list[tuple[bool, int, int]]:
    """``(build?, waited ms, ran ms)`` of each run of the gap's pushes and their dependencies
    that began between the first failing run and the located culprit."""
    culprit, _, broken = regression
    tasks = history.tasks
    start = min(out.failed_ms[j] for j in broken if out.failed_ms[j] >= 0)
    end = start + located_ms
    key = tasks[culprit].keys[0]
    newest = max(tasks[j].order for j in broken if out.failed_ms[j] >= 0)
    pushes = {t.task_id for t in tasks if t.keys and t.keys[0] == key and t.order <= newest}
    deps = {d for t in tasks if t.task_id in pushes for d in t.dependencies}
    found = []
    for (task_id, _), (pending, began, ended) in recording.runs.items():
        if (task_id in pushes or task_id in deps) and start <= began <= end and ended >= 0:
            found.append((task_id in deps, began - pending, ended - began))
    return found


#: Why a regression seen failing was not located (:func:`unlocated`), in the order tried.
CAUSES = (
    "its culprit's or the push before's dependency is broken: no run can tell",
    "its culprit's or the push before's dependency failed (not broken)",
    "a search named an older culprit in the same gap (a breakage fixed, then another)",
    "a search ended inconclusive",
    "no search covered it",
)


def unlocated(history: History, out: Outcome, regression: metrics.Regression) -> str:
    """Why a regression seen failing and not located was not (one of :data:`CAUSES`)."""
    culprit, before, broken = regression
    tasks = history.tasks
    pos = {t.task_id: i for i, t in enumerate(tasks)}

    def deps(i: int) -> list[int]:
        return [pos[d] for d in tasks[i].dependencies if d in pos]

    if any(tasks[d].broken for i in (culprit, before) for d in deps(i)):
        return CAUSES[0]
    if any(out.state[d] == State.FAILED for i in (culprit, before) for d in deps(i)):
        return CAUSES[1]
    failing = {tasks[j].task_id for j in broken}
    searches = [s for s in out.searches if tasks[s.primary].task_id in failing]
    if any(s.culprit >= 0 and s.culprit != culprit for s in searches):
        return CAUSES[2]
    if any(s.suspect >= 0 for s in searches):
        return CAUSES[3]
    return CAUSES[4]


def minutes(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / MINUTE:.0f}m"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default="latest-wins,on-primary-failure=bisect")
    parser.add_argument("--hours", type=float, default=24)
    parser.add_argument("--pushes-per-hour", type=float, default=20)
    parser.add_argument("--build-workers", type=int, default=2)
    parser.add_argument("--test-workers", type=int, default=3)
    parser.add_argument("--regressions", type=float, default=0.05)
    parser.add_argument("--intermittent", type=float, default=0.02)
    parser.add_argument("--flaky", default="", metavar="SHARE:RATE")
    args = parser.parse_args()
    try:
        flaky_share, flaky_rate = synthetic.parse_flaky(args.flaky)
    except InvalidInput as exc:
        parser.error(str(exc))
    config = runner.Config.parse(args.config)
    store = await open_store(None, grace_seconds=0)
    print(f"{config.name}; failing run to culprit, and the floor any search has on this pool\n")
    print(
        "seed  located/seen  p50   p95   floor p50  floor p95  located below 1 h  floor below 1 h"
        "  under its floor"
    )
    tail: list[tuple[bool, int, int]] = []
    tail_rounds: list[int] = []
    causes: defaultdict[str, int] = defaultdict(int)
    try:
        for seed in args.seeds:
            history = synthetic.generate(
                synthetic.Synthetic(
                    hours=args.hours,
                    pushes_per_hour=args.pushes_per_hour,
                    build_workers=args.build_workers,
                    test_workers=args.test_workers,
                    regression_rate=args.regressions,
                    intermittent_rate=args.intermittent,
                    flaky_share=flaky_share,
                    flaky_rate=flaky_rate,
                    seed=seed,
                )
            )
            out, recording = await replay(history, config, store)
            found = metrics.regressions(history)
            seen = [r for r in found if any(out.failed_ms[j] >= 0 for j in r[2])]
            located = metrics.located(found, out)
            times = sorted(located.values())
            floor_of = {r[0]: floor_ms(history, out, r) for r in seen}
            floors = list(floor_of.values())
            under = sum(1 for c, ms in located.items() if ms < floor_of[c])
            print(
                f"{seed:>4}  {len(located):>5}/{len(seen):<6}  {minutes(percentile(times, 0.5)):>4}"
                f"  {minutes(percentile(times, 0.95)):>4}  {minutes(percentile(floors, 0.5)):>9}"
                f"  {minutes(percentile(floors, 0.95)):>9}"
                f"  {sum(t < 60 * MINUTE for t in times):>17}"
                f"  {sum(f < 60 * MINUTE for f in floors):>15}  {under:>15}"
            )
            for regression in seen:
                if regression[0] not in located:
                    causes[unlocated(history, out, regression)] += 1
            p75 = percentile(times, 0.75) or 0
            by_culprit = {r[0]: r for r in seen}
            for culprit, ms in located.items():
                if ms >= p75 and ms > 0:
                    runs = runs_on_the_way(history, out, recording, by_culprit[culprit], ms)
                    tail.extend(runs)
            tail_rounds.extend(
                s.rounds for s in out.searches if s.rounds >= 0 and s.ended_ms - s.started_ms >= p75
            )
    finally:
        await store.close()
    print("\nthe slowest quarter: the runs between the first failing run and the culprit")
    print("kind    runs  waited p50  waited p95  ran p50")
    for build, label in ((True, "builds"), (False, "tests")):
        picked = [(w, r) for b, w, r in tail if b is build]
        if not picked:
            continue
        waits = [w for w, _ in picked]
        print(
            f"{label:6}  {len(picked):>4}  {minutes(percentile(waits, 0.5)):>10}"
            f"  {minutes(percentile(waits, 0.95)):>10}"
            f"  {minutes(statistics.median(r for _, r in picked)):>7}"
        )
    print("\nseen failing, not located, by cause (every seed)")
    for cause in CAUSES:
        print(f"{causes[cause]:>4}  {cause}")
    if tail_rounds:
        counts: defaultdict[int, int] = defaultdict(int)
        for n in tail_rounds:
            counts[n] += 1
        print(
            "their searches' rounds: " + ", ".join(f"{n}: {c}" for n, c in sorted(counts.items()))
        )


if __name__ == "__main__":
    asyncio.run(main())
