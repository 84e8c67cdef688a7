"""``on-primary-failure: bisect`` through ``coalescer enforce``: when the primary fails, the
held victims are searched for the first failing push, a few of them released to run, and the
rest superseded by the run whose result stands for them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from coalescer.emulator.clock import format_time
from coalescer.policy.actions import Result
from coalescer.policy.rules import Policy
from coalescer.store import bisections
from coalescer.store import lineage as records
from coalescer.store import policy as outbox
from coalescer.store.policy import Entry
from tests.policy.support import Loop, rule

pytestmark = pytest.mark.integration


@pytest.fixture
def policy() -> Policy:
    return rule("k", strategy="latest-wins", on_primary_failure="bisect", bisect_confirm=0)


async def state(loop: Loop, task_id: str) -> str | None:
    decision = await records.decision(loop.store, "k", task_id)
    return None if decision is None else decision.state


async def held_then_failed(loop: Loop, n: int = 8, **first: Any) -> tuple[list[str], str]:
    """``n`` victims held for a primary, which then fails; ``first`` overrides the oldest
    victim's definition."""
    victims = [loop.create(**(first if i == 0 else {})) for i in range(n)]
    primary = loop.create()
    await loop.feed()
    await loop.enforce()
    assert [await state(loop, t) for t in victims] == ["held"] * n
    claim = loop.claim(primary)
    loop.em.clock.advance(600)  # the primary runs 10 minutes
    loop.resolve(claim, "failed")
    return victims, primary


async def work(loop: Loop, victims: list[str], culprit: int, consumer: str = "e1") -> list[str]:
    """Enforce, and run every released victim as a worker would: its command fails from push
    ``culprit`` on. Returns the victims that ran, in order."""
    ran = []
    for _ in range(20):
        await enforce(loop, consumer)
        pending = [t for t in victims if loop.last_run(t)["state"] == "pending"]
        if not pending:
            return ran
        for task_id in pending:
            ran.append(task_id)
            how = "failed" if victims.index(task_id) >= culprit else "completed"
            loop.resolve(loop.claim(task_id), how)
    raise AssertionError("the search did not end")


async def enforce(loop: Loop, consumer: str) -> None:
    async with loop.enforcer(consumer) as enforcer:
        for _ in range(200):
            await loop.feed()
            if not await enforcer.round():
                await loop.feed()
                return
    raise AssertionError("the outbox did not drain")


async def check_outcome(
    loop: Loop, victims: list[str], primary: str, culprit: int, ran: list[str]
) -> None:
    n = len(victims)
    assert len(ran) == len(set(ran)) <= 4  # ceil(log2(8 + 1)) runs beyond the primary's
    good = culprit - 1
    stand_in = {i: victims[good] for i in range(good)}
    stand_in |= {i: victims[culprit] if culprit < n else primary for i in range(culprit + 1, n)}
    if culprit < n:
        assert victims[culprit] in ran
        assert loop.last_run(victims[culprit])["state"] == "failed"
    if good >= 0:
        assert victims[good] in ran
        assert loop.last_run(victims[good])["state"] == "completed"
    for i, task_id in enumerate(victims):
        if task_id in ran:
            assert (i, await state(loop, task_id)) == (i, "ran")
            continue
        run = loop.last_run(task_id)
        assert (i, run["runId"], run["reasonResolved"]) == (i, 0, "superseded")
        by = stand_in[i]
        by_run = 0 if by == primary else 1
        assert loop.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": by,
            "runId": by_run,
        }
        assert await state(loop, task_id) == "superseded"
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    assert finding["primary"] == {"taskId": primary, "runId": 0}
    expected = {"taskId": victims[culprit], "runId": 1} if culprit < n else None
    assert finding["culprit"] == (expected or {"taskId": primary, "runId": 0})
    assert finding["lastGood"] == ({"taskId": victims[good], "runId": 1} if good >= 0 else None)
    assert finding["extraRuns"] == len(ran) and finding["held"] == n
    # Nothing is left held, searched or to do.
    assert (await outbox.outstanding(loop.store, ["k"]))["k"] == (0, 0)


@pytest.mark.parametrize("culprit", [0, 3, 5, 7, 8])
async def test_a_failed_primary_locates_the_first_failing_push(loop: Loop, culprit: int) -> None:
    victims, primary = await held_then_failed(loop)
    ran = await work(loop, victims, culprit)
    await check_outcome(loop, victims, primary, culprit, ran)


async def test_a_released_victim_is_not_superseded_again_while_it_runs(loop: Loop) -> None:
    victims, _ = await held_then_failed(loop)
    await enforce(loop, "e1")
    [probe] = [t for t in victims if loop.last_run(t)["state"] == "pending"]
    assert await state(loop, probe) == "probing"
    # A newer push arrives while the probe waits for a worker: it does not supersede it.
    newer = loop.create()
    await enforce(loop, "e1")
    assert loop.last_run(probe)["state"] == "pending"
    assert await state(loop, probe) == "probing"
    assert loop.last_run(newer)["state"] == "pending"


async def test_an_enforcer_restarted_mid_search_resumes_it(loop: Loop) -> None:
    victims, primary = await held_then_failed(loop)
    # The first enforcer records its first probe, then dies before releasing it.
    async with loop.enforcer("e1") as enforcer:
        died: list[str] = []

        async def crash(entry: Entry) -> Result:
            died.append(entry.victim)
            raise RuntimeError("killed")

        enforcer.actions.release = crash  # type: ignore[method-assign]
        await loop.feed()
        await enforcer.round()
    [probe] = died
    assert await state(loop, probe) == "probing"
    assert loop.last_run(probe)["state"] == "running"  # still held: never released
    # Another enforcer takes over after the first probe's result, from the store alone.
    await enforce(loop, "e2")
    loop.resolve(loop.claim(probe), "completed" if victims.index(probe) < 5 else "failed")
    ran = [probe] + await work(loop, victims, 5, consumer="e2")
    await check_outcome(loop, victims, primary, 5, ran)


async def test_a_victim_whose_deadline_comes_first_is_released_to_run_itself(loop: Loop) -> None:
    # The primary ran 10 minutes: a victim whose deadline is within 20 minutes is not held.
    soon = format_time(loop.em.clock.now() + timedelta(minutes=25))
    victims, primary = await held_then_failed(loop, deadline=soon)
    ran = await work(loop, victims, 5)
    assert victims[0] in ran
    runs = loop.status(victims[0])["runs"]
    assert [(r["state"], r["reasonResolved"]) for r in runs] == [
        ("exception", "worker-shutdown"),
        ("completed", "completed"),  # it ran itself
    ]
    assert await state(loop, victims[0]) == "released"
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    assert finding["culprit"] == {"taskId": victims[5], "runId": 1}
    assert victims[0] not in {s["taskId"] for s in finding["standsFor"]}
    assert (await outbox.outstanding(loop.store, ["k"]))["k"] == (0, 0)
