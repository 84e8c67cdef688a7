"""While the primary runs: reclaims with fresh credentials, lost claims, cancellation, shutdown;
and what becomes of the secondaries when the primary fails."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest
from taskcluster.exceptions import TaskclusterAuthFailure

from coalescer.emulator.harness import QueueEmulator
from coalescer.model import parse_time_ms
from coalescer.worker import (
    Claim,
    OnPrimaryFailure,
    Options,
    Outcome,
    Report,
    Shim,
    SupersedeAs,
    Superseded,
)
from coalescer.worker.protocol import COMPLETED, FAILED
from tests.worker.support import NoCancelScope, Superseder, Tasks, claim_work, make_shim, poll

CLAIM_TIMEOUT = 1200  # the emulator's (and the real queue's) seconds per claim


class Held:
    """An ``execute`` that runs until released, and shows the primary's claim."""

    def __init__(self, outcome: Outcome = COMPLETED) -> None:
        self.outcome = outcome
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False
        self.claim: Claim | None = None

    async def __call__(self, claim: Claim, supersedes: Sequence[Superseded]) -> Outcome:
        self.claim = claim
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return self.outcome


async def start(
    shim: Shim, execute: Held, stop: asyncio.Event | None = None
) -> asyncio.Task[Report]:
    [work] = await claim_work(shim)
    running = asyncio.create_task(shim.run(work, execute, stop=stop))
    async with asyncio.timeout(10):
        await execute.started.wait()
    return running


def taken_until(tasks: Tasks, task_id: str) -> str:
    return str(tasks.last_run(task_id)["takenUntil"])


async def test_a_primary_outliving_its_first_claim_resolves_everything_with_fresh_credentials(
    shim: Shim, tasks: Tasks, superseder: Superseder, queue_emulator: QueueEmulator
) -> None:
    ids = [tasks.create() for _ in range(3)]
    superseder.lists["k"] = ids
    execute = Held()
    running = await start(shim, execute)
    assert execute.claim is not None
    first_credentials = execute.claim.credentials

    # Ten minutes at a time, well past takenUntil and the credentials' grace; after each step
    # wait until every claim has been renewed far enough to survive the next one.
    for _ in range(3):
        await renewed_after_advance(queue_emulator, tasks, ids)
    assert execute.claim.credentials != first_credentials
    # The queue no longer takes the credentials claimTask handed out.
    stale = queue_emulator.aio_queue(dict(first_credentials), session=shim.conn.session)
    with pytest.raises(TaskclusterAuthFailure, match="expired"):
        await stale.reclaimTask(ids[-1], "0")
    execute.release.set()
    report = await running

    assert report.primary == (ids[-1], 0) and report.aborted is None
    assert report.superseded == [(ids[0], 0), (ids[1], 0)]
    assert [tasks.last_run(t)["reasonResolved"] for t in ids] == [
        "superseded",
        "superseded",
        "completed",
    ]


async def renewed_after_advance(
    emulator: QueueEmulator, tasks: Tasks, ids: Sequence[str], seconds: float = CLAIM_TIMEOUT / 2
) -> None:
    """Advance the queue's clock, then wait until each task's claim was renewed far enough to
    survive the next such step."""
    now = await asyncio.to_thread(emulator.clock.advance, seconds)
    horizon = (now.timestamp() + CLAIM_TIMEOUT * 0.6) * 1000
    await poll(
        lambda: all(parse_time_ms(taken_until(tasks, t)) > horizon for t in ids),
        what="reclaims",
    )


async def test_a_canceled_primary_is_stopped_and_its_secondaries_released(
    shim: Shim, tasks: Tasks, superseder: Superseder, queue_emulator: QueueEmulator
) -> None:
    old, new = tasks.create(), tasks.create()
    superseder.lists["k"] = [old, new]
    execute = Held()
    running = await start(shim, execute)
    await asyncio.to_thread(queue_emulator.queue().cancelTask, new)
    # Time to reclaim, which answers 409.
    await asyncio.to_thread(queue_emulator.clock.advance, CLAIM_TIMEOUT / 2)

    report = await asyncio.wait_for(running, 10)

    assert execute.cancelled and report.aborted == "canceled"
    assert report.released == [(old, 0)]
    assert tasks.last_run(new)["reasonResolved"] == "canceled"
    assert tasks.status(old)["runs"][0]["reasonResolved"] == "worker-shutdown"
    assert tasks.last_run(old)["state"] == "pending"  # retried


async def test_a_secondary_lost_on_reclaim_is_forgotten(
    shim: Shim, tasks: Tasks, superseder: Superseder, queue_emulator: QueueEmulator
) -> None:
    old, mid, new = tasks.create(), tasks.create(), tasks.create()
    superseder.lists["k"] = [old, mid, new]
    execute = Held()
    running = await start(shim, execute)
    await asyncio.to_thread(queue_emulator.queue().cancelTask, mid)
    await renewed_after_advance(queue_emulator, tasks, (old, new))
    execute.release.set()

    report = await running

    assert report.superseded == [(old, 0)] and report.dropped == [(mid, 0)]
    assert tasks.last_run(mid)["reasonResolved"] == "canceled"
    assert tasks.artifact(mid, 0, "public/superseded-by.json") is None
    assert tasks.artifact(new, 0, "public/supersedes.json") == [{"taskId": old, "runId": 0}]


