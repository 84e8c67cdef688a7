"""``--on-primary-failure bisect``: after a failed primary, the tasks it held are bisected to
locate the first failing push; the others are superseded by the run that stands for them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import pytest

from coalescer import cli
from coalescer.emulator.clock import format_time
from coalescer.emulator.harness import QueueEmulator
from coalescer.errors import ConfigError
from coalescer.settings import Settings
from coalescer.worker import Claim, OnPrimaryFailure, Options, Outcome, Superseded
from coalescer.worker import cli as worker_cli
from coalescer.worker.culprit import UNKNOWN
from coalescer.worker.protocol import COMPLETED, FAILED
from tests.worker.support import (
    Superseder,
    Tasks,
    claim_work,
    make_shim,
    poll,
    resolved,
    running,
)
from tests.worker.test_with_service import feed, service  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration


@dataclasses.dataclass
class Pushes:
    """An ``execute`` for tasks of pushes 1..n: push ``p`` fails from ``first_bad`` on, and
    its ``(push, attempt)`` in ``flaky`` fails once although it is good."""

    ids: list[str]
    first_bad: int
    flaky: frozenset[tuple[int, int]] = frozenset()
    clock: QueueEmulator | None = None
    advance: float = 0.0
    block: asyncio.Event | None = None
    calls: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    async def __call__(self, claim: Claim, supersedes: Sequence[Superseded]) -> Outcome:
        push = self.ids.index(claim.task_id) + 1
        self.calls.append((push, claim.attempt))
        if push == len(self.ids) and self.clock is not None and self.advance:
            await asyncio.to_thread(self.clock.clock.advance, self.advance)
        if self.block is not None and push != len(self.ids):
            await asyncio.Event().wait()  # until the worker stops it
        if push >= self.first_bad or (push, claim.attempt) in self.flaky:
            return FAILED
        return COMPLETED


def bisecting(options: Options, confirm: int) -> Options:
    return dataclasses.replace(
        options, on_primary_failure=OnPrimaryFailure.BISECT, bisect_confirm=confirm
    )


def superseded_by(tasks: Tasks, task_id: str) -> object:
    return tasks.artifact(task_id, 0, "public/superseded-by.json")


async def test_bisection_runs_few_pushes_and_supersedes_the_rest_by_what_stands_for_them(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    ids = [tasks.create() for _ in range(9)]
    superseder.lists["k"] = ids
    execute = Pushes(ids, first_bad=5)
    async with make_shim(queue_emulator, bisecting(options, 0)) as shim:
        report = await shim.run((await claim_work(shim))[0], execute)

    # The primary (push 9), then the middle of pushes 1..8 and so on: 3 runs beyond it.
    assert execute.calls == [(9, 0), (4, 0), (6, 0), (5, 0)]
    found = report.bisection
    assert found is not None
    assert found.culprit == (ids[4], 0) and found.last_good == (ids[3], 0)
    assert found.extra_runs == 3 and found.intermittent == []
    assert [(r.task_id, r.passed) for r in found.runs] == [
        (ids[8], False),
        (ids[3], True),
        (ids[5], False),
        (ids[4], False),
    ]
    assert report.outcome == FAILED and report.aborted is None
    states = [tasks.last_run(t)["reasonResolved"] for t in ids]
    assert states == ["superseded"] * 3 + ["completed", "failed", "failed"] + ["superseded"] * 2 + [
        "failed"
    ]
    for push in (1, 2, 3):
        assert superseded_by(tasks, ids[push - 1]) == {"taskId": ids[3], "runId": 0}
    for push in (7, 8):
        assert superseded_by(tasks, ids[push - 1]) == {"taskId": ids[4], "runId": 0}
    assert found.stood_for[(ids[0], 0)] == (ids[3], 0)
    assert tasks.artifact(ids[3], 0, "public/supersedes.json") == [
        {"taskId": t, "runId": 0} for t in ids[:3]
    ]
    assert tasks.artifact(ids[4], 0, "public/supersedes.json") == [
        {"taskId": t, "runId": 0} for t in ids[6:8]
    ]
    assert tasks.artifact(ids[8], 0, "public/supersedes.json") is None
    assert sorted(report.superseded) == sorted((t, 0) for t in [*ids[:3], *ids[6:8]])
    text = tasks.artifact(ids[6], 0, "public/logs/live_backing.log")
    assert f"the culprit: task {ids[4]} run 0" in text
    assert f"the last good: task {ids[3]} run 0" in text
    assert "newer than the culprit" in text
    assert f"{ids[4]} is 5th, the culprit" in text
    assert "older than the last good task" in tasks.artifact(
        ids[0], 0, "public/logs/live_backing.log"
    )


def held_but(ids: list[str], left_out: int) -> list[str]:
    """The superseder's answer without push ``left_out``: it ran, or runs, on another worker."""
    return [t for t in ids if t != ids[left_out - 1]]


