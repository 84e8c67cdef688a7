"""A pre-v40 queue (``legacy``) accepts ``reason: "superseded"``, as docker-worker used it."""

from __future__ import annotations

import dataclasses

import pytest

from coalescer.emulator.harness import TEST_OPTIONS, QueueEmulator
from coalescer.emulator.runtime import EmulatorOptions

from .conftest import CheckedQueue, as_worker, claim_one, kinds


@pytest.fixture
def queue_emulator_options() -> EmulatorOptions:
    return dataclasses.replace(TEST_OPTIONS, legacy=True)


def test_a_legacy_queue_resolves_superseded_without_retrying(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task(retries=3, routes=["coalesce.v1.key"])
    worker = as_worker(em, claim_one(em, queue, task_id))
    status = worker.reportException(task_id, 0, {"reason": "superseded"})["status"]
    assert status["state"] == "exception"
    assert status["runs"][0]["reasonResolved"] == "superseded"
    assert len(status["runs"]) == 1 and status["retriesLeft"] == 3
    exception = em.messages("task-exception", task_id)[0]
    assert exception["CC"] == ["route.coalesce.v1.key"]
    assert exception["payload"]["status"]["runs"][0]["reasonResolved"] == "superseded"
    assert kinds(em, task_id)[-1] == "task-exception"


def test_a_legacy_queue_still_validates_the_reason(em: QueueEmulator, queue: CheckedQueue) -> None:
    from taskcluster.exceptions import TaskclusterRestFailure

    task_id = em.create_task()
    worker = as_worker(em, claim_one(em, queue, task_id))
    with pytest.raises(TaskclusterRestFailure) as refused:
        worker.reportException(task_id, 0, {"reason": "bored"})
    assert refused.value.status_code == 400
