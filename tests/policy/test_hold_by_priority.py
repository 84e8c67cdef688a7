"""``hold-by: priority``: victims a primary holds wait pending at the lowest priority, unclaimed,
instead of being claimed by the enforcer; they get their own priority back when they must run
(a released victim), or jump the queue (a bisection's probe), and no run of theirs is spent on
giving a claim back."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from taskcluster.exceptions import TaskclusterAuthFailure

from coalescer.emulator.harness import QueueEmulator
from coalescer.store import Store, bisections
from coalescer.store import lineage as records
from coalescer.store import policy as outbox
from tests.policy.support import Loop, rule

pytestmark = pytest.mark.integration

#: The victims' own priority: above the lowest, where they wait.
OWN = "low"


def holding(queue_emulator: QueueEmulator, store: Store, **fields: Any) -> Loop:
    fields = {"on_primary_failure": "release"} | fields
    return Loop(
        queue_emulator, store, rule("k", strategy="latest-wins", hold_by="priority", **fields)
    )


async def state(loop: Loop, task_id: str) -> str | None:
    decision = await records.decision(loop.store, "k", task_id)
    return None if decision is None else decision.state


def priority(loop: Loop, task_id: str) -> str:
    return str(loop.em.queue().task(task_id)["priority"])


async def held_for_a_newer(loop: Loop) -> tuple[str, str]:
    """Two pushes at their own priority, the older held for the newer: ``(old, new)``."""
    old = loop.create(priority=OWN)
    new = loop.create(priority=OWN)
    await loop.feed()
    await loop.enforce()
    return old, new


def runs(loop: Loop, task_id: str) -> list[tuple[str, str | None]]:
    return [(r["state"], r.get("reasonResolved")) for r in loop.status(task_id)["runs"]]


async def test_victims_wait_unclaimed_at_the_lowest_priority_then_are_superseded(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    loop = holding(queue_emulator, store)
    old, new = await held_for_a_newer(loop)
    assert await state(loop, old) == "held"
    assert (runs(loop, old), priority(loop, old)) == ([("pending", None)], "lowest")
    assert priority(loop, new) == OWN
    # Far past a claim's 20 minutes: nothing to renew, and it still waits.
    for _ in range(4):
        loop.em.clock.advance(500)
        await loop.enforce()
    assert (runs(loop, old), await state(loop, old)) == ([("pending", None)], "held")
    loop.resolve(loop.claim(new), "completed")
    await loop.enforce()
    assert runs(loop, old) == [("exception", "superseded")]
    assert loop.artifact(old, 0, "public/superseded-by.json") == {"taskId": new, "runId": 0}
    assert await state(loop, old) == "superseded"


async def test_a_released_victim_gets_its_priority_back_and_spends_no_retry(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    loop = holding(queue_emulator, store)
    old, new = await held_for_a_newer(loop)
    loop.resolve(loop.claim(new), "failed")
    await loop.enforce()
    assert (runs(loop, old), priority(loop, old)) == ([("pending", None)], OWN)
    assert await state(loop, old) == "released"
    # Back in the index, offered to workers again: it runs itself.
    assert [t.task_id for t in await loop.store.pending("k", now_ms=loop.now_ms())] == [old]


async def test_a_victim_an_idle_worker_took_runs_and_is_left_its_own_result(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    loop = holding(queue_emulator, store)
    old, new = await held_for_a_newer(loop)
    loop.resolve(loop.claim(old), "completed")  # nothing else was pending
    loop.em.clock.advance(700)  # past the next look at it
    await loop.enforce()
    assert await state(loop, old) == "held"
    loop.resolve(loop.claim(new), "completed")
    await loop.enforce()
    assert runs(loop, old) == [("completed", "completed")]
    assert await state(loop, old) == "gone"


async def test_a_victim_at_the_lowest_priority_already_is_claimed(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    loop = holding(queue_emulator, store)
    old = loop.create()  # the lowest: waiting there would not keep it behind the backlog
    loop.create()
    await loop.feed()
    await loop.enforce()
    run = loop.last_run(old)
    assert (run["state"], run["workerId"]) == ("running", "enforcer")
    assert await state(loop, old) == "held"


async def test_without_change_task_priority_victims_are_claimed_and_it_is_said_once(
    queue_emulator: QueueEmulator, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    loop = holding(queue_emulator, store)
    victims = [loop.create(priority=OWN) for _ in range(3)]
    loop.create(priority=OWN)
    await loop.feed()
    caplog.set_level(logging.WARNING, "coalescer.policy")
    async with loop.enforcer("e1") as enforcer:

        async def forbidden(task_id: str, payload: Any) -> Any:
            raise TaskclusterAuthFailure("insufficient scopes", superExc=None, status_code=403)

        enforcer.actions.queue.changeTaskPriority = forbidden  # type: ignore[attr-defined]
        await loop.feed()
        while await enforcer.round():
            await loop.feed()
    for task_id in victims:
        assert (loop.last_run(task_id)["workerId"], priority(loop, task_id)) == ("enforcer", OWN)
        assert await state(loop, task_id) == "held"
    said = [r for r in caplog.records if "did not lower the priority" in r.getMessage()]
    assert len(said) == 1


async def test_a_bisection_runs_its_probes_where_they_waited(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    # Culprit the sixth of 8 victims; an idle worker ran the second meanwhile (it passed): the
    # search takes its result as it would a probe's.
    loop = holding(
        queue_emulator, store, on_primary_failure="bisect", bisect_confirm=0, bisect_parallel=1
    )
    victims = [loop.create(priority=OWN) for _ in range(8)]
    primary = loop.create(priority=OWN)
    await loop.feed()
    await loop.enforce()
    assert {priority(loop, t) for t in victims} == {"lowest"}
    loop.resolve(loop.claim(primary), "failed")
    loop.resolve(loop.claim(victims[1]), "completed")
    culprit = 5
    probed = []
    for _ in range(20):
        await loop.enforce()
        raised = [t for t in victims if loop.last_run(t)["state"] == "pending"]
        raised = [t for t in raised if priority(loop, t) == "highest"]
        if not raised:
            break
        for task_id in raised:
            probed.append(task_id)
            how = "failed" if victims.index(task_id) >= culprit else "completed"
            loop.resolve(loop.claim(task_id), how)
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    assert finding["verdict"] == "culprit"
    assert finding["culprit"] == {"taskId": victims[culprit], "runId": 0}
    assert finding["lastGood"] == {"taskId": victims[culprit - 1], "runId": 0}
    assert probed and victims[1] not in probed
    for i, task_id in enumerate(victims):
        if task_id in probed or i == 1:
            # Each ran once, in the run it waited in: no claim given back, no retry spent.
            [(ended, _)] = runs(loop, task_id)
            assert ended in ("completed", "failed")
            continue
        assert (i, runs(loop, task_id)) == (i, [("exception", "superseded")])
    assert (await outbox.outstanding(loop.store, ["k"]))["k"] == (0, 0)
