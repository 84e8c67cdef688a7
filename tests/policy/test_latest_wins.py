"""latest-wins through the queue emulator: the newest task supersedes older pending ones at
once; the enforcer claims and resolves them with ``public/superseded-by.json``."""

from __future__ import annotations

import logging
import re

import pytest
from prometheus_client import REGISTRY

from tests.policy.support import Loop, rule

pytestmark = pytest.mark.integration


async def test_a_newer_task_supersedes_the_older_pending_ones(loop: Loop) -> None:
    older = [loop.create() for _ in range(3)]
    newest = loop.create()
    await loop.feed()  # one batch: each arrival supersedes the one before, a chain

    # Decided at once: the victims are no longer offered to workers asking the superseder.
    pending = [t.task_id for t in await loop.store.pending("k", now_ms=loop.now_ms())]
    assert pending == [newest]

    assert await loop.enforce() == 3
    for task_id in older:
        run = loop.last_run(task_id)
        assert (run["state"], run["reasonResolved"]) == ("exception", "superseded")
        assert (run["workerGroup"], run["workerId"]) == ("coalescer", "enforcer")
        assert loop.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": newest,
            "runId": 0,
        }
    assert loop.last_run(newest)["state"] == "pending"


async def test_a_victim_a_worker_claimed_first_is_logged_once_with_that_worker(
    loop: Loop, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "coalescer.policy")
    older = loop.create()
    newest = loop.create()
    await loop.feed()  # decided: older superseded by newest
    loop.claim(older)  # but a worker claims it before the enforcer acts
    assert await loop.enforce() == 1
    assert await loop.enforce() == 0
    lines = [r.getMessage() for r in caplog.records if "missed" in r.getMessage()]
    assert lines == [
        f"{older} missed: worker wg/w1 claimed it before it could be superseded by {newest} (rule rule-1)"
    ]
    assert loop.last_run(older)["state"] == "running"


async def test_a_chain_of_replacements_ends_at_the_final_primary(loop: Loop) -> None:
    a = loop.create()
    await loop.feed()
    b = loop.create()
    await loop.feed()  # A superseded by B
    c = loop.create()
    await loop.feed()  # B superseded by C
    assert await loop.enforce() == 2
    # A's artifact names the task whose result stands for it, C; the lineage keeps A by B.
    assert loop.artifact(a, 0, "public/superseded-by.json") == {"taskId": c, "runId": 0}
    assert loop.artifact(b, 0, "public/superseded-by.json") == {"taskId": c, "runId": 0}
    async with loop.service() as http:
        got = (await http.get(f"/v1/tasks/{a}")).json()
        assert got["supersededBy"]["taskId"] == b
        assert got["supersededBy"]["state"] == "superseded"
        assert got["supersededBy"]["rule"] == "rule-1"
        assert got["supersededBy"]["reason"] == f"latest-wins: newer task {b} is pending"
        assert got["chain"] == [b, c] and got["finalPrimary"] == c
        top = (await http.get(f"/v1/tasks/{c}")).json()
        assert top["supersededBy"] is None and top["finalPrimary"] is None
        assert [d["taskId"] for d in top["supersedes"]] == [b]
        # The handoff: what C replaces, transitively, with the definitions the enforcer saw.
        handoff = (await http.get(f"/v1/tasks/{c}/supersedes")).json()
        assert [h["taskId"] for h in handoff] == [a, b]
        assert handoff[0]["task"]["routes"] == ["coalesce.v1.k"]
        missing = await http.get(f"/v1/tasks/{loop.create()}")
        assert missing.status_code == 404
        page = (await http.get(f"/tasks/{a}", headers={"accept": "text/html"})).text
    assert "Superseded</b> by" in page and f'href="/tasks/{b}"' in page
    assert "Chain of replacements" in page and "rule-1" in page


async def test_enforcing_again_changes_nothing(loop: Loop) -> None:
    older, newest = loop.create(), loop.create()
    await loop.feed()
    assert await loop.enforce() == 1
    resolutions = len(loop.em.messages("task-exception", older))
    assert await loop.enforce() == 0
    assert len(loop.em.messages("task-exception", older)) == resolutions == 1
    assert await loop.store.client.xlen("co:{k}:o") == 0
    assert loop.last_run(newest)["state"] == "pending"


@pytest.mark.parametrize("legacy", [False])
async def test_a_current_queue_gets_canceled_victims_and_canceled_dependents(
    loop: Loop,
) -> None:
    older = loop.create()
    dependent = loop.em.create_task(dependencies=[older], routes=[])
    newest = loop.create()
    await loop.feed()
    await loop.enforce()
    # `superseded` is refused by a current queue: `auto` cancels the victim, after canceling
    # its dependent (cascade), so that the dependent is never scheduled.
    run = loop.last_run(older)
    assert (run["state"], run["reasonResolved"]) == ("exception", "canceled")
    assert loop.artifact(older, 0, "public/superseded-by.json")["taskId"] == newest
    assert loop.last_run(dependent)["reasonResolved"] == "canceled"
    assert not loop.em.messages("task-pending", dependent)


