"""``cascade``: what happens to tasks that depend on a victim."""

from __future__ import annotations

import pytest

from coalescer.policy.rules import Policy
from tests.policy.support import Loop, rule

pytestmark = pytest.mark.integration


@pytest.fixture
def cascade() -> str:
    return "cancel"


@pytest.fixture
def policy(cascade: str) -> Policy:
    return rule("k", strategy="latest-wins", cascade=cascade)


async def test_dependents_are_canceled_transitively_before_the_victim_resolves(
    loop: Loop,
) -> None:
    old = loop.create()
    child = loop.em.create_task(dependencies=[old], routes=[])
    grandchild = loop.em.create_task(dependencies=[child], routes=[], requires="all-resolved")
    loop.create()
    await loop.feed()
    await loop.enforce()
    for task_id in (child, grandchild):
        run = loop.last_run(task_id)
        assert (run["state"], run["reasonResolved"]) == ("exception", "canceled")
    # all-resolved would have scheduled the grandchild once the child was canceled, had the
    # cascade not reached it first.
    assert not loop.em.messages("task-pending", grandchild)
    async with loop.service() as http:
        lineage = (await http.get(f"/v1/tasks/{child}")).json()
        stats = (await http.get("/v1/policy")).json()
    assert lineage["supersededBy"]["taskId"] == old
    assert lineage["supersededBy"]["action"] == "cascade"
    assert lineage["supersededBy"]["reason"] == f"depends on superseded {old}"
    assert stats["keys"][0]["cascaded"] == 2 and stats["keys"][0]["superseded"] == 1


@pytest.mark.parametrize("cascade", ["leave"])
async def test_leave_lets_the_queue_decide_for_dependents(loop: Loop) -> None:
    old = loop.create()
    child = loop.em.create_task(dependencies=[old], routes=[])
    loop.create()
    await loop.feed()
    await loop.enforce()
    assert loop.last_run(old)["reasonResolved"] == "superseded"
    # `superseded` is not `completed`: the child stays unscheduled, as the queue's rules say.
    assert loop.status(child)["state"] == "unscheduled"
