"""The search covers the gap, not only what the primary held: pushes of its key that an earlier
decision superseded or canceled, and pushes never scheduled because a decision superseded
their dependency, run again (after what they lack) at the front of the queue."""

from __future__ import annotations

import logging

import pytest

from coalescer.emulator.harness import QueueEmulator
from coalescer.policy.rules import Policy
from coalescer.store import Store, bisections
from coalescer.store import lineage as records
from tests.policy.support import Loop, policy
from tests.policy.test_bisect import enforce, priority

pytestmark = pytest.mark.integration


def gap_policy(confirm: int = 0, cascade: str = "cancel") -> Policy:
    return policy(
        f"""
rules:
  - keys: "**"
    strategy: latest-wins
    cascade: {cascade}
    supersede-running: true
    on-primary-failure: bisect
    bisect-confirm: {confirm}
    bisect-parallel: 1
"""
    )


async def lineage_state(loop: Loop, key: str, task_id: str) -> str | None:
    found = await records.decision(loop.store, key, task_id)
    return None if found is None else found.state


async def test_a_culprit_canceled_by_an_earlier_decision_runs_again_and_is_named(
    queue_emulator: QueueEmulator, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    loop = Loop(queue_emulator, store, gap_policy())
    good = loop.create()
    loop.resolve(loop.claim(good), "completed")
    culprit = loop.create()
    claim = loop.claim(culprit)  # running on a worker when a newer push arrives
    newest = loop.create()
    await loop.feed()
    await enforce(loop, "e1")
    # An earlier decision: the running culprit was canceled for the newest push.
    assert loop.last_run(culprit)["reasonResolved"] == "canceled"
    assert await lineage_state(loop, "k", culprit) == "canceled"
    del claim
    loop.resolve(loop.claim(newest), "failed")
    caplog.set_level(logging.INFO, "coalescer.policy")
    raised: list[str] = []
    await enforce(loop, "e1", raised)
    # The newest push held nothing; the canceled push of its gap runs again. The queue (as
    # release 106's) will not change the priority of a task it resolved before: it keeps its
    # place in line, said once.
    assert loop.last_run(culprit)["state"] == "pending"
    assert priority(loop, culprit) == "lowest"
    said = [r for r in caplog.records if "will not raise the priority" in r.getMessage()]
    assert len(said) == 1 and culprit in said[0].getMessage()
    # Asked once, and said once, while the search's steps repeat until the run's event comes.
    assert raised == [culprit]
    said = [r for r in caplog.records if f"{culprit} runs again (push" in r.getMessage()]
    assert len(said) == 1
    assert await lineage_state(loop, "k", culprit) == "probing"
    loop.resolve(loop.claim(culprit), "failed")
    await enforce(loop, "e1")
    [finding] = await bisections.for_task(loop.store, ["k"], newest)
    assert finding["verdict"] == "culprit"
    assert finding["culprit"] == {"taskId": culprit, "runId": 1}
    assert finding["lastGood"] == {"taskId": good, "runId": 0}
    assert (finding["held"], finding["gap"], finding["extraRuns"]) == (0, 1, 1)
    assert await lineage_state(loop, "k", culprit) == "ran"
    # Its failure delivered again starts no second search.
    loop.fed = 0
    await enforce(loop, "e1")
    assert len(await bisections.for_task(loop.store, ["k"], newest)) == 1
    assert loop.last_run(newest)["runId"] == 0
    # The key stays broken: the next push fails too, and no push has passed since.
    later = loop.create()
    loop.resolve(loop.claim(later), "failed")
    await enforce(loop, "e1")
    [again] = await bisections.for_task(loop.store, ["k"], later)
    assert again["verdict"] == "culprit"
    assert again["culprit"] == {"taskId": culprit, "runId": 1}
    assert again["lastGood"] == {"taskId": good, "runId": 0}
    assert again["probability"] == finding["probability"]
    # Nothing ran again: not the culprit, not the failed push above it (which it stands for).
    assert again["extraRuns"] == 0 and again["gap"] == 2
    assert [r["runId"] for r in loop.status(culprit)["runs"]] == [0, 1]
    assert [r["runId"] for r in loop.status(newest)["runs"]] == [0]


async def test_an_earlier_search_s_sure_suspect_is_not_run_again_nor_named(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    loop = Loop(queue_emulator, store, gap_policy())
    good = loop.create()
    loop.resolve(loop.claim(good), "completed")
    suspect = loop.create()
    loop.resolve(loop.claim(suspect), "failed")  # held nothing: no search of its own
    await enforce(loop, "e1")
    # An earlier search found it failing first, surely, but could not see a push below it.
    ref = {"taskId": suspect, "runId": 0}
    earlier = {
        "key": "k",
        "by": "coalescer enforce",
        "primary": ref,
        "held": 0,
        "verdict": "inconclusive",
        "culprit": None,
        "suspect": ref,
        "probability": 0.999,
        "flake": 0.05,
        "lastGood": None,
        "runs": [ref | {"attempt": 0, "passed": False, "ended": "2026-01-01T00:00:00.000Z"}],
        "intermittent": [],
        "standsFor": [],
        "extraRuns": 0,
        "rounds": 0,
        "located": "2026-01-01T00:00:00.000Z",
    }
    assert await bisections.record(loop.store, earlier, 1)
    later = loop.create()
    loop.resolve(loop.claim(later), "failed")
    await enforce(loop, "e1")
    [finding] = await bisections.for_task(loop.store, ["k"], later)
    # The search starts from it and runs nothing (bisect-confirm 0), but a suspect it was and
    # stays: nothing this search ran makes it a culprit.
    assert finding["verdict"] == "inconclusive" and finding["culprit"] is None
    assert finding["suspect"] == ref and finding["probability"] == 0.999
    assert finding["extraRuns"] == 0
    assert [r["runId"] for r in loop.status(suspect)["runs"]] == [0]


def push(loop: Loop, n: int) -> tuple[str, str]:
    """Push ``n``: a build and the test that depends on it, ranked by their ``push`` tag."""
    tags = {"push": str(n)}
    build = loop.create("build", tags=tags)
    test = loop.create("test", tags=tags, dependencies=[build])
    return build, test


def passed(loop: Loop, n: int) -> tuple[str, str]:
    """Push ``n``, its build completed and then its test (scheduled by the queue)."""
    build, test = push(loop, n)
    loop.resolve(loop.claim(build), "completed")
    loop.em.wait_for_message("task-pending", test)  # the queue's dependency resolver
    loop.resolve(loop.claim(test), "completed")
    return build, test


async def three_pushes(loop: Loop) -> tuple[tuple[str, str], ...]:
    """Push 0 builds and its test passes; push 2's build holds push 1's for it, completes, and
    push 1's build is superseded by it (its test never runs); push 2's test is pending."""
    b0, t0 = passed(loop, 0)
    b1, t1 = push(loop, 1)
    b2, t2 = push(loop, 2)
    await loop.feed()
    await enforce(loop, "e1")
    loop.resolve(loop.claim(b2), "completed")
    loop.em.wait_for_message("task-pending", t2)
    await loop.feed()
    await enforce(loop, "e1")
    return (b0, t0), (b1, t1), (b2, t2)


async def test_a_push_never_scheduled_runs_its_superseded_build_then_its_test(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    loop = Loop(queue_emulator, store, gap_policy(), rank_tag="push")
    (_, t0), (b1, t1), (_, t2) = await three_pushes(loop)
    # Push 1's test never runs: canceled with its build (cascade).
    assert loop.last_run(b1)["reasonResolved"] == "superseded"
    assert loop.last_run(t1)["reasonResolved"] == "canceled"
    # Push 1 broke the test: push 2's test fails.
    loop.resolve(loop.claim(t2), "failed")
    await enforce(loop, "e1")
    # Push 1's build runs again first (the queue keeps a resolved task's priority), taken
    # from its key's decisions; its test, taken from the test key's, waits for it.
    assert loop.last_run(b1)["state"] == "pending"
    assert await lineage_state(loop, "build", b1) == "probing"
    assert await lineage_state(loop, "test", t1) == "probing"
    assert loop.last_run(t1)["state"] == "exception"
    loop.resolve(loop.claim(b1), "completed")
    await enforce(loop, "e1")
    # Then the test runs again.
    assert loop.last_run(t1)["state"] == "pending"
    loop.resolve(loop.claim(t1), "failed")
    await enforce(loop, "e1")
    [finding] = await bisections.for_task(loop.store, ["test"], t2)
    assert finding["verdict"] == "culprit"
    assert finding["culprit"] == {"taskId": t1, "runId": 1}
    assert finding["lastGood"] == {"taskId": t0, "runId": 0}
    assert (finding["held"], finding["gap"]) == (0, 1)
    # The build the search ran goes back to its key's decisions.
    assert await lineage_state(loop, "build", b1) == "ran"
    assert await lineage_state(loop, "test", t1) == "ran"


async def test_a_test_never_scheduled_is_scheduled_by_its_build_and_jumps_the_queue(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    loop = Loop(queue_emulator, store, gap_policy(cascade="leave"), rank_tag="push")
    (_, t0), (b1, t1), (_, t2) = await three_pushes(loop)
    # Left as it was with its build superseded: push 1's test is never scheduled.
    assert loop.status(t1)["state"] == "unscheduled"
    loop.resolve(loop.claim(t2), "failed")
    await enforce(loop, "e1")
    assert loop.last_run(b1)["state"] == "pending"
    assert loop.status(t1)["state"] == "unscheduled"
    loop.resolve(loop.claim(b1), "completed")
    loop.em.wait_for_message("task-pending", t1)  # the queue schedules it
    await enforce(loop, "e1")
    # Never resolved before: it goes to the front of its task queue.
    assert loop.last_run(t1)["state"] == "pending"
    assert priority(loop, t1) == "highest"
    loop.resolve(loop.claim(t1), "failed")
    await enforce(loop, "e1")
    [finding] = await bisections.for_task(loop.store, ["test"], t2)
    assert finding["culprit"] == {"taskId": t1, "runId": 0}
    assert finding["lastGood"] == {"taskId": t0, "runId": 0}


async def test_without_a_rank_tag_a_test_never_scheduled_leaves_the_culprit_unsure(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    # Ordered by their first run's scheduled time, a test that never ran has no place in its
    # key: the search cannot run it, and names no culprit over it.
    loop = Loop(queue_emulator, store, gap_policy(cascade="leave"))
    passed(loop, 0)
    b1, t1 = push(loop, 1)
    b2, t2 = push(loop, 2)
    await loop.feed()
    await enforce(loop, "e1")
    loop.resolve(loop.claim(b2), "completed")  # push 1's build superseded: its test never runs
    loop.em.wait_for_message("task-pending", t2)
    b3, t3 = push(loop, 3)
    await loop.feed()
    await enforce(loop, "e1")
    loop.resolve(loop.claim(b3), "completed")
    loop.em.wait_for_message("task-pending", t3)
    await loop.feed()
    await enforce(loop, "e1")  # push 3's test holds push 2's
    assert loop.status(t1)["state"] == "unscheduled"
    loop.resolve(loop.claim(t3), "failed")
    await enforce(loop, "e1")
    for _ in range(5):  # push 2's test is probed (and its failure confirmed): it fails
        pending = [t for t in (t2, t3) if loop.last_run(t)["state"] == "pending"]
        if not pending:
            break
        for task_id in pending:
            loop.resolve(loop.claim(task_id), "failed")
        await enforce(loop, "e1")
    [finding] = await bisections.for_task(loop.store, ["test"], t3)
    assert finding["verdict"] == "inconclusive"
    assert finding["culprit"] is None
    assert finding["suspect"]["taskId"] == t2
    # Push 1 never ran: its build was not run again for a search that could not place it.
    assert loop.status(t1)["state"] == "unscheduled"
    assert [r["state"] for r in loop.status(b1)["runs"]] == ["exception"]


async def test_a_build_the_gap_waits_for_pending_behind_the_backlog_jumps_the_queue(
    queue_emulator: QueueEmulator, store: Store
) -> None:
    """Builds under no rule: push 1's is still pending (the backlog), so its test was never
    scheduled. The search waits for that build, never takes it, but raises it: it is the next
    build its queue runs."""
    loop = Loop(
        queue_emulator,
        store,
        policy(
            """
rules:
  - keys: "test"
    strategy: latest-wins
    on-primary-failure: bisect
    bisect-confirm: 0
"""
        ),
        rank_tag="push",
    )
    _, t0 = passed(loop, 0)
    b1, t1 = push(loop, 1)
    b2, t2 = push(loop, 2)
    loop.resolve(loop.claim(b2), "completed")
    loop.em.wait_for_message("task-pending", t2)
    await loop.feed()
    await enforce(loop, "e1")
    loop.resolve(loop.claim(t2), "failed")
    await enforce(loop, "e1")
    assert loop.last_run(b1)["state"] == "pending" and loop.status(t1)["state"] == "unscheduled"
    assert priority(loop, b1) == "highest"
    loop.resolve(loop.claim(b1), "completed")
    loop.em.wait_for_message("task-pending", t1)
    await enforce(loop, "e1")
    assert priority(loop, t1) == "highest"
    loop.resolve(loop.claim(t1), "failed")
    await enforce(loop, "e1")
    [finding] = await bisections.for_task(loop.store, ["test"], t2)
    assert finding["culprit"] == {"taskId": t1, "runId": 0}
    assert finding["lastGood"] == {"taskId": t0, "runId": 0}


async def test_no_culprit_is_named_over_pushes_an_emptied_index_never_saw(
    queue_emulator: QueueEmulator, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    rules = policy(
        """
rules:
  - keys: "**"
    strategy: latest-wins
    on-primary-failure: bisect
    bisect-confirm: 0
"""
    )
    caplog.set_level(logging.INFO, "coalescer.policy")
    loop = Loop(queue_emulator, store, rules)
    good = loop.create()
    good_claim = loop.claim(good)  # running on a worker through what follows
    culprit = loop.create()
    loop.resolve(loop.claim(culprit), "failed")
    await enforce(loop, "e1")
    # The store is emptied (a restart without persistence): the index knows every task only
    # from now, as the marker says once a process finds it missing.
    await loop.store.client.flushdb()
    loop.em.clock.advance(60)
    await loop.store.index_state(loop.now_ms())
    loop.resolve(good_claim, "completed")
    victim = loop.create()
    primary = loop.create()
    await enforce(loop, "e1")
    assert await lineage_state(loop, "k", victim) == "held"
    loop.resolve(loop.claim(primary), "failed")
    await enforce(loop, "e1")
    loop.resolve(loop.claim(victim), "failed")  # broken since the culprit, which it never saw
    await enforce(loop, "e1")
    [finding] = await bisections.for_task(loop.store, ["k"], primary)
    # The victim is the first failing push the index knows above the last good, but the
    # culprit before it ended unseen: the search blames nobody.
    assert finding["verdict"] == "inconclusive"
    assert finding["culprit"] is None
    assert finding["suspect"] == {"taskId": victim, "runId": 1}
    assert finding["lastGood"] == {"taskId": good, "runId": 0}
    said = [r.getMessage() for r in caplog.records if "ended unseen" in r.getMessage()]
    assert len(said) == 1 and good in said[0]