async def test_shutdown_releases_the_primary_and_the_secondaries(
    shim: Shim, tasks: Tasks, superseder: Superseder
) -> None:
    old, new = tasks.create(), tasks.create()
    superseder.lists["k"] = [old, new]
    execute = Held()
    stop = asyncio.Event()
    running = await start(shim, execute, stop)
    stop.set()

    report = await asyncio.wait_for(running, 10)

    assert execute.cancelled and report.aborted == "shutdown"
    assert sorted(report.released) == sorted([(old, 0), (new, 0)])
    for task_id in (old, new):
        assert tasks.status(task_id)["runs"][0]["reasonResolved"] == "worker-shutdown"
        assert tasks.last_run(task_id)["state"] == "pending"


async def test_cancelling_the_shim_releases_what_it_holds(
    shim: Shim, tasks: Tasks, superseder: Superseder
) -> None:
    old, new = tasks.create(), tasks.create()
    superseder.lists["k"] = [old, new]
    running = await start(shim, Held())
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    for task_id in (old, new):
        assert tasks.status(task_id)["runs"][0]["reasonResolved"] == "worker-shutdown"


@pytest.mark.parametrize(
    ("on_failure", "outcome", "fate"),
    [
        (OnPrimaryFailure.SUPERSEDE, FAILED, "superseded"),
        (OnPrimaryFailure.RELEASE, FAILED, "worker-shutdown"),
        (OnPrimaryFailure.SUPERSEDE, Outcome("exception", "malformed-payload"), "worker-shutdown"),
    ],
)
async def test_a_primary_that_fails_supersedes_or_releases_as_configured(
    on_failure: OnPrimaryFailure,
    outcome: Outcome,
    fate: str,
    queue_emulator: QueueEmulator,
    options: Options,
    tasks: Tasks,
    superseder: Superseder,
) -> None:
    old, new = tasks.create(), tasks.create()
    superseder.lists["k"] = [old, new]
    configured = dataclasses.replace(options, on_primary_failure=on_failure)
    async with make_shim(queue_emulator, configured) as shim:
        execute = Held(outcome)
        execute.release.set()
        report = await (await start(shim, execute))

    assert report.outcome == outcome
    assert tasks.status(old)["runs"][0]["reasonResolved"] == fate
    assert tasks.last_run(new)["reasonResolved"] == (outcome.reason or outcome.state)
    superseded = fate == "superseded"
    assert (tasks.artifact(new, 0, "public/supersedes.json") is not None) == superseded


async def test_an_execute_that_crashes_is_an_internal_error(
    shim: Shim, tasks: Tasks, superseder: Superseder
) -> None:
    old, new = tasks.create(), tasks.create()
    superseder.lists["k"] = [old, new]

    async def crash(claim: Claim, supersedes: Sequence[Superseded]) -> Outcome:
        raise RuntimeError("boom")

    report = await shim.run((await claim_work(shim))[0], crash)
    assert report.outcome == Outcome("exception", "internal-error")
    assert tasks.last_run(new)["reasonResolved"] == "internal-error"
    assert tasks.status(old)["runs"][0]["reasonResolved"] == "worker-shutdown"


