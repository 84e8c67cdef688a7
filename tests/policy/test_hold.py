"""``on-primary-failure: release``: victims are claimed at once and held until their primary
ends; superseded when it completes, released (they run themselves) when it does not."""

from __future__ import annotations

import pytest

from coalescer.policy.actions import Result
from coalescer.policy.rules import Policy
from coalescer.store import lineage as records
from coalescer.store.policy import Entry
from tests.policy.support import Loop, rule

pytestmark = pytest.mark.integration


@pytest.fixture
def policy() -> Policy:
    return rule("k", strategy="latest-wins", on_primary_failure="release")


async def state(loop: Loop, task_id: str) -> str | None:
    decision = await records.decision(loop.store, "k", task_id)
    return None if decision is None else decision.state


async def test_held_victims_are_superseded_when_the_primary_completes(loop: Loop) -> None:
    old = loop.create()
    new = loop.create()
    await loop.feed()
    await loop.enforce()
    run = loop.last_run(old)
    assert (run["state"], run["workerId"]) == ("running", "enforcer")  # out of the workers' way
    assert await state(loop, old) == "held"
    loop.resolve(loop.claim(new), "completed")
    await loop.enforce()
    assert loop.last_run(old)["reasonResolved"] == "superseded"
    assert loop.artifact(old, 0, "public/superseded-by.json") == {"taskId": new, "runId": 0}
    assert await state(loop, old) == "superseded"


@pytest.mark.parametrize("how", ["failed", "malformed-payload"])
async def test_held_victims_are_released_when_the_primary_does_not_complete(
    loop: Loop, how: str
) -> None:
    old = loop.create()
    new = loop.create()
    await loop.feed()
    await loop.enforce()
    loop.resolve(loop.claim(new), how)
    await loop.enforce()
    runs = loop.status(old)["runs"]
    assert [(r["state"], r.get("reasonResolved")) for r in runs] == [
        ("exception", "worker-shutdown"),
        ("pending", None),
    ]
    assert await state(loop, old) == "released"
    # Back in the index, offered to workers again: it runs itself.
    assert [t.task_id for t in await loop.store.pending("k", now_ms=loop.now_ms())] == [old]


async def test_held_claims_are_renewed_until_the_primary_ends(loop: Loop) -> None:
    old = loop.create()
    loop.create()
    await loop.feed()
    await loop.enforce()
    taken = loop.last_run(old)["takenUntil"]
    for _ in range(4):  # 4 times 500 s: far past the first 20-minute claim
        loop.em.clock.advance(500)
        assert await loop.enforce() >= 1
    run = loop.last_run(old)
    assert run["state"] == "running" and run["takenUntil"] > taken
    assert await state(loop, old) == "held"


async def test_a_chain_of_held_victims_follows_the_final_primary(loop: Loop) -> None:
    a = loop.create()
    await loop.feed()
    b = loop.create()
    await loop.feed()
    c = loop.create()
    await loop.feed()
    await loop.enforce()
    assert [await state(loop, t) for t in (a, b)] == ["held", "held"]
    loop.resolve(loop.claim(c), "completed")
    await loop.enforce()
    for task_id in (a, b):
        assert loop.last_run(task_id)["reasonResolved"] == "superseded"
        assert loop.artifact(task_id, 0, "public/superseded-by.json") == {"taskId": c, "runId": 0}


async def test_a_chain_of_held_victims_is_released_down_the_chain_when_the_primary_fails(
    loop: Loop,
) -> None:
    # a is held for b, and b for c; c fails. b is released, and the queue's message announces
    # its retry (run 1 pending), not the end of run 0: a follows all the same, released, then
    # held anew for b's new run, and superseded by it when it completes.
    a = loop.create()
    b = loop.create()
    c = loop.create()
    await loop.feed()
    await loop.enforce()
    loop.resolve(loop.claim(c), "failed")
    await loop.enforce()
    for task_id in (a, b):
        assert [r.get("reasonResolved") for r in loop.status(task_id)["runs"]] == [
            "worker-shutdown",
            None,
        ]
    again = await records.decision(loop.store, "k", a)
    assert again is not None
    assert (again.run, again.by, again.by_run, again.state) == (1, b, 1, "held")
    loop.resolve(loop.claim(b), "completed")
    await loop.enforce()
    assert loop.last_run(a)["reasonResolved"] == "superseded"
    assert loop.artifact(a, 1, "public/superseded-by.json") == {"taskId": b, "runId": 1}


async def test_victims_held_for_a_canceled_primary_are_released_when_its_replacement_fails(
    loop: Loop,
) -> None:
    # a is held for b; b runs and is canceled by c (supersede-running); c fails: a follows the
    # chain's final primary, and is released, rather than held until its deadline.
    loop.policy = rule(
        "k", strategy="latest-wins", on_primary_failure="release", supersede_running=True
    )
    a = loop.create()
    b = loop.create()
    await loop.feed()
    await loop.enforce()
    assert await state(loop, a) == "held"
    loop.claim(b)
    await loop.feed()
    c = loop.create()
    await loop.enforce()
    assert loop.last_run(b)["reasonResolved"] == "canceled"
    assert await state(loop, a) == "held"
    loop.resolve(loop.claim(c), "failed")
    await loop.enforce()
    assert await state(loop, a) == "released"
    assert [r.get("reasonResolved") for r in loop.status(a)["runs"]] == ["worker-shutdown", None]


async def test_victims_held_for_a_held_victim_canceled_meanwhile_follow_the_final_primary(
    loop: Loop,
) -> None:
    # a is held for b, and b for c. Someone cancels b while the enforcer holds it: its end is
    # hidden (a victim is neither offered nor a primary), so a's fate follows c. c fails: a is
    # released and runs itself, rather than being held until its deadline.
    a = loop.create()
    b = loop.create()
    c = loop.create()
    await loop.feed()
    await loop.enforce()
    assert [await state(loop, t) for t in (a, b)] == ["held", "held"]
    loop.em.queue().cancelTask(b)
    await loop.enforce()
    assert await state(loop, a) == "held"
    loop.resolve(loop.claim(c), "failed")
    await loop.enforce()
    assert await state(loop, a) == "released"
    assert [r.get("reasonResolved") for r in loop.status(a)["runs"]] == ["worker-shutdown", None]
    assert [t.task_id for t in await loop.store.pending("k", now_ms=loop.now_ms())] == [a]


async def test_a_released_victims_held_ones_follow_even_when_its_end_arrives_first(
    loop: Loop,
) -> None:
    # a is held for b, and b for c; c fails and the enforcer releases b. The event of b's
    # run ending reaches the index before the enforcer records the release (the consumer was
    # faster): a follows all the same, released rather than held until its deadline.
    a = loop.create()
    b = loop.create()
    c = loop.create()
    await loop.feed()
    await loop.enforce()
    assert [await state(loop, t) for t in (a, b)] == ["held", "held"]
    loop.resolve(loop.claim(c), "failed")
    await loop.feed()
    async with loop.enforcer() as enforcer:
        give_back = enforcer.actions.release

        async def release_then_feed(entry: Entry) -> Result:
            result = await give_back(entry)
            await loop.feed()  # before the enforcer settles the entry
            return result

        enforcer.actions.release = release_then_feed  # type: ignore[method-assign]
        while await enforcer.round():
            await loop.feed()
    await loop.feed()
    assert [await state(loop, t) for t in (a, b)] == ["released", "released"]
    for task_id in (a, b):
        assert [r.get("reasonResolved") for r in loop.status(task_id)["runs"]] == [
            "worker-shutdown",
            None,
        ]
