"""Seed 003, "Queue-Worker Interaction", rule by rule, through the official taskcluster client."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import httpx
import pytest
import taskcluster
from taskcluster.exceptions import TaskclusterAuthFailure, TaskclusterRestFailure

from coalescer.emulator.clock import format_time, parse_time
from coalescer.emulator.harness import QueueEmulator

from .conftest import QUEUE_ID, WORKER, CheckedQueue, as_worker, assert_valid, claim_one, kinds


def test_claim_work_hands_out_task_claims_with_temporary_credentials(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task(scopes=["docker-worker:cache:x"])
    claim = claim_one(em, queue, task_id)
    assert claim["runId"] == 0 and claim["task"]["taskQueueId"] == QUEUE_ID
    assert claim["status"]["runs"][0]["state"] == "running"
    started = parse_time(claim["status"]["runs"][0]["started"])
    assert parse_time(claim["takenUntil"]) == started + timedelta(seconds=1200)
    credentials = claim["credentials"]
    assert credentials["clientId"].startswith(f"task-client/{task_id}/0/on/test-group/worker-1/")
    certificate = json.loads(credentials["certificate"])
    assert f"queue:resolve-task:{task_id}/0" in certificate["scopes"]
    assert "docker-worker:cache:x" in certificate["scopes"]
    # They expire shortly after takenUntil.
    expiry_ms = certificate["expiry"] - parse_time(claim["takenUntil"]).timestamp() * 1000
    assert 0 < expiry_ms <= 5 * 60 * 1000
    running = em.messages("task-running", task_id)[0]
    assert running["payload"]["takenUntil"] == claim["takenUntil"]


def test_two_workers_racing_to_claim_one_run_exactly_one_wins(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task()
    barrier = threading.Barrier(2)
    outcomes: dict[str, Any] = {}

    def race(worker_id: str) -> None:
        client = CheckedQueue(em.queue())
        barrier.wait()
        try:
            outcomes[worker_id] = client.claimTask(
                task_id, 0, {"workerGroup": "g", "workerId": worker_id}
            )
        except TaskclusterRestFailure as exc:
            outcomes[worker_id] = exc

    threads = [threading.Thread(target=race, args=(w,)) for w in ("alpha", "beta")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    winners = [w for w, o in outcomes.items() if isinstance(o, dict)]
    losers = [o for o in outcomes.values() if isinstance(o, TaskclusterRestFailure)]
    assert len(winners) == 1 and len(losers) == 1
    assert losers[0].status_code == 409
    assert queue.status(task_id)["status"]["runs"][0]["workerId"] == winners[0]
    assert kinds(em, task_id).count("task-running") == 1


def test_reclaim_moves_taken_until_and_replaces_the_credentials(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task()
    claim = claim_one(em, queue, task_id)
    em.clock.advance(600)
    reclaim = as_worker(em, claim).reclaimTask(task_id, 0)
    assert parse_time(reclaim["takenUntil"]) > parse_time(claim["takenUntil"])
    assert reclaim["credentials"]["clientId"] != claim["credentials"]["clientId"]
    assert queue.status(task_id)["status"]["runs"][0]["takenUntil"] == reclaim["takenUntil"]


def test_a_worker_must_use_the_newest_credentials_from_reclaim(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task()
    claim = claim_one(em, queue, task_id)
    em.clock.advance(1000)
    fresh = as_worker(em, as_worker(em, claim).reclaimTask(task_id, 0))
    em.clock.advance(600)  # past the first takenUntil and its grace, within the new claim
    with pytest.raises(TaskclusterAuthFailure) as stale:
        as_worker(em, claim).reportCompleted(task_id, 0)
    assert stale.value.status_code == 401
    assert fresh.reportCompleted(task_id, 0)["status"]["state"] == "completed"


def test_credentials_of_one_run_do_not_serve_another(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    first, second = em.create_task(), em.create_task()
    claims = queue.claimWork(QUEUE_ID, {**WORKER, "tasks": 2})["tasks"]
    by_task = {c["status"]["taskId"]: c for c in claims}
    other = as_worker(em, by_task[first])
    expires = format_time(em.clock.now() + timedelta(days=1))
    artifact = {"storageType": "s3", "contentType": "text/plain", "expires": expires}
    # Valid credentials without the run's scopes: 403 InsufficientScopes, as the real queue says.
    for call, scope in (
        (lambda: other.reportCompleted(second, 0), "queue:resolve-task"),
        (lambda: other.reclaimTask(second, 0), "queue:reclaim-task"),
        (lambda: other.createArtifact(second, 0, "public/x", artifact), "queue:create-artifact"),
    ):
        with pytest.raises(TaskclusterRestFailure) as wrong:
            call()
        assert (wrong.value.status_code, wrong.value.body["code"]) == (403, "InsufficientScopes")
        assert f"{scope}:{second}/0" in wrong.value.body["message"]
    # Permanent credentials are accepted for any run.
    assert queue.reportCompleted(second, 0)["status"]["state"] == "completed"


def test_reclaim_answers_409_once_the_run_is_resolved(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task()
    worker = as_worker(em, claim_one(em, queue, task_id))
    queue.cancelTask(task_id)
    with pytest.raises(TaskclusterRestFailure) as canceled:
        worker.reclaimTask(task_id, 0)
    assert canceled.value.status_code == 409
    assert canceled.value.body["code"] == "RequestConflict"


@pytest.mark.parametrize("report", ["reportCompleted", "reportFailed"])
def test_reporting_a_result_is_idempotent_and_a_different_result_conflicts(
    em: QueueEmulator, queue: CheckedQueue, report: str
) -> None:
    task_id = em.create_task()
    worker = as_worker(em, claim_one(em, queue, task_id))
    state = getattr(worker, report)(task_id, 0)["status"]["state"]
    assert getattr(worker, report)(task_id, 0)["status"]["state"] == state
    other = "reportFailed" if report == "reportCompleted" else "reportCompleted"
    for conflicting in (
        lambda: getattr(worker, other)(task_id, 0),
        lambda: worker.reportException(task_id, 0, {"reason": "internal-error"}),
    ):
        with pytest.raises(TaskclusterRestFailure) as conflict:
            conflicting()
        assert conflict.value.status_code == 409
    assert kinds(em, task_id).count(f"task-{state}") == 2  # resent on the repeat, as Pulse does


@pytest.mark.parametrize("reason", ["malformed-payload", "internal-error", "resource-unavailable"])
def test_exceptions_that_are_never_retried(
    em: QueueEmulator, queue: CheckedQueue, reason: str
) -> None:
    task_id = em.create_task(retries=5)
    worker = as_worker(em, claim_one(em, queue, task_id))
    status = worker.reportException(task_id, 0, {"reason": reason})["status"]
    assert status["state"] == "exception" and len(status["runs"]) == 1
    assert status["runs"][0]["reasonResolved"] == reason and status["retriesLeft"] == 5
    assert kinds(em, task_id)[-1] == "task-exception"
    again = worker.reportException(task_id, 0, {"reason": reason})
    assert again["status"] == status


@pytest.mark.parametrize(
    ("reason", "created"), [("worker-shutdown", "retry"), ("intermittent-task", "task-retry")]
)
def test_exceptions_that_are_retried_while_retries_are_left(
    em: QueueEmulator, queue: CheckedQueue, reason: str, created: str
) -> None:
    task_id = em.create_task(retries=1)
    worker = as_worker(em, claim_one(em, queue, task_id))
    status = worker.reportException(task_id, 0, {"reason": reason})["status"]
    assert status["state"] == "pending" and status["retriesLeft"] == 0
    assert status["runs"][1]["reasonCreated"] == created
    # As the real queue: task-exception for run 0, its status already showing run 1 pending,
    # then task-pending for run 1.
    assert kinds(em, task_id)[-2:] == ["task-exception", "task-pending"]
    exception, pending = em.messages(task_id=task_id)[-2:]
    assert exception["payload"]["runId"] == 0 and pending["payload"]["runId"] == 1
    assert exception["payload"]["status"] == status == pending["payload"]["status"]
    assert exception["routingKey"].startswith(f"primary.{task_id}.0.test-group.worker-1.")
    # An idempotent repeat publishes both again.
    assert worker.reportException(task_id, 0, {"reason": reason})["status"] == status
    assert kinds(em, task_id)[-2:] == ["task-exception", "task-pending"]
    assert len(em.messages("task-exception", task_id)) == 2

    second = as_worker(em, claim_one(em, queue, task_id))
    assert second.reportException(task_id, 1, {"reason": reason})["status"]["state"] == "exception"
    assert kinds(em, task_id)[-1] == "task-exception"


def test_a_current_queue_refuses_superseded(em: QueueEmulator, queue: CheckedQueue) -> None:
    task_id = em.create_task()
    worker = as_worker(em, claim_one(em, queue, task_id))
    with pytest.raises(TaskclusterRestFailure) as refused:
        worker.reportException(task_id, 0, {"reason": "superseded"})
    assert refused.value.status_code == 400
    assert refused.value.body["code"] == "InputValidationError"
    assert queue.status(task_id)["status"]["state"] == "running"


def test_s3_artifacts_are_uploaded_to_the_put_url_and_served_by_redirect(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task()
    worker = as_worker(em, claim_one(em, queue, task_id))
    name = "public/logs/live.log"
    expires = format_time(em.clock.now() + timedelta(days=1))
    created = worker.createArtifact(
        task_id, 0, name, {"storageType": "s3", "contentType": "text/plain", "expires": expires}
    )
    # The real putUrl is presigned over the host only: another Content-Type is taken too, and
    # the object is served with the type of the last PUT.
    other = httpx.put(created["putUrl"], content=b"x", headers={"content-type": "text/html"})
    assert other.status_code == 200
    uploaded = httpx.put(
        created["putUrl"], content=b"hello", headers={"content-type": "text/plain"}
    )
    assert uploaded.status_code == 200
    worker.reportCompleted(task_id, 0)

    for found in (queue.getArtifact(task_id, 0, name), queue.getLatestArtifact(task_id, name)):
        assert found["storageType"] == "s3"
        served = httpx.get(found["url"])
        assert (served.content, served.headers["content-type"]) == (b"hello", "text/plain")
    assert queue.artifact(task_id, 0, name)["url"] == found["url"]
    listed = queue.listArtifacts(task_id, 0)["artifacts"]
    assert [(a["name"], a["storageType"]) for a in listed] == [(name, "s3")]
    assert "artifact-created" not in kinds(em, task_id)  # never for s3, as the real queue


def test_reference_link_and_error_artifacts(em: QueueEmulator, queue: CheckedQueue) -> None:
    task_id = em.create_task()
    worker = as_worker(em, claim_one(em, queue, task_id))
    expires = format_time(em.clock.now() + timedelta(days=1))
    url = "https://example.com/superseded-by.json"
    for name, body in (
        ("public/ref", {"storageType": "reference", "url": url, "contentType": "application/json"}),
        ("public/link", {"storageType": "link", "artifact": "public/ref"}),
        (
            "public/err",
            {"storageType": "error", "reason": "file-missing-on-worker", "message": "no"},
        ),
    ):
        worker.createArtifact(task_id, 0, name, {**body, "expires": expires})
    assert queue.getArtifact(task_id, 0, "public/ref") == {"storageType": "reference", "url": url}
    assert queue.getArtifact(task_id, 0, "public/link")["url"] == url
    with pytest.raises(TaskclusterRestFailure) as missing:
        queue.getArtifact(task_id, 0, "public/err")
    assert missing.value.status_code == 424
    assert queue.latestArtifact(task_id, "public/err")["reason"] == "file-missing-on-worker"
    created = em.messages("artifact-created", task_id)
    assert [m["payload"]["artifact"]["name"] for m in created] == [
        "public/ref",
        "public/link",
        "public/err",
    ]


@pytest.mark.parametrize("report", ["reportCompleted", "reportFailed"])
def test_no_artifacts_after_completed_or_failed(
    em: QueueEmulator, queue: CheckedQueue, report: str
) -> None:
    task_id = em.create_task()
    worker = as_worker(em, claim_one(em, queue, task_id))
    getattr(worker, report)(task_id, 0)
    expires = format_time(em.clock.now() + timedelta(days=1))
    body = {"storageType": "reference", "url": "https://example.com/", "contentType": "text/plain"}
    with pytest.raises(TaskclusterRestFailure) as late:
        worker.createArtifact(task_id, 0, "public/late", {**body, "expires": expires})
    assert late.value.status_code == 409


def test_artifacts_may_follow_an_exception_for_twenty_minutes(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task()
    worker = as_worker(em, claim_one(em, queue, task_id))
    worker.reportException(task_id, 0, {"reason": "internal-error"})
    expires = format_time(em.clock.now() + timedelta(days=1))
    body = {"storageType": "reference", "url": "https://example.com/", "contentType": "text/plain"}
    em.clock.advance(19 * 60)
    worker.createArtifact(task_id, 0, "public/logs/crash.log", {**body, "expires": expires})
    em.clock.advance(2 * 60)
    # (the worker's credentials have expired too by now; permanent ones show the artifact rule)
    with pytest.raises(TaskclusterRestFailure) as late:
        queue.createArtifact(task_id, 0, "public/logs/late.log", {**body, "expires": expires})
    assert late.value.status_code == 409


def test_claim_task_of_a_missing_run_is_404(em: QueueEmulator, queue: CheckedQueue) -> None:
    task_id = em.create_task()
    with pytest.raises(TaskclusterRestFailure) as missing:
        queue.claimTask(task_id, 3, WORKER)
    assert missing.value.status_code == 404
    with pytest.raises(TaskclusterRestFailure) as unknown:
        queue.claimTask(taskcluster.slugid.nice(), 0, WORKER)
    assert unknown.value.status_code == 404
    assert_valid("task-status-response", queue.status(task_id))


async def test_a_whole_run_with_the_aio_client(em: QueueEmulator) -> None:
    import taskcluster.aio

    from .conftest import CheckedAioQueue

    task_id = em.create_task()
    async with taskcluster.aio.createSession() as session:
        scheduler = CheckedAioQueue(em.aio_queue(session=session))
        claims = (await scheduler.claimWork(QUEUE_ID, {**WORKER, "tasks": 4}))["tasks"]
        assert [c["status"]["taskId"] for c in claims] == [task_id]
        worker = CheckedAioQueue(em.aio_queue(claims[0]["credentials"], session=session))
        reclaim = await worker.reclaimTask(task_id, 0)
        worker = CheckedAioQueue(em.aio_queue(reclaim["credentials"], session=session))
        expires = format_time(em.clock.now() + timedelta(days=1))
        await worker.createArtifact(
            task_id,
            0,
            "public/supersedes.json",
            {"storageType": "s3", "contentType": "application/json", "expires": expires},
        )
        done = await worker.reportCompleted(task_id, 0)
    assert done["status"]["state"] == "completed"
    assert kinds(em, task_id) == ["task-defined", "task-pending", "task-running", "task-completed"]
