"""Scenario 2: ``coalescer worker`` (the shim in the reference worker) against the real queue:
it claims the oldest task, asks the service, claims the rest, runs the newest and resolves the
others. Release 106 rejects ``superseded``, so ``auto`` resolution completes a secondary that no
task depends on and cancels one that has dependents."""

from __future__ import annotations

import datetime

import pytest

from tests_taskcluster.support import RESOLVED, Loop, RealQueue, Run, in_thread

pytestmark = pytest.mark.integration


async def test_the_worker_runs_the_newest_task_and_resolves_the_others(
    loop: Loop, queue: RealQueue, run: Run
) -> None:
    service = await loop.start_service()
    superseder = f"{service}/build/linux"
    ids = [
        queue.create("build.linux", superseder=superseder, command='echo "ran $TASK_ID"')
        for _ in range(4)
    ]
    # A task waiting for the second one: superseding must never let it be scheduled.
    dependent = queue.create("other", dependencies=[ids[1]])

    async def indexed() -> bool:
        return await loop.pending("build.linux") == ids

    await loop.eventually(indexed, "the four tasks indexed")
    loop.procs.start(
        "worker", "worker",
        "--task-queue-id", run.task_queue_id,
        "--worker-group", "coalescer-rt",
        "--worker-id", f"w-{run.uid}",
        "--superseder-allow", f"{service}/",
    )  # fmt: skip
    await loop.eventually(
        lambda: in_thread(lambda: all(queue.state(t) in RESOLVED for t in ids)),
        "every task resolved",
    )

    primary = queue.status(ids[-1])
    assert [r["reasonResolved"] for r in primary["runs"]] == ["completed"]
    assert f"ran {ids[-1]}" in queue.artifact(ids[-1], 0, "public/logs/live.log")
    assert queue.artifact(ids[-1], 0, "public/supersedes.json") == [
        {"taskId": t, "runId": 0} for t in ids[:-1]
    ]
    ends = {
        t: [(r["state"], r.get("reasonResolved")) for r in queue.status(t)["runs"]]
        for t in ids[:-1]
    }
    assert ends == {
        ids[0]: [("completed", "completed")],
        ids[1]: [("exception", "canceled")],
        ids[2]: [("completed", "completed")],
    }
    for task_id in ids[:-1]:
        assert queue.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": ids[-1],
            "runId": 0,
        }
        # Never run: the superseded tasks' logs do not exist.
        assert queue.artifact(task_id, 0, "public/logs/live.log") is None
    assert queue.state(dependent) == "unscheduled"
    await loop.eventually(lambda: _empty(loop), "the key to have no pending task")


async def _empty(loop: Loop) -> bool:
    return await loop.pending("build.linux") == []


async def test_held_claims_outlive_the_claim_timeout(
    loop: Loop, queue: RealQueue, run: Run
) -> None:
    """A primary that runs longer than the queue's claim timeout: every held claim is kept
    with ``reclaimTask`` (each reclaim's new credentials used from then on), so that no
    secondary expires and is retried while the primary runs."""
    timeout = claim_timeout(queue)
    if timeout > 120:
        pytest.skip(
            f"the deployment's claim timeout is {timeout:.0f} s: outliving it would take too "
            "long (the local kit takes TASK_CLAIM_TIMEOUT=60)"
        )
    service = await loop.start_service()
    superseder = f"{service}/long"
    command = f'sleep {timeout + 10:.0f}; echo "ran $TASK_ID"'
    ids = [
        queue.create("long", superseder=superseder, command=command, max_run_time=int(timeout) + 60)
        for _ in range(3)
    ]
    await loop.eventually(lambda: _pending_are(loop, "long", ids), "the three tasks indexed")
    loop.procs.start(
        "worker", "worker",
        "--task-queue-id", run.task_queue_id,
        "--worker-group", "coalescer-rt",
        "--worker-id", f"w-{run.uid}",
        "--superseder-allow", f"{service}/",
    )  # fmt: skip
    await loop.eventually(
        lambda: in_thread(lambda: all(queue.state(t) in RESOLVED for t in ids)),
        "every task resolved",
        within=timeout + 90,
    )
    assert f"ran {ids[-1]}" in queue.artifact(ids[-1], 0, "public/logs/live.log")
    for task_id in ids:
        [only] = queue.status(task_id)["runs"]  # no claim expired: nothing was retried
        assert (only["state"], only["reasonResolved"]) == ("completed", "completed")
        held = parse(only["takenUntil"]) - parse(only["started"])
        assert held > timeout, f"{task_id} was never reclaimed ({held:.0f} s)"
    for task_id in ids[:-1]:
        assert queue.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": ids[-1],
            "runId": 0,
        }


def claim_timeout(queue: RealQueue) -> float:
    """The deployment's claim timeout, from a probe task's claim."""
    probe = queue.create("probe")
    queue.claim(probe)
    [only] = queue.status(probe)["runs"]
    queue.client.cancelTask(probe)
    return parse(only["takenUntil"]) - parse(only["started"])


def parse(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


async def _pending_are(loop: Loop, key: str, expected: list[str]) -> bool:
    return await loop.pending(key) == expected
