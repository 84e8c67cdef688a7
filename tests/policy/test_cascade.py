"""``cascade``: what happens to tasks that depend on a victim."""

from __future__ import annotations

import pytest

from coalescer import model
from coalescer.policy.rules import Policy
from tests.policy.support import Loop, rule
from tests.worker.support import NoCancelScope

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
    assert lineage["supersededBy"]["runId"] == 0  # the victim's run
    assert lineage["supersededBy"]["action"] == "cascade"
    assert lineage["supersededBy"]["reason"] == f"depends on superseded {old}"
    assert model.parse_time_ms(lineage["supersededBy"]["at"]) > 0  # an ISO 8601 instant
    assert lineage["supersededBy"]["at"].endswith("Z")
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


@pytest.mark.parametrize("legacy", [False])
@pytest.mark.parametrize("cascade", ["leave"])
async def test_on_a_current_queue_every_victim_is_canceled_never_completed(
    loop: Loop,
) -> None:
    old, leaf = loop.create(), loop.create()
    child = loop.em.create_task(dependencies=[old], routes=[])
    new = loop.create()
    await loop.feed()
    await loop.enforce()
    for victim in (old, leaf):
        run = loop.last_run(victim)
        assert (run["state"], run["reasonResolved"]) == ("exception", "canceled")
        assert loop.artifact(victim, 0, "public/superseded-by.json") == {"taskId": new, "runId": 0}
        log = loop.artifact(victim, 0, "public/logs/live_backing.log")
        assert f"task {new} run 0 superseded it" in log
        assert "Why: policy rule 'rule-1' on key k: latest-wins: newer task" in log
        assert "Resolved by coalescer enforce (coalescer/enforcer)." in log
    # Canceling resolves the task, not completes it: the child is never scheduled.
    assert loop.status(child)["state"] == "unscheduled"
    async with loop.service() as http:
        canceled = (await http.get(f"/v1/tasks/{old}")).json()["supersededBy"]
        page = (await http.get(f"/tasks/{old}", headers={"Accept": "text/html"})).text
    assert canceled["state"] == "superseded"
    assert canceled["resolution"] == {
        "as": "canceled",
        "why": "the queue rejects reason 'superseded'",
    }
    assert "the queue rejects reason" in page


@pytest.mark.parametrize("legacy", [False])
@pytest.mark.parametrize("cascade", ["leave"])
async def test_without_the_cancel_scope_a_victim_with_dependents_is_released_once_then_spared(
    loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = loop.em.aio_queue
    monkeypatch.setattr(loop.em, "aio_queue", lambda **kw: NoCancelScope(client(**kw)))
    old = loop.create()
    child = loop.em.create_task(dependencies=[old], routes=[])
    loop.create()
    await loop.feed()
    await loop.enforce()
    # Released once (the enforcer learns it may not cancel), then left to run itself rather
    # than claimed and released again, a retry each time.
    runs = loop.status(old)["runs"]
    assert [(r["state"], r.get("reasonResolved")) for r in runs] == [
        ("exception", "worker-shutdown"),
        ("pending", None),
    ]
    assert loop.artifact(old, 0, "public/superseded-by.json") is None
    assert loop.status(child)["state"] == "unscheduled"
    async with loop.service() as http:
        by = (await http.get(f"/v1/tasks/{old}")).json()["supersededBy"]
    assert by["state"] == "spared" and by["victimRunId"] == 1
    assert by["resolution"]["as"] == "spared"
    assert "may not cancel" in by["resolution"]["why"]
