"""The shim against the queue emulator: the worked example of Taskcluster's superseding
documentation, orders, retried runs, and what the primary sees."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest

from coalescer.emulator.harness import QueueEmulator
from coalescer.worker import Claim, Options, Order, Outcome, Shim, Superseded
from coalescer.worker.protocol import COMPLETED
from tests.worker.support import Superseder, Tasks, claim_work, make_shim


class Recorder:
    """An ``execute`` that records what it ran and what it was shown."""

    def __init__(self, outcome: Outcome = COMPLETED) -> None:
        self.outcome = outcome
        self.ran: list[tuple[str, int]] = []
        self.shown: list[list[str]] = []

    async def __call__(self, claim: Claim, supersedes: Sequence[Superseded]) -> Outcome:
        self.ran.append((claim.task_id, claim.run_id))
        self.shown.append([s.task_id for s in supersedes])
        assert all(s.task["routes"] == claim.task["routes"] for s in supersedes)
        return self.outcome


async def test_seed_example_runs_the_middle_task_when_the_last_claim_fails(
    shim: Shim, tasks: Tasks, superseder: Superseder, queue_emulator: QueueEmulator
) -> None:
    e, m, k = tasks.create(), tasks.create(), tasks.create()
    superseder.lists["k"] = [e, m, k]
    [work] = await claim_work(shim)
    assert work["status"]["taskId"] == e
    # Another worker holds the newest task, so our claim of it fails with a 409.
    queue_emulator.queue().claimTask(k, "0", {"workerGroup": "wg", "workerId": "other"})
    execute = Recorder()

    report = await shim.run(work, execute)

    assert superseder.asked == [("k", e)]
    assert execute.ran == [(m, 0)] and execute.shown == [[e]]
    assert report.primary == (m, 0) and report.superseded == [(e, 0)]
    assert tasks.last_run(e)["state"] == "exception"
    assert tasks.last_run(e)["reasonResolved"] == "superseded"
    assert tasks.artifact(e, 0, "public/superseded-by.json") == {"taskId": m, "runId": 0}
    assert tasks.last_run(m)["state"] == "completed"
    assert tasks.artifact(m, 0, "public/supersedes.json") == [{"taskId": e, "runId": 0}]
    assert tasks.last_run(k)["state"] == "running" and tasks.last_run(k)["workerId"] == "other"


async def test_every_claim_succeeding_runs_the_newest(
    shim: Shim, tasks: Tasks, superseder: Superseder
) -> None:
    ids = [tasks.create() for _ in range(4)]
    superseder.lists["k"] = ids
    [work] = await claim_work(shim)
    execute = Recorder()

    report = await shim.run(work, execute)

    assert execute.ran == [(ids[-1], 0)] and execute.shown == [ids[:-1]]
    assert report.superseded == [(t, 0) for t in ids[:-1]]
    assert tasks.artifact(ids[-1], 0, "public/supersedes.json") == [
        {"taskId": t, "runId": 0} for t in ids[:-1]
    ]
    for t in ids[:-1]:
        assert tasks.artifact(t, 0, "public/superseded-by.json") == {"taskId": ids[-1], "runId": 0}


async def test_superseded_by_follows_the_exception_and_supersedes_precedes_completion(
    queue_emulator: QueueEmulator,
    options: Options,
    tasks: Tasks,
    superseder: Superseder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    async def record(session: object, context: object, params: Any) -> None:
        calls.append(f"{params.method} {params.url.path}")

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(record)
    monkeypatch.setattr(
        aiohttp,
        "ClientSession",
        functools.partial(aiohttp.ClientSession, trace_configs=[trace]),
    )
    old, new = tasks.create(), tasks.create()
    superseder.lists["k"] = [old, new]
    async with make_shim(queue_emulator, options) as shim:
        [work] = await claim_work(shim)
        await shim.run(work, Recorder())

    def first(method: str, task_id: str, tail: str) -> int:
        path = f"/api/queue/v1/task/{task_id}/runs/0/{tail}"
        return calls.index(f"{method} {path}")

    # Only once the queue has taken reason 'superseded' does an artifact name the primary.
    assert first("POST", old, "exception") < first(
        "POST", old, "artifacts/public/superseded-by.json"
    )
    assert first("POST", old, "artifacts/public/superseded-by.json") < first(
        "POST", new, "artifacts/public/supersedes.json"
    )
    assert first("POST", new, "artifacts/public/supersedes.json") < first("POST", new, "completed")


async def test_newest_first_superseders_are_read_in_reverse(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    old, mid, new = tasks.create(), tasks.create(), tasks.create()
    superseder.lists["k"] = [new, mid, old]  # tc-coalesce's order
    legacy = dataclasses.replace(options, order=Order.NEWEST_FIRST)
    async with make_shim(queue_emulator, legacy) as shim:
        [work] = await claim_work(shim)
        report = await shim.run(work, Recorder())
    assert report.primary == (new, 0)
    assert tasks.artifact(new, 0, "public/supersedes.json") == [
        {"taskId": old, "runId": 0},
        {"taskId": mid, "runId": 0},
    ]


async def test_the_current_run_is_claimed_not_run_zero(
    shim: Shim, tasks: Tasks, superseder: Superseder, queue_emulator: QueueEmulator
) -> None:
    old, retried = tasks.create(), tasks.create()
    superseder.lists["k"] = [old, retried]
    # ``retried``'s run 0 ends intermittent-task: the queue adds a pending run 1.
    queue = queue_emulator.queue()
    claim = queue.claimTask(retried, "0", {"workerGroup": "wg", "workerId": "crashed"})
    queue_emulator.queue(claim["credentials"]).reportException(
        retried, "0", {"reason": "intermittent-task"}
    )
    [work] = await claim_work(shim)
    assert work["status"]["taskId"] == old

    report = await shim.run(work, Recorder())

    assert report.primary == (retried, 1)
    assert tasks.artifact(old, 0, "public/superseded-by.json") == {"taskId": retried, "runId": 1}
    assert tasks.last_run(retried)["state"] == "completed"


async def test_a_task_given_back_is_not_claimed_as_a_secondary(
    shim: Shim, tasks: Tasks, superseder: Superseder, queue_emulator: QueueEmulator
) -> None:
    """A run given back (``worker-shutdown``: a worker stopping, or releasing it after a failed
    primary) would cost the task another retry if released again: the task runs itself."""
    old, given, newer = tasks.create(), tasks.create(), tasks.create()
    superseder.lists["k"] = [old, given, newer]
    queue = queue_emulator.queue()
    claim = queue.claimTask(given, "0", {"workerGroup": "wg", "workerId": "stopping"})
    queue_emulator.queue(claim["credentials"]).reportException(
        given, "0", {"reason": "worker-shutdown"}
    )
    [work] = await claim_work(shim)
    report = await shim.run(work, Recorder())
    assert report.primary == (newer, 0)
    assert report.superseded == [(old, 0)]
    assert tasks.status(given)["runs"][-1]["state"] == "pending"

    # Claimed from the queue itself, it claims nothing newer: it runs.
    newest = tasks.create()
    superseder.lists["k"] = [given, newest]
    [work] = await claim_work(shim)
    assert work["status"]["taskId"] == given
    report = await shim.run(work, Recorder())
    assert report.primary == (given, 1) and report.superseded == []
    assert tasks.status(newest)["state"] == "pending"


async def test_a_task_alone_on_its_key_runs_without_artifacts(
    shim: Shim, tasks: Tasks, superseder: Superseder
) -> None:
    only = tasks.create()
    [work] = await claim_work(shim)
    report = await shim.run(work, Recorder())
    assert report.primary == (only, 0) and report.superseded == [] and report.alone is None
    assert tasks.last_run(only)["state"] == "completed"
    assert tasks.artifact(only, 0, "public/supersedes.json") is None


@pytest.mark.parametrize("legacy", [False])
async def test_current_queue_cancels_superseded_tasks_by_default(
    shim: Shim, tasks: Tasks, superseder: Superseder
) -> None:
    old, new = tasks.create(), tasks.create()
    superseder.lists["k"] = [old, new]
    [work] = await claim_work(shim)
    report = await shim.run(work, Recorder())
    assert report.superseded == [(old, 0)]
    run = tasks.last_run(old)
    assert (run["state"], run["reasonResolved"]) == ("exception", "canceled")
    assert tasks.artifact(old, 0, "public/superseded-by.json") == {"taskId": new, "runId": 0}


async def test_two_task_sets_of_one_worker_never_hold_the_same_run(
    shim: Shim, tasks: Tasks, superseder: Superseder
) -> None:
    ids = [tasks.create() for _ in range(6)]
    superseder.lists["k"] = ids
    # The queue answers a worker's claimTask of a run that worker already holds with success,
    # so only the shim itself can keep two concurrent task sets apart.
    first, second = await claim_work(shim, 2)
    execute = Recorder()

    reports = await asyncio.gather(shim.run(first, execute), shim.run(second, execute))

    assert execute.ran.count((ids[-1], 0)) == 1
    superseded = [t for r in reports for t in r.superseded]
    ran = [r.primary for r in reports if not r.aborted]
    assert sorted(superseded + ran) == sorted((t, 0) for t in ids)
    assert shim.held == set()
