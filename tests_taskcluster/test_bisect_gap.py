"""Scenario: the bisection covers the gap on the real queue (release 106), carried out by
``coalescer enforce``; the test plays the worker (``claimTask``, ``reportCompleted`` /
``reportFailed``), so that each push is running or resolved exactly when the scenario says, as
``tests/policy/test_bisect_gap.py`` does on the emulator:

* a regression whose culprit push was canceled by an earlier decision (``supersede-running``)
  is found: the canceled push runs again (``rerunTask``) and is named, ``gap`` 1; the key
  stays broken, and the next push's failure is searched from that culprit, run again by
  nobody;
* a push whose test was never scheduled (its build superseded by a newer push's, the test left
  as it was: ``cascade: leave``) is found through the failed test's build
  (``listDependentTasks``) and placed by its rank tag (``COALESCER_RANK_TAG``): its build runs
  again, the queue then schedules its test, which goes to the front of its task queue (never
  resolved before), fails, and is named.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests_taskcluster.support import RESOLVED, Loop, RealQueue, in_thread

pytestmark = pytest.mark.integration

KEY = "gap.build"
TEST = "gap.test"
RANK_TAG = "push"
#: One rule, every bisect field at its default (confirmations as the key's flake rate asks).
POLICY = """\
rules:
  - name: gap
    keys: "gap.*"
    strategy: latest-wins
    cascade: {cascade}
    supersede-running: true
    on-primary-failure: bisect
"""
#: The search's runs wait for the test's worker, which looks every 0.2 s.
WITHIN = 180.0
FAILED, COMPLETED = ("failed", "failed"), ("completed", "completed")
CANCELED = ("exception", "canceled")


def results(queue: RealQueue, task_id: str) -> list[tuple[str, str | None]]:
    return [(r["state"], r.get("reasonResolved")) for r in queue.status(task_id)["runs"]]


def work(queue: RealQueue, fates: Mapping[str, str]) -> None:
    """The test's worker: claim each pending run of ``fates``' tasks and resolve it as its
    task's fate (``completed`` or ``failed``)."""
    for task_id, fate in fates.items():
        runs = queue.status(task_id)["runs"]
        if not runs or runs[-1]["state"] != "pending":
            continue
        run_id = int(runs[-1]["runId"])
        claimed = queue.claim(task_id, run_id)
        if fate == "completed":
            claimed.reportCompleted(task_id, str(run_id))
        else:
            claimed.reportFailed(task_id, str(run_id))


async def pending(loop: Loop, task_id: str, *, present: bool, key: str = KEY) -> bool:
    """Whether the service lists ``task_id`` pending under ``key`` (``present``), or not."""
    return (task_id in await loop.pending(key)) is present


def lineage(service: str, task_id: str) -> dict[str, Any]:
    answer = httpx.get(f"{service}/v1/tasks/{task_id}", timeout=10)
    return dict(answer.json()) if answer.status_code == 200 else {}


def decision_states(service: str, task_id: str, key: str = KEY) -> list[str]:
    """The states of the decisions about ``task_id`` under ``key`` (``GET /v1/tasks``)."""
    found = lineage(service, task_id).get("decisions") or []
    return [d["state"] for d in found if d["key"] == key]


