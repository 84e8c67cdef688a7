"""first-wins through the queue emulator: a duplicate of a pending or running task is resolved
as superseded by it."""

from __future__ import annotations

import pytest

from coalescer.policy.rules import Policy
from tests.policy.support import Loop, rule

pytestmark = pytest.mark.integration


@pytest.fixture
def policy() -> Policy:
    return rule("k", strategy="first-wins")


async def test_duplicates_of_a_pending_task_are_superseded_by_it(loop: Loop) -> None:
    first = loop.create()
    await loop.feed()
    duplicates = [loop.create(), loop.create()]
    await loop.feed()
    assert await loop.enforce() == 2
    for task_id in duplicates:
        assert loop.last_run(task_id)["reasonResolved"] == "superseded"
        assert loop.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": first,
            "runId": 0,
        }
    assert loop.last_run(first)["state"] == "pending"
    assert [t.task_id for t in await loop.store.pending("k", now_ms=loop.now_ms())] == [first]


async def test_a_duplicate_of_a_running_task_is_superseded_by_it_until_it_ends(
    loop: Loop,
) -> None:
    first = loop.create()
    claim = loop.claim(first)
    duplicate = loop.create()
    await loop.feed()
    await loop.enforce()
    assert loop.last_run(duplicate)["reasonResolved"] == "superseded"
    async with loop.service() as http:
        lineage = (await http.get(f"/v1/tasks/{duplicate}")).json()
    assert lineage["supersededBy"]["reason"] == f"first-wins: duplicate of running {first}"
    loop.resolve(claim, "completed")
    await loop.feed()
    later = loop.create()  # the first one has ended: this one is nobody's duplicate
    await loop.feed()
    assert await loop.enforce() == 0
    assert loop.last_run(later)["state"] == "pending"


@pytest.mark.parametrize("policy", [rule("k", strategy="first-wins", supersede_running=True)])
async def test_a_running_duplicate_is_canceled_in_favour_of_the_first(loop: Loop) -> None:
    first = loop.create()
    loop.claim(first)
    duplicate = loop.create()
    loop.claim(duplicate)  # two workers got both before the service saw either
    await loop.feed()
    assert await loop.enforce() == 1
    run = loop.last_run(duplicate)
    assert (run["state"], run["reasonResolved"]) == ("exception", "canceled")
    assert loop.artifact(duplicate, 0, "public/superseded-by.json") == {
        "taskId": first,
        "runId": 0,
    }
    assert loop.last_run(first)["state"] == "running"
