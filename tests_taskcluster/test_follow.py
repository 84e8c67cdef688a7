"""Scenario 1: the service follows the real queue's Pulse events (``coalescer listen`` →
Redis → ``coalescer serve``)."""

from __future__ import annotations

import datetime

import httpx
import pytest
import taskcluster

from tests_taskcluster.support import Loop, RealQueue, in_thread

pytestmark = pytest.mark.integration


async def test_the_key_shows_pending_tasks_in_order_and_resolved_ones_leave(
    loop: Loop, queue: RealQueue
) -> None:
    await loop.start_service()
    # Ordered by each task's scheduled time, as the queue's task-pending messages give it.
    ids = [queue.create("follow") for _ in range(4)]

    async def pending_are(expected: list[str]) -> bool:
        return await loop.pending("follow") == expected

    await loop.eventually(lambda: pending_are(ids), "the four tasks, oldest first")
    # Whichever task a worker holds, the answer is the key's pending tasks, oldest first.
    assert await loop.supersedes("follow", ids[-1]) == ids
    assert await loop.supersedes("follow", ids[1]) == ids

    # Running (claimed), canceled, completed: none is pending any more.
    queue.claim(ids[0])
    queue.client.cancelTask(ids[1])
    queue.claim(ids[2]).reportCompleted(ids[2], 0)
    await loop.eventually(lambda: pending_are(ids[3:]), "only the untouched task pending")
    assert await loop.supersedes("follow", ids[3]) == [ids[3]]

    # A run that ends worker-shutdown is retried: its new run is pending again, in its place.
    worker = queue.claim(ids[3])
    await loop.eventually(lambda: pending_are([]), "the claimed task to leave")
    worker.reportException(ids[3], 0, {"reason": "worker-shutdown"})
    await loop.eventually(lambda: pending_are(ids[3:]), "the retried task pending again")
    assert queue.status(ids[3])["runs"][-1]["runId"] == 1


async def test_a_task_the_index_does_not_know_is_learned_from_the_queue(
    loop: Loop, queue: RealQueue
) -> None:
    await loop.start_service(listen=False)  # no events at all: every answer is learned
    ids = [queue.create("learn") for _ in range(3)]
    assert await loop.supersedes("learn", ids[0]) == ids[:1]
    # Each learned task takes its place by its scheduled time on the queue.
    assert await loop.supersedes("learn", ids[2]) == [ids[0], ids[2]]
    assert await loop.supersedes("learn", ids[1]) == ids
    async with httpx.AsyncClient(timeout=10) as http:
        metrics = (await http.get(f"{loop.service}/metrics")).text
    assert 'coalescer_learn_total{outcome="learned"} 3.0' in metrics


async def test_tasks_past_their_deadline_leave_the_key(loop: Loop, queue: RealQueue) -> None:
    """The index stops offering a task at its deadline, before the queue's deadline resolver
    (60-80 s later) publishes its ``deadline-exceeded`` exception; that message, and the one
    of a task that never ran, are applied (none is set aside)."""
    await loop.start_service()
    deadline = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=20)
    short = {"deadline": taskcluster.stringDate(deadline)}
    expiring = queue.create("deadline", **short)
    # Never scheduled: it waits for the first, which never completes.
    waiting = queue.create("deadline", dependencies=[expiring], **short)
    kept = queue.create("deadline")
    await loop.eventually(
        lambda: _pending_are(loop, "deadline", [expiring, kept]), "the two pending tasks"
    )
    await loop.eventually(
        lambda: _pending_are(loop, "deadline", [kept]), "the expired task to leave", within=40
    )
    assert queue.state(expiring) == "pending"  # the queue has not resolved it yet

    def resolved() -> bool:
        return all(queue.state(t) == "exception" for t in (expiring, waiting))

    await loop.eventually(lambda: in_thread(resolved), "the deadline resolver", within=150)
    for task_id in (expiring, waiting):
        assert queue.last_run(task_id)["reasonResolved"] == "deadline-exceeded"
    # The index already holds what the queue says: reconcile finds nothing to fix.
    done = loop.command("reconcile")
    assert done.returncode == 0, done.stderr
    summary = done.stdout.strip().split(": ", 1)[-1]
    assert summary == (
        "0 fixed, 3 already right, 0 removed (unknown to the queue), 0 expired, 0 failed"
    ), done.stdout
    assert await loop.pending("deadline") == [kept]


async def _pending_are(loop: Loop, key: str, expected: list[str]) -> bool:
    return await loop.pending(key) == expected