async def enforcing(loop: Loop, tmp_path: Path, cascade: str = "cancel") -> str:
    """``coalescer listen``, ``serve`` and ``enforce`` under :data:`POLICY`; the service's URL."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(cascade=cascade))
    loop.env["COALESCER_POLICY_FILE"] = str(policy)
    service = await loop.start_service()
    loop.procs.start("enforce", "enforce", "--poll", "0.2")
    return service


async def test_a_culprit_canceled_by_an_earlier_decision_runs_again_and_is_named(
    loop: Loop, queue: RealQueue, tmp_path: Path
) -> None:
    service = await enforcing(loop, tmp_path)

    # Push 0 runs and passes.
    good = queue.create(KEY)
    await loop.eventually(lambda: pending(loop, good, present=True), "push 0 indexed")
    queue.claim(good).reportCompleted(good, "0")
    await loop.eventually(lambda: pending(loop, good, present=False), "push 0 to leave")
    # Push 1 (broken) is running on a worker when push 2 arrives.
    culprit = queue.create(KEY)
    await loop.eventually(lambda: pending(loop, culprit, present=True), "push 1 indexed")
    queue.claim(culprit)
    await loop.eventually(lambda: pending(loop, culprit, present=False), "push 1 running")
    newest = queue.create(KEY)

    # An earlier decision: the running push 1 is canceled for push 2, which is left to run.
    await loop.eventually(
        lambda: in_thread(lambda: queue.state(culprit) in RESOLVED), "push 1 canceled"
    )
    assert results(queue, culprit) == [CANCELED]
    await loop.eventually(
        lambda: in_thread(lambda: decision_states(service, culprit) == ["canceled"]),
        "the decision that canceled push 1",
    )
    assert queue.state(newest) == "pending"

    # Push 2 fails: it held nothing, and push 1, canceled in its gap, runs again.
    fates = {good: "completed", culprit: "failed", newest: "failed"}
    await asyncio.to_thread(work, queue, fates)
    assert results(queue, newest)[0] == FAILED

    def probing() -> bool:
        return decision_states(service, culprit) == ["probing"]

    await loop.eventually(lambda: in_thread(probing), "push 1 taken for the search")

    def findings() -> list[dict[str, Any]]:
        return list(lineage(service, newest).get("bisection") or [])

    def over() -> bool:
        work(queue, fates)
        ids = (good, culprit, newest)
        return all(queue.state(t) in RESOLVED for t in ids) and bool(findings())

    await loop.eventually(lambda: in_thread(over), "the search to end", within=WITHIN)
    [finding] = findings()

    assert results(queue, good) == [COMPLETED]
    culprit_runs, newest_runs = results(queue, culprit), results(queue, newest)
    assert culprit_runs[0] == CANCELED and len(culprit_runs) >= 2, culprit_runs
    assert set(culprit_runs[1:]) == {FAILED}, culprit_runs
    assert set(newest_runs) == {FAILED}, newest_runs
    # Whether the queue raised push 1's rerun depends on whether its dependency resolver
    # (polling every 5 s) had handled the cancellation: the emulator's test pins that down.
    log = loop.procs.output("enforce")

    assert finding["verdict"] == "culprit"
    assert finding["culprit"] == {"taskId": culprit, "runId": len(culprit_runs) - 1}
    assert finding["lastGood"] == {"taskId": good, "runId": 0}
    assert (finding["held"], finding["gap"]) == (0, 1)
    assert finding["extraRuns"] == len(culprit_runs) - 1 + len(newest_runs) - 1
    assert f"bisection after {newest}: 1 pushes of the gap beyond the 0 it held" in log
    assert "culprit located: task " + culprit in log
    await loop.eventually(
        lambda: in_thread(lambda: decision_states(service, culprit) == ["ran"]),
        "push 1 back in its key's decisions (ran)",
    )
    # The search is over: one finding (a second delivery is the emulator's test).
    assert len(findings()) == 1
    assert results(queue, newest) == newest_runs
    assert results(queue, culprit) == culprit_runs

    # The key stays broken: push 3 fails too, no push having passed since push 1. Its search
    # starts from the culprit the first one named: neither push 1 nor push 2 runs again.
    later = queue.create(KEY)
    await loop.eventually(lambda: pending(loop, later, present=True), "push 3 indexed")
    fates[later] = "failed"

    def again() -> list[dict[str, Any]]:
        return list(lineage(service, later).get("bisection") or [])

    def over_again() -> bool:
        work(queue, fates)
        return queue.state(later) in RESOLVED and bool(again())

    await loop.eventually(lambda: in_thread(over_again), "the second search", within=WITHIN)
    [second] = again()
    assert second["verdict"] == "culprit"
    assert second["culprit"] == finding["culprit"]
    assert second["probability"] == finding["probability"]
    assert (second["held"], second["gap"]) == (0, 2)
    assert second["extraRuns"] == len(results(queue, later)) - 1  # its own confirmations
    assert results(queue, culprit) == culprit_runs
    assert results(queue, newest) == newest_runs
    log = loop.procs.output("enforce")
    assert f"{culprit}, the culprit an earlier search named, has not passed since" in log


def push(queue: RealQueue, n: int) -> tuple[str, str]:
    """Push ``n``: a build and the test that depends on it, ranked by their ``push`` tag."""
    tags = {RANK_TAG: str(n)}
    build = queue.create(KEY, tags=tags)
    test = queue.create(TEST, tags=tags, dependencies=[build])
    return build, test


async def test_a_test_never_scheduled_is_scheduled_by_its_build_and_jumps_the_queue(
    loop: Loop, queue: RealQueue, tmp_path: Path
) -> None:
    loop.env["COALESCER_RANK_TAG"] = RANK_TAG
    service = await enforcing(loop, tmp_path, cascade="leave")

    # Push 0 builds, and its test passes.
    b0, t0 = push(queue, 0)
    await loop.eventually(lambda: pending(loop, b0, present=True), "build 0 indexed")
    queue.claim(b0).reportCompleted(b0, "0")
    await loop.eventually(lambda: pending(loop, t0, present=True, key=TEST), "test 0 scheduled")
    queue.claim(t0).reportCompleted(t0, "0")
    await loop.eventually(lambda: pending(loop, t0, present=False, key=TEST), "test 0 to leave")
    # Pushes 1 and 2: the newer build holds the older; it completes, and the older is
    # superseded by it. Left as it was, push 1's test is never scheduled.
    b1, t1 = push(queue, 1)
    b2, t2 = push(queue, 2)

    def held() -> bool:
        [only] = queue.status(b1)["runs"]
        return (only["state"], only.get("workerGroup")) == ("running", "coalescer")

    await loop.eventually(lambda: in_thread(held), "build 1 held for build 2")
    assert queue.state(b2) == "pending"
    queue.claim(b2).reportCompleted(b2, "0")
    await loop.eventually(
        lambda: in_thread(lambda: queue.state(b1) in RESOLVED), "build 1 superseded"
    )
    assert results(queue, b1) == [CANCELED]  # release 106 rejects ``superseded``
    await loop.eventually(
        lambda: in_thread(lambda: queue.state(t2) == "pending"), "test 2 scheduled"
    )
    assert queue.state(t1) == "unscheduled"
    assert queue.status(t1)["runs"] == []

    # Push 1 broke the test: push 2's test fails. Push 1's build runs again first, taken from
    # its key's decisions; its test (taken from the test key's) is not scheduled yet.
    await asyncio.to_thread(work, queue, {t2: "failed"})

    def taken() -> bool:
        build = decision_states(service, b1)
        test = decision_states(service, t1, key=TEST)
        return build == ["probing"] and test == ["probing"] and queue.state(b1) == "pending"

    await loop.eventually(lambda: in_thread(taken), "build 1 run again for the search")
    assert queue.state(t1) == "unscheduled"
    # Build 1 completes: test 1 is scheduled (by the queue's dependency resolver, or the
    # search's rerunTask, whichever comes first) and, never resolved before, goes to the front.
    fates = {b1: "completed", t2: "failed"}

    def raised() -> bool:
        work(queue, fates)
        task = queue.client.task(t1)
        return queue.state(t1) == "pending" and task["priority"] == "highest"

    await loop.eventually(lambda: in_thread(raised), "test 1 pending at priority highest")
    assert results(queue, b1) == [CANCELED, COMPLETED]

    # It fails (and again, when the search confirms it).
    fates[t1] = "failed"

    def findings() -> list[dict[str, Any]]:
        return list(lineage(service, t2).get("bisection") or [])

    def over() -> bool:
        work(queue, fates)
        ids = (b0, t0, b1, t1, b2, t2)
        return all(queue.state(t) in RESOLVED for t in ids) and bool(findings())

    await loop.eventually(lambda: in_thread(over), "the search to end", within=WITHIN)
    [finding] = findings()
    t1_runs, t2_runs = results(queue, t1), results(queue, t2)
    assert t1_runs and set(t1_runs) == {FAILED}, t1_runs
    assert set(t2_runs) == {FAILED}, t2_runs
    assert results(queue, b1) == [CANCELED, COMPLETED]
    assert [results(queue, t) for t in (b0, t0, b2)] == [[COMPLETED]] * 3
    assert queue.client.task(t1)["priority"] == "highest"

    assert finding["verdict"] == "culprit"
    assert finding["culprit"] == {"taskId": t1, "runId": len(t1_runs) - 1}
    assert finding["lastGood"] == {"taskId": t0, "runId": 0}
    assert (finding["held"], finding["gap"]) == (0, 1)
    assert finding["extraRuns"] == len(t1_runs) + len(t2_runs) - 1
    log = loop.procs.output("enforce")
    assert f"bisection after {t2}: 1 pushes of the gap beyond the 0 it held" in log
    assert "culprit located: task " + t1 in log

    def back() -> bool:
        build = decision_states(service, b1)
        test = decision_states(service, t1, key=TEST)
        return build == ["ran"] and test == ["ran"]

    # The build the search ran goes back to its key's decisions.
    await loop.eventually(lambda: in_thread(back), "build 1 and test 1 back (ran)")