@pytest.mark.parametrize("legacy", [False])
@pytest.mark.parametrize(
    ("mode", "state", "reason", "how"),
    [
        # A current queue rejects 'superseded': canceled, never passed.
        (SupersedeAs.AUTO, "exception", "canceled", "canceled"),
        (SupersedeAs.CANCELED, "exception", "canceled", "canceled"),
        # Asked for by name: reads as passed.
        (SupersedeAs.COMPLETED, "completed", "completed", "completed"),
        # The task is given back rather than lost, and no artifact names a primary that did
        # not supersede it.
        (SupersedeAs.EXCEPTION_SUPERSEDED, "exception", "worker-shutdown", "released"),
    ],
)
async def test_current_queue_modes(
    mode: SupersedeAs,
    state: str,
    reason: str,
    how: str,
    queue_emulator: QueueEmulator,
    options: Options,
    tasks: Tasks,
    superseder: Superseder,
) -> None:
    old, new = tasks.create(), tasks.create()
    superseder.lists["k"] = [old, new]
    async with make_shim(queue_emulator, dataclasses.replace(options, supersede_as=mode)) as shim:
        execute = Held()
        execute.release.set()
        report = await (await start(shim, execute))

    superseded = how != "released"
    assert report.superseded == ([(old, 0)] if superseded else [])
    assert report.released == ([] if superseded else [(old, 0)])
    assert report.dropped == []
    assert report.resolutions[(old, 0)].how == how
    run = tasks.status(old)["runs"][0]
    assert (run["state"], run["reasonResolved"]) == (state, reason)
    link = tasks.artifact(old, 0, "public/superseded-by.json")
    assert link == ({"taskId": new, "runId": 0} if superseded else None)
    # Whatever became of it, the run's log says so, and names the task that ran instead.
    text = tasks.artifact(old, 0, "public/logs/live_backing.log")
    assert f"task {new} run 0" in text
    assert ("will run again" in text) == (not superseded)
    assert f"{queue_emulator.root_url}/tasks/{new}" in text
    assert f"1st of 2 tasks listed oldest first; {new} is 2nd" in text
    assert tasks.last_run(new)["state"] == "completed"
    # Stored as text, whatever the mode, and saying truly whether the run reads as a success.
    listed = queue_emulator.queue().listArtifacts(old, "0")["artifacts"]
    types = {a["name"]: a["contentType"] for a in listed}
    assert types["public/logs/live_backing.log"] == "text/plain; charset=utf-8"
    assert ("never reads as a success" in text) == (superseded and state != "completed")
    assert ("reads as a success wherever only its state is looked at" in text) == (
        state == "completed"
    )


@pytest.mark.parametrize("legacy", [False])
async def test_auto_cancels_superseded_tasks_whatever_depends_on_them(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    """Canceling resolves the task: an ``all-completed`` dependent is never scheduled, an
    ``all-resolved`` one is (as after ``exception/superseded``)."""
    old, leaf, new = tasks.create(), tasks.create(), tasks.create()
    waits = tasks.create(url="", dependencies=[old], routes=[])
    resolved = tasks.create(url="", dependencies=[old], requires="all-resolved", routes=[])
    superseder.lists["k"] = [old, leaf, new]
    async with make_shim(queue_emulator, options) as shim:
        execute = Held()
        execute.release.set()
        report = await (await start(shim, execute))

    assert report.superseded == [(old, 0), (leaf, 0)]
    for task_id in (old, leaf):
        assert report.resolutions[(task_id, 0)].how == "canceled"
        run = tasks.last_run(task_id)
        assert (run["state"], run["reasonResolved"]) == ("exception", "canceled")
        assert tasks.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": new,
            "runId": 0,
        }
        assert "Resolved exception/canceled" in tasks.artifact(
            task_id, 0, "public/logs/live_backing.log"
        )
    assert tasks.status(waits)["state"] == "unscheduled"
    assert tasks.status(resolved)["state"] == "pending"


async def test_legacy_queue_accepts_superseded_in_auto_mode(
    shim: Shim, tasks: Tasks, superseder: Superseder
) -> None:
    old, new = tasks.create(), tasks.create()
    superseder.lists["k"] = [old, new]
    execute = Held()
    execute.release.set()
    await (await start(shim, execute))
    assert shim.resolver.mode is SupersedeAs.AUTO
    assert tasks.last_run(old)["reasonResolved"] == "superseded"


@pytest.mark.parametrize("legacy", [False])
async def test_auto_releases_superseded_tasks_it_may_not_cancel(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    old, older, new = tasks.create(), tasks.create(), tasks.create()
    superseder.lists["k"] = [older, old, new]
    async with make_shim(queue_emulator, options) as shim:
        worker_queue = NoCancelScope(shim.queue)
        shim.resolver.superseding._worker_queue = worker_queue
        execute = Held()
        execute.release.set()
        report = await (await start(shim, execute))

        assert sorted(report.released) == sorted([(old, 0), (older, 0)])
        assert report.superseded == report.dropped == []
        assert worker_queue.refused  # asked once at least, then remembered
        for task_id in (old, older):
            assert "may not cancel" in report.resolutions[(task_id, 0)].why
            assert tasks.status(task_id)["runs"][0]["reasonResolved"] == "worker-shutdown"
            assert tasks.status(task_id)["runs"][1]["state"] == "pending"  # it runs itself
            assert tasks.artifact(task_id, 0, "public/superseded-by.json") is None
            text = tasks.artifact(task_id, 0, "public/logs/live_backing.log")
            assert "will run again" in text and "may not cancel" in text

        # Known now: such tasks could only be released again, each time costing a retry. The
        # next worker runs its task itself and claims neither the other nor anything newer.
        newest = tasks.create()
        superseder.lists["k"] = [older, old, newest]
        again = Held()
        again.release.set()
        report = await (await start(shim, again))
    initial, _ = report.primary
    other = old if initial == older else older
    assert report.primary == (initial, 1) and report.outcome == COMPLETED
    assert report.superseded == report.released == []
    assert [r["state"] for r in tasks.status(other)["runs"]] == ["exception", "pending"]
    assert [r["state"] for r in tasks.status(newest)["runs"]] == ["pending"]
