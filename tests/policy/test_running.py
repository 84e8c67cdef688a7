"""Running victims: canceled (their worker learns at its next reclaim), unless protected."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from coalescer.emulator.harness import QueueEmulator
from coalescer.policy.rules import Policy
from coalescer.store import Store
from coalescer.worker import Claim, Options, Outcome, Superseded
from tests.policy.support import Loop, rule
from tests.worker.support import claim_work, make_shim

pytestmark = pytest.mark.integration


@pytest.fixture
def policy() -> Policy:
    return rule("k", strategy="latest-wins", supersede_running=True, protect_running_after="60s")


async def test_a_running_victim_is_canceled_and_its_worker_stops_at_its_next_reclaim(
    loop: Loop,
) -> None:
    old = loop.create()
    started, stopped = asyncio.Event(), asyncio.Event()

    async def execute(claim: Claim, supersedes: Sequence[Superseded]) -> Outcome:
        started.set()
        try:
            await asyncio.Event().wait()  # a long build
        finally:
            stopped.set()  # the worker's cancel hook: the command is stopped
        raise AssertionError("unreachable")

    async with make_shim(loop.em, Options(tick=0.02)) as shim:
        [work] = await claim_work(shim)
        job = asyncio.create_task(shim.run(work, execute))
        await asyncio.wait_for(started.wait(), 10)
        await loop.feed()
        new = loop.create()
        await loop.feed()
        assert await loop.enforce() == 1
        run = loop.last_run(old)
        assert (run["state"], run["reasonResolved"]) == ("exception", "canceled")
        assert loop.artifact(old, 0, "public/superseded-by.json") == {"taskId": new, "runId": 0}
        # The queue cannot tell the worker: the old command runs on until the worker reclaims
        # (a third of the claim's 20 minutes), gets 409 and stops it.
        assert not stopped.is_set()
        loop.em.clock.advance(401)
        report = await asyncio.wait_for(job, 10)
    assert report.aborted == "canceled" and stopped.is_set()
    async with loop.service() as http:
        stats = (await http.get("/v1/policy")).json()
    assert stats["keys"][0]["canceled"] == 1


async def test_a_task_that_has_run_longer_than_protected_is_never_canceled(loop: Loop) -> None:
    old = loop.create()
    loop.claim(old)
    await loop.feed()
    loop.em.clock.advance(30)
    middle = loop.create()  # decided while the old one had run 31 s: cancel it...
    await loop.feed()
    loop.em.clock.advance(60)  # ...but by the time the enforcer acts, it has run 91 s
    await loop.enforce()
    assert loop.last_run(old)["state"] == "running"
    async with loop.service() as http:
        lineage = (await http.get(f"/v1/tasks/{old}")).json()
    assert lineage["supersededBy"]["state"] == "protected"
    late = loop.create()  # decided now, after 92 s: protected from the start
    await loop.feed()
    assert await loop.enforce() == 1  # the middle one, pending
    assert loop.last_run(middle)["reasonResolved"] == "superseded"
    assert loop.last_run(old)["state"] == "running"
    assert loop.last_run(late)["state"] == "pending"


@pytest.fixture
def cascading() -> Policy:
    return rule("k", strategy="latest-wins", supersede_running=True, cascade="cancel")


async def test_a_victim_its_worker_completes_before_the_cancel_keeps_its_result(
    queue_emulator: QueueEmulator, store: Store, cascading: Policy
) -> None:
    loop = Loop(queue_emulator, store, cascading)
    old = loop.create()
    claim = loop.claim(old)
    dependent = loop.create("other", dependencies=[old])
    await loop.feed()
    new = loop.create()
    await loop.feed()
    async with loop.enforcer() as enforcer:
        real = enforcer.actions.queue.cancelTask  # type: ignore[attr-defined]

        async def worker_first(task_id: str) -> Any:
            if task_id == old:
                loop.resolve(claim, "completed")  # the worker reports just before the cancel
            return await real(task_id)

        enforcer.actions.queue.cancelTask = worker_first  # type: ignore[attr-defined]
        for _ in range(50):
            await loop.feed()
            if not await enforcer.round():
                break
    # The passing run keeps its result, with no link to a task that did not replace it...
    assert [r["state"] for r in loop.status(old)["runs"]] == ["completed"]
    assert loop.artifact(old, 0, "public/superseded-by.json") is None
    # ...and the dependent canceled with it runs after all.
    assert [r["state"] for r in loop.status(dependent)["runs"]][-1] == "pending"
    async with loop.service() as http:
        lineage = (await http.get(f"/v1/tasks/{old}")).json()
    assert lineage["supersededBy"]["state"] == "gone"
    assert loop.last_run(new)["state"] == "pending"