@pytest.mark.parametrize("state", ["failed", "running", "pending"])
async def test_a_push_between_the_last_good_and_the_culprit_not_passed_elsewhere_names_none(
    queue_emulator: QueueEmulator,
    options: Options,
    tasks: Tasks,
    superseder: Superseder,
    state: str,
) -> None:
    """Push 4 broke, but another worker had it: the search over what this one held finds
    push 5 the first failing. The service's index says push 4 did not pass, so push 5 is only
    a suspect, and no victim's log calls it the culprit."""
    ids = [tasks.create() for _ in range(9)]
    superseder.lists["k"] = held_but(ids, 4)
    superseder.between["k"] = [{"taskId": ids[3], "runId": 0, "order": 4.0, "state": state}]
    async with make_shim(queue_emulator, bisecting(options, 0)) as shim:
        report = await shim.run((await claim_work(shim))[0], Pushes(ids, first_bad=4))

    found = report.bisection
    assert found is not None
    assert superseder.gaps == [{"key": "k", "after": ids[2], "before": ids[4]}]
    assert (found.verdict, found.culprit, found.suspect) == ("inconclusive", None, (ids[4], 0))
    assert found.between == [ids[3]] and found.last_good == (ids[2], 0)
    text = tasks.artifact(ids[6], 0, "public/logs/live_backing.log")
    assert f"found task {ids[4]} run 0 the first failing of them, but named no culprit" in text
    assert "newer than that task, whose failure stands for it" in text
    assert "the culprit" not in text


