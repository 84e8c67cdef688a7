"""Scenario 2: ``coalescer worker`` (the shim in the reference worker) against the real queue:
it claims the oldest task, asks the service, claims the rest, runs the newest and resolves the
others. Release 106 rejects ``superseded``, so the default ``auto`` resolution cancels each
secondary (never ``completed``), and, for a worker whose credentials may not cancel, releases
them so that each runs itself."""

from __future__ import annotations

import datetime

import pytest
import taskcluster

from tests_taskcluster.support import RESOLVED, WITHIN, Loop, RealQueue, Run, in_thread

pytestmark = pytest.mark.integration

BACKING = "public/logs/live_backing.log"


async def test_the_worker_runs_the_newest_task_and_cancels_the_others(
    loop: Loop, queue: RealQueue, run: Run
) -> None:
    service = await loop.start_service()
    superseder = f"{service}/build/linux"
    ids = [
        queue.create("build.linux", superseder=superseder, command='echo "ran $TASK_ID"')
        for _ in range(5)
    ]
    # A task waiting for the second one: superseding must never let it be scheduled.
    dependent = queue.create("other", dependencies=[ids[1]])

    await loop.eventually(lambda: _pending_are(loop, "build.linux", ids), "the five tasks indexed")
    await run_worker_until_resolved(loop, queue, run, service, ids)

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
    # None reads as passed.
    assert ends == {t: [("exception", "canceled")] for t in ids[:-1]}
    for task_id in ids[:-1]:
        assert queue.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": ids[-1],
            "runId": 0,
        }
        # Never run: no live log; the backing log the UI opens says what happened instead.
        assert queue.artifact(task_id, 0, "public/logs/live.log") is None
        text = queue.artifact(task_id, 0, BACKING)
        assert f"task {ids[-1]} run 0 superseded it" in text
        assert "Resolved exception/canceled" in text
        assert f"{loop.env['TASKCLUSTER_ROOT_URL']}/tasks/{ids[-1]}" in text
        assert f"{service}/tasks/{task_id}" in text
    assert queue.state(dependent) == "unscheduled"
    await loop.eventually(lambda: _empty(loop), "the key to have no pending task")


async def test_a_worker_that_may_not_cancel_lets_each_task_run_itself(
    loop: Loop, queue: RealQueue, run: Run
) -> None:
    """Without ``queue:cancel-task``, ``auto`` never completes a superseded task: the first
    secondaries are released (each says so in its log), and every task runs itself."""
    service = await loop.start_service()
    superseder = f"{service}/nocancel"
    ids = [
        queue.create("nocancel", superseder=superseder, command='echo "ran $TASK_ID"')
        for _ in range(3)
    ]
    await loop.eventually(lambda: _pending_are(loop, "nocancel", ids), "the three tasks indexed")
    deployment = queue.deployment
    scopes = [
        "queue:claim-work:coalescer-rt/*",
        "queue:claim-task:coalescer-rt/*",
        "queue:worker-id:coalescer-rt/*",
        "queue:status:*",
        "queue:get-task:*",
        "queue:get-artifact:public/*",
    ]
    now = datetime.datetime.now(datetime.UTC)
    temporary = taskcluster.createTemporaryCredentials(
        deployment.client_id,
        deployment.access_token,
        now - datetime.timedelta(minutes=5),
        now + datetime.timedelta(hours=1),
        scopes,
    )
    loop.procs.env = dict(
        loop.env,
        TASKCLUSTER_CLIENT_ID=temporary["clientId"],
        TASKCLUSTER_ACCESS_TOKEN=temporary["accessToken"],
        TASKCLUSTER_CERTIFICATE=temporary["certificate"],
    )
    await run_worker_until_resolved(loop, queue, run, service, ids)
    for task_id in ids:
        runs = queue.status(task_id)["runs"]
        # Each ran itself, after at most one release.
        assert runs[-1]["reasonResolved"] == "completed", runs
        assert all(r["reasonResolved"] == "worker-shutdown" for r in runs[:-1]), runs
        assert f"ran {task_id}" in queue.artifact(
            task_id, runs[-1]["runId"], "public/logs/live.log"
        )
        for released in runs[:-1]:
            assert queue.artifact(task_id, released["runId"], "public/superseded-by.json") is None
            text = queue.artifact(task_id, released["runId"], BACKING)
            assert "will run again" in text and "may not cancel" in text
    assert any(len(queue.status(t)["runs"]) == 2 for t in ids)  # one release happened at least


async def run_worker_until_resolved(
    loop: Loop, queue: RealQueue, run: Run, service: str, ids: list[str], within: float = WITHIN
) -> None:
    """Start ``coalescer worker`` on the run's task queue, following ``service``, and wait
    until every task of ``ids`` is resolved."""
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
        within=within,
    )


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
    await run_worker_until_resolved(loop, queue, run, service, ids, within=timeout + 90)
    assert f"ran {ids[-1]}" in queue.artifact(ids[-1], 0, "public/logs/live.log")
    for task_id in ids:
        [only] = queue.status(task_id)["runs"]  # no claim expired: nothing was retried
        ended = ("completed", "completed") if task_id == ids[-1] else ("exception", "canceled")
        assert (only["state"], only["reasonResolved"]) == ended
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
