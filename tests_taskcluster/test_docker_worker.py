"""Scenario 5: the service's ``/v1/docker-worker/<key>`` route, followed by docker-worker's own
superseding rules (unmodified), on the real queue. The answer is docker-worker's (newest first,
its own task included, while it runs); docker-worker claims every listed task and runs the
newest. A queue since Taskcluster v40 refuses the ``superseded`` resolution that docker-worker
then reports first: the secondaries stay claimed, without ``public/superseded-by.json``, which
docker-worker uploads only after the report succeeded (the product's worker shim resolves them
instead; see test_worker.py)."""

from __future__ import annotations

import pytest

from tests.worker.support import DockerWorkerRules
from tests_taskcluster.environment import Deployment
from tests_taskcluster.support import Loop, RealQueue, Run

pytestmark = pytest.mark.integration


async def test_an_unmodified_docker_worker_runs_the_newest_task(
    loop: Loop, queue: RealQueue, run: Run, deployment: Deployment
) -> None:
    service = await loop.start_service()
    superseder = f"{service}/v1/docker-worker/dw.build"
    ids = [queue.create("dw.build", superseder=superseder) for _ in range(4)]

    async def pending_are(expected: list[str]) -> bool:
        return await loop.pending("dw.build") == expected

    await loop.eventually(lambda: pending_are(ids), "the four tasks indexed")
    docker_worker = DockerWorkerRules(
        queue,
        worker_group="coalescer-rt",
        worker_id=f"dw-{run.uid}",
        task_queue_id=run.task_queue_id,
        credentials=deployment.credentials,
    )
    claim = await docker_worker.claim_work()
    assert claim["status"]["taskId"] == ids[0]
    # The service has seen the claimed task start: it is running, no longer pending.
    await loop.eventually(lambda: pending_are(ids[1:]), "the claimed task to run")

    primary, secondaries = await docker_worker.run(claim)

    assert primary == ids[-1]
    assert secondaries == ids[-2::-1]
    assert queue.last_run(ids[-1])["reasonResolved"] == "completed"
    links = [queue.artifact(t, 0, "public/superseded-by.json") for t in ids[:-1]]
    if docker_worker.refused:  # a current queue: reportException(superseded) is a 400
        assert docker_worker.refused == {t: 400 for t in ids[:-1]}
        assert [queue.state(t) for t in ids[:-1]] == ["running"] * 3
        assert links == [None] * 3
        assert queue.artifact(ids[-1], 0, "public/supersedes.json") is None
    else:  # a queue before v40
        assert [queue.last_run(t)["reasonResolved"] for t in ids[:-1]] == ["superseded"] * 3
        assert links == [{"taskId": ids[-1], "runId": 0}] * 3
    await loop.eventually(lambda: pending_are([]), "no task of the key pending")
