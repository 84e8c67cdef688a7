"""Scenario 1: the service follows the real queue's Pulse events (``coalescer listen`` →
Redis → ``coalescer serve``)."""

from __future__ import annotations

import httpx
import pytest

from tests_taskcluster.support import Loop, RealQueue

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