async def test_worker_time_saved_is_estimated_from_the_key_s_recent_runs(loop: Loop) -> None:
    for seconds in (100, 300, 200):  # median 200 s
        done = loop.create()
        claim = loop.claim(done)
        loop.em.clock.advance(seconds)
        loop.resolve(claim, "completed")
    await loop.feed()
    older, _ = loop.create(), loop.create()
    await loop.feed()
    before = REGISTRY.get_sample_value("coalescer_enforcer_saved_seconds_total", {"rule": "rule-1"})
    await loop.enforce()
    async with loop.service() as http:
        [row] = (await http.get("/v1/policy")).json()["keys"]
    assert row == {
        "key": "k",
        "rule": "rule-1",
        "decided": 1,
        "superseded": 1,
        "savedMs": pytest.approx(200_000, abs=1000),  # the emulator's clock also runs
    }
    after = REGISTRY.get_sample_value("coalescer_enforcer_saved_seconds_total", {"rule": "rule-1"})
    assert (after or 0) - (before or 0) == pytest.approx(200, abs=1)
    async with loop.service() as http:
        metrics = (await http.get("/metrics")).text
    assert 'coalescer_policy_tasks_total{outcome="superseded",rule="rule-1"} 1.0' in metrics
    saved = re.search(r'coalescer_policy_saved_seconds_total\{rule="rule-1"\} (\S+)', metrics)
    assert saved and float(saved.group(1)) == pytest.approx(200, abs=1)
    assert loop.last_run(older)["reasonResolved"] == "superseded"


@pytest.mark.parametrize("policy", [rule("k", strategy="latest-wins", age="60s")])
async def test_an_age_threshold_becomes_due_with_time_alone(loop: Loop) -> None:
    older, newest = loop.create(), loop.create()
    await loop.feed()
    assert await loop.enforce() == 0  # nobody has waited 60 s yet
    loop.em.clock.advance(61)
    async with loop.enforcer(tick=0) as enforcer:  # no event: the enforcer's tick decides
        assert await enforcer.round() == 1
    assert loop.artifact(older, 0, "public/superseded-by.json") == {"taskId": newest, "runId": 0}


async def test_victims_not_yet_superseded_return_when_the_primary_ends_in_exception(
    loop: Loop,
) -> None:
    older, newer = loop.create(), loop.create()
    await loop.feed()  # older is decided, not yet carried out
    loop.resolve(loop.claim(newer), "malformed-payload")
    await loop.feed()
    assert [t.task_id for t in await loop.store.pending("k", now_ms=loop.now_ms())] == [older]
    assert await loop.enforce() == 1  # the stale entry, acknowledged and nothing more
    assert loop.last_run(older)["state"] == "pending"
    async with loop.service() as http:
        lineage = (await http.get(f"/v1/tasks/{older}")).json()
    assert lineage["supersededBy"]["state"] == "released"
    assert lineage["supersededBy"]["reason"] == f"primary {newer} ended in exception"
    newest = loop.create()  # a new primary: the older task is decided anew
    await loop.feed()
    await loop.enforce()
    assert loop.artifact(older, 0, "public/superseded-by.json") == {"taskId": newest, "runId": 0}


async def test_events_posted_to_the_service_are_decided_on_arrival(loop: Loop) -> None:
    older, newest = loop.create(), loop.create()
    async with loop.service() as http:
        posted = await http.post(
            "/v1/events",
            json=[m for m in loop.em.published if "task-pending" in m["exchange"]],
            headers={"authorization": "Bearer s3cret"},
        )
        assert [r["status"] for r in posted.json()["results"]] == ["applied", "applied"]
        lineage = (await http.get(f"/v1/tasks/{older}")).json()
    assert lineage["supersededBy"]["taskId"] == newest
    assert lineage["supersededBy"]["state"] == "decided"


@pytest.mark.parametrize("legacy", [False, True])
async def test_a_victim_whose_primary_is_superseded_later_names_the_task_that_stands(
    loop: Loop,
) -> None:
    """A canceled for B; only then B superseded by C: A's log and artifact name C, whose result
    stands for A, as the service's page of A does."""
    a = loop.create()
    await loop.feed()
    b = loop.create()
    assert await loop.enforce() == 1  # A resolved for B
    assert f"task {b} run 0 superseded it" in loop.artifact(a, 0, "public/logs/live_backing.log")
    c = loop.create()
    assert await loop.enforce() == 1  # B resolved for C
    text = loop.artifact(a, 0, "public/logs/live_backing.log")
    assert f"task {c} run 0 superseded it, and that task's result stands" in text, text
    assert f"task {b} superseded it first, and was superseded in turn" in text, text
    assert loop.artifact(a, 0, "public/superseded-by.json") == {"taskId": c, "runId": 0}
    async with loop.service() as http:
        assert (await http.get(f"/v1/tasks/{a}")).json()["finalPrimary"] == c
