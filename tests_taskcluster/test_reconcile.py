"""Scenario 4: ``coalescer reconcile`` and ``coalescer reconcile --rebuild`` against the real
queue: events the index missed are recovered from ``statuses``, and an emptied index is rebuilt
from ``listPendingTasks``/``listClaimedTasks``."""

from __future__ import annotations

import pytest
import redis

from tests_taskcluster.support import Loop, RealQueue, Run

pytestmark = pytest.mark.integration


async def test_reconcile_recovers_missed_events_and_rebuild_refills_an_emptied_index(
    loop: Loop, queue: RealQueue, run: Run, redis_url: str
) -> None:
    await loop.start_service()
    ids = [queue.create("reconcile") for _ in range(4)]

    async def pending_are(expected: list[str]) -> bool:
        return await loop.pending("reconcile") == expected

    await loop.eventually(lambda: pending_are(ids), "the four tasks indexed")
    # The consumer stops: what happens next on the queue never reaches the index.
    loop.stop_process("listen")
    queue.claim(ids[0]).reportCompleted(ids[0], 0)
    queue.client.cancelTask(ids[1])
    queue.claim(ids[2])
    assert await loop.pending("reconcile") == ids

    done = loop.command("reconcile")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(
        "3 fixed, 1 already right, 0 removed (unknown to the queue), 0 expired, 0 failed"
    ), done.stdout
    assert await loop.pending("reconcile") == ids[3:]
    again = loop.command("reconcile")
    assert again.returncode == 0 and "0 fixed, 4 already right" in again.stdout, again

    # Redis loses everything (restarted without persistence, say).
    client = redis.Redis.from_url(redis_url)
    try:
        client.flushdb()
    finally:
        client.close()
    assert await loop.pending("reconcile") == []
    rebuilt = loop.command("reconcile", "--rebuild", "--task-queue-id", run.task_queue_id)
    assert rebuilt.returncode == 0, rebuilt.stderr
    # The pending task and the claimed one, listed from the task queue, under one key.
    assert "rebuilt 2 tasks under 1 keys (2 listed)" in rebuilt.stdout, rebuilt.stdout
    assert "2 indexed, 0 already known, 0 expired, 0 gone from the queue, 0 failed" in (
        rebuilt.stdout
    )
    assert await loop.pending("reconcile") == ids[3:]
    # The claimed task is known again as running: once it ends, reconcile has nothing to fix.
    queue.client.cancelTask(ids[2])
    after = loop.command("reconcile")
    assert after.returncode == 0 and "1 fixed, 1 already right" in after.stdout, after