async def test_a_push_between_that_passed_elsewhere_leaves_the_culprit_named(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    ids = [tasks.create() for _ in range(9)]
    superseder.lists["k"] = held_but(ids, 4)
    superseder.between["k"] = [{"taskId": ids[3], "runId": 0, "order": 4.0, "state": "completed"}]
    async with make_shim(queue_emulator, bisecting(options, 0)) as shim:
        report = await shim.run((await claim_work(shim))[0], Pushes(ids, first_bad=5))

    found = report.bisection
    assert found is not None and found.between == []
    assert (found.verdict, found.culprit, found.last_good) == ("culprit", (ids[4], 0), (ids[2], 0))


async def test_a_culprit_is_not_named_when_the_service_cannot_say_what_lies_between(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    ids = [tasks.create() for _ in range(5)]
    superseder.lists["k"] = ids
    superseder.between["k"] = None  # the service answers 503
    async with make_shim(queue_emulator, bisecting(options, 0)) as shim:
        report = await shim.run((await claim_work(shim))[0], Pushes(ids, first_bad=3))

    found = report.bisection
    assert found is not None and found.between == [UNKNOWN]
    assert (found.verdict, found.culprit, found.suspect) == ("inconclusive", None, (ids[2], 0))


async def test_a_culprit_is_not_named_over_tasks_ended_before_the_index_knew_every_task(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    ids = [tasks.create() for _ in range(5)]
    superseder.lists["k"] = ids
    # The service's store was emptied after the tasks were created: tasks of the key that
    # ended before then are unknown to it, whatever it lists between.
    superseder.known_since = format_time(queue_emulator.clock.now() + timedelta(seconds=1))
    async with make_shim(queue_emulator, bisecting(options, 0)) as shim:
        report = await shim.run((await claim_work(shim))[0], Pushes(ids, first_bad=3))

    found = report.bisection
    assert found is not None and found.between == [UNKNOWN]
    assert (found.verdict, found.culprit, found.suspect) == ("inconclusive", None, (ids[2], 0))
    assert found.last_good == (ids[1], 0)


async def test_a_confirmed_failure_narrows_and_an_intermittent_one_is_not_blamed(
    queue_emulator: QueueEmulator,
    options: Options,
    tasks: Tasks,
    superseder: Superseder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ids = [tasks.create() for _ in range(9)]
    superseder.lists["k"] = ids
    execute = Pushes(ids, first_bad=5, flaky=frozenset({(4, 0)}))
    caplog.set_level("INFO", "coalescer.worker")
    async with make_shim(queue_emulator, bisecting(options, 1)) as shim:
        report = await shim.run((await claim_work(shim))[0], execute)

    assert execute.calls == [(9, 0), (9, 1), (4, 0), (4, 1), (6, 0), (6, 1), (5, 0), (5, 1)]
    found = report.bisection
    assert found is not None
    assert found.culprit == (ids[4], 0) and found.last_good == (ids[3], 0)
    assert found.intermittent == [(ids[3], 0)]
    assert tasks.last_run(ids[3])["state"] == "completed"
    assert tasks.last_run(ids[4])["state"] == "failed"
    [line] = [r.getMessage() for r in caplog.records if "culprit located" in r.getMessage()]
    assert f"task {ids[4]} run 0 is the first failing of 8 tasks" in line
    assert f"last good task {ids[3]} run 0; 7 extra runs, 1 intermittent" in line


async def test_a_primary_whose_failure_does_not_come_back_supersedes_them_all(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    ids = [tasks.create() for _ in range(4)]
    superseder.lists["k"] = ids
    execute = Pushes(ids, first_bad=99, flaky=frozenset({(4, 0)}))
    async with make_shim(queue_emulator, bisecting(options, 1)) as shim:
        report = await shim.run((await claim_work(shim))[0], execute)

    assert execute.calls == [(4, 0), (4, 1)]
    assert report.outcome == COMPLETED
    assert report.bisection is not None and report.bisection.culprit is None
    assert report.bisection.intermittent == [(ids[3], 0)]
    assert tasks.last_run(ids[3])["state"] == "completed"
    assert tasks.artifact(ids[3], 0, "public/supersedes.json") == [
        {"taskId": t, "runId": 0} for t in ids[:3]
    ]
    for task_id in ids[:3]:
        assert superseded_by(tasks, task_id) == {"taskId": ids[3], "runId": 0}
        text = tasks.artifact(task_id, 0, "public/logs/live_backing.log")
        assert "then passed when run again: the failure was intermittent" in text


async def test_a_victim_whose_deadline_comes_first_is_released_to_run_itself(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    ids = [tasks.create() for _ in range(9)]
    now = queue_emulator.clock.now()
    # The primary takes ten minutes: a search may take twice that before push 2 runs.
    soon = tasks.create(deadline=format_time(now + timedelta(minutes=25)))
    ids[1:2] = [soon]
    superseder.lists["k"] = ids
    execute = Pushes(ids, first_bad=5, clock=queue_emulator, advance=600)
    async with make_shim(queue_emulator, bisecting(options, 0)) as shim:
        report = await shim.run((await claim_work(shim))[0], execute)

    assert (soon, 0) in report.released and 2 not in [p for p, _ in execute.calls]
    runs = tasks.status(soon)["runs"]
    assert [r["reasonResolved"] for r in runs[:1]] == ["worker-shutdown"]
    assert runs[-1]["state"] == "pending"
    assert superseded_by(tasks, soon) is None
    assert report.bisection is not None and report.bisection.culprit == (ids[4], 0)
    assert superseded_by(tasks, ids[0]) == {"taskId": ids[3], "runId": 0}


async def test_a_shutdown_mid_search_reports_what_ran_and_releases_the_rest(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    ids = [tasks.create() for _ in range(5)]
    superseder.lists["k"] = ids
    stop = asyncio.Event()
    execute = Pushes(ids, first_bad=3, block=stop)
    async with make_shim(queue_emulator, bisecting(options, 0)) as shim:
        [work] = await claim_work(shim)
        running_set = asyncio.create_task(shim.run(work, execute, stop=stop))
        await poll(lambda: len(execute.calls) == 2, what="a victim running")
        stop.set()
        report = await asyncio.wait_for(running_set, 10)

    assert report.aborted == "shutdown"
    assert report.outcome == FAILED and tasks.last_run(ids[-1])["state"] == "failed"
    assert sorted(report.released) == sorted((t, 0) for t in ids[:-1])
    for task_id in ids[:-1]:
        assert tasks.status(task_id)["runs"][0]["reasonResolved"] == "worker-shutdown"
        assert tasks.last_run(task_id)["state"] == "pending"


def command_pushes(tasks: Tasks, url: str, count: int, first_bad: int, mark: Path) -> list[str]:
    """Tasks whose command fails from push ``first_bad`` on; push 4 fails the first time it
    runs when ``mark`` names a file that does not exist yet (it is then created)."""
    script = (
        'if [ "$PUSH" = 4 ] && [ -n "$MARK" ] && [ ! -e "$MARK" ]; then touch "$MARK"; '
        f'echo flaky; exit 1; fi; test "$PUSH" -lt {first_bad}'
    )
    return [
        tasks.create(
            url=url,
            payload={
                "command": ["sh", "-c", script],
                "env": {"PUSH": str(push), "MARK": str(mark) if mark.name else ""},
            },
        )
        for push in range(1, count + 1)
    ]


@pytest.mark.parametrize("flaky", [False, True])
async def test_the_reference_worker_bisects_through_the_service(
    flaky: bool,
    service: str,  # noqa: F811
    settings: Settings,
    queue_emulator: QueueEmulator,
    options: Options,
    tasks: Tasks,
    tmp_path: Path,
) -> None:
    mark = tmp_path / "flaky" if flaky else Path()
    ids = command_pushes(tasks, f"{service}/k", 9, first_bad=5, mark=mark)
    await feed(service, queue_emulator, settings)
    configured = dataclasses.replace(
        bisecting(options, 1 if flaky else 0), allow=(service,), tick=0.02
    )
    async with make_shim(queue_emulator, configured) as shim, running(shim) as [worker]:
        await poll(resolved(tasks, *ids), within=60, what="every push resolved")
        await poll(lambda: worker.reports, what="the report")

    [report] = worker.reports
    found = report.bisection
    assert found is not None
    assert found.culprit == (ids[4], 0) and found.last_good == (ids[3], 0)
    assert found.extra_runs <= (4 if not flaky else 9)
    ran = {r.task_id for r in found.runs}
    assert ran == {ids[3], ids[4], ids[5], ids[8]}
    assert [tasks.last_run(t)["state"] for t in (ids[3], ids[4])] == ["completed", "failed"]
    for i, task_id in enumerate(ids):
        if task_id in ran:
            continue
        stand_in = ids[3] if i < 3 else ids[4]
        assert tasks.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": stand_in,
            "runId": 0,
        }
        assert tasks.last_run(task_id)["reasonResolved"] == "superseded"
    if flaky:
        assert found.intermittent == [(ids[3], 0)]
        log = tasks.artifact(ids[3], 0, "public/logs/live.log")
        assert "flaky" in log and "attempt 2 of run 0" in log
        assert log.index("exit code 1") < log.index("attempt 2") < log.index("exit code 0")
    else:
        assert found.extra_runs == 3


def test_the_command_line_sets_bisect_and_its_confirmations(
    monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    chosen: list[Options] = []

    async def main(args: object, tc: object, options: Options) -> None:
        chosen.append(options)

    monkeypatch.setattr(worker_cli, "_main", main)
    monkeypatch.setenv("TASKCLUSTER_ROOT_URL", "http://queue.invalid")
    base = ["worker", "--task-queue-id", "p/w", "--worker-group", "g", "--worker-id", "i"]
    parser = cli.build_parser()
    bisect = [*base, "--on-primary-failure", "bisect"]
    args = parser.parse_args([*bisect, "--bisect-confirm", "0", "--bisect-confidence", "0.9"])
    assert worker_cli.handle(args, settings) == 0
    [options] = chosen
    assert options.on_primary_failure is OnPrimaryFailure.BISECT
    assert options.bisect_confirm == 0 and options.bisect_confidence == 0.9
    defaults = parser.parse_args(base)
    assert defaults.bisect_confirm == 3 and defaults.bisect_confidence == 0.99
    with pytest.raises(ConfigError, match="--bisect-confirm"):
        worker_cli.handle(parser.parse_args([*base, "--bisect-confirm", "-1"]), settings)
    for bad in ("1", "0.2"):
        with pytest.raises(ConfigError, match="--bisect-confidence"):
            worker_cli.handle(parser.parse_args([*base, "--bisect-confidence", bad]), settings)


async def test_a_failing_resolution_raises_only_after_the_others_have_ended(
    queue_emulator: QueueEmulator,
    options: Options,
    tasks: Tasks,
    superseder: Superseder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = [tasks.create() for _ in range(9)]
    superseder.lists["k"] = ids
    ended: list[str] = []
    async with make_shim(queue_emulator, bisecting(options, 0)) as shim:
        real = shim.resolver.supersede
        failed = asyncio.Event()

        async def supersede(claim: Claim, primary: Claim, why: object) -> object:
            if claim.task_id == ids[0]:
                failed.set()
                raise RuntimeError("the queue failed this call")
            await asyncio.wait_for(failed.wait(), 10)  # ends after the failing one
            done = await real(claim, primary, why)  # type: ignore[arg-type]
            ended.append(claim.task_id)
            return done

        monkeypatch.setattr(shim.resolver, "supersede", supersede)
        with pytest.raises(RuntimeError, match="the queue failed this call"):
            await shim.run((await claim_work(shim))[0], Pushes(ids, first_bad=5))
        # Pushes 2, 3, 7 and 8 were superseded before the error came out, none left running.
        assert sorted(ended) == sorted([ids[1], ids[2], ids[6], ids[7]])
