"""Seed 002, "Task Life-Cycle", rule by rule, through the official taskcluster client."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta

import pytest
import taskcluster
from taskcluster.exceptions import TaskclusterRestFailure

from coalescer.emulator.clock import format_time, parse_time
from coalescer.emulator.harness import TEST_OPTIONS, QueueEmulator

from .conftest import QUEUE_ID, WORKER, CheckedQueue, as_worker, claim_one, kinds

DEADLINE_DELAY = TEST_OPTIONS.deadline_delay


def test_a_task_without_dependencies_is_pending_as_soon_as_it_is_created(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task(routes=["coalesce.v1.some.key", "index.x"])
    status = queue.status(task_id)["status"]
    assert status["state"] == "pending"
    assert [(r["runId"], r["state"], r["reasonCreated"]) for r in status["runs"]] == [
        (0, "pending", "scheduled")
    ]
    assert kinds(em, task_id) == ["task-defined", "task-pending"]
    pending = em.messages("task-pending", task_id)[0]
    assert pending["CC"] == ["route.coalesce.v1.some.key", "route.index.x"]
    assert pending["routingKey"] == (f"primary.{task_id}.0._._.emulator-test.worker.-.{task_id}._")
    assert queue.task(task_id)["taskQueueId"] == QUEUE_ID


def test_create_task_is_idempotent_and_conflicts_on_another_definition(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = taskcluster.slugid.nice()
    definition = em.task_definition()
    first = queue.createTask(task_id, definition)
    again = queue.createTask(task_id, definition)
    assert again["status"] == first["status"]
    with pytest.raises(TaskclusterRestFailure) as conflict:
        queue.createTask(task_id, em.task_definition(priority="high"))
    assert conflict.value.status_code == 409
    assert conflict.value.body["code"] == "RequestConflict"
    assert set(conflict.value.body) == {"code", "message", "requestInfo"}


def test_create_task_validates_its_input(em: QueueEmulator, queue: CheckedQueue) -> None:
    bad = em.task_definition()
    del bad["metadata"]
    with pytest.raises(TaskclusterRestFailure) as invalid:
        queue.createTask(taskcluster.slugid.nice(), bad)
    assert invalid.value.status_code == 400
    assert invalid.value.body["code"] == "InputValidationError"
    no_queue = em.task_definition()
    del no_queue["taskQueueId"]
    with pytest.raises(TaskclusterRestFailure) as missing:
        queue.createTask(taskcluster.slugid.nice(), no_queue)
    assert missing.value.body["code"] == "InputError"


def test_a_task_waits_unscheduled_until_its_dependencies_complete(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    first = em.create_task()
    second = em.create_task(dependencies=[first])
    assert queue.status(second)["status"]["state"] == "unscheduled"
    assert kinds(em, second) == ["task-defined"]
    dependents = queue.listDependentTasks(first)["tasks"]
    assert [t["status"]["taskId"] for t in dependents] == [second]

    claim = claim_one(em, queue, first)
    as_worker(em, claim).reportCompleted(first, 0)
    em.clock.advance(0)  # the dependency resolver's pass (in the background, every tick)
    assert queue.status(second)["status"]["state"] == "pending"
    assert kinds(em, second) == ["task-defined", "task-pending"]


def test_all_completed_dependents_stay_unscheduled_after_a_failure_until_their_deadline(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    first = em.create_task()
    second = em.create_task(dependencies=[first])
    as_worker(em, claim_one(em, queue, first)).reportFailed(first, 0)
    em.clock.advance(0)  # the dependency resolver's pass
    assert queue.status(second)["status"]["state"] == "unscheduled"
    em.clock.advance(3600 + DEADLINE_DELAY)  # past the deadline, when the resolver acts
    status = queue.status(second)["status"]
    assert status["state"] == "exception"
    assert status["runs"][0]["reasonCreated"] == "exception"
    assert status["runs"][0]["reasonResolved"] == "deadline-exceeded"


def test_all_resolved_dependents_run_after_any_resolution(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    first = em.create_task()
    second = em.create_task(dependencies=[first], requires="all-resolved")
    claim = claim_one(em, queue, first)
    as_worker(em, claim).reportException(first, 0, {"reason": "malformed-payload"})
    em.clock.advance(0)  # the dependency resolver's pass
    assert queue.status(second)["status"]["state"] == "pending"


def test_a_self_dependency_waits_for_schedule_task(em: QueueEmulator, queue: CheckedQueue) -> None:
    task_id = taskcluster.slugid.nice()
    queue.createTask(task_id, em.task_definition(dependencies=[task_id]))
    assert queue.status(task_id)["status"]["state"] == "unscheduled"
    assert queue.claimWork(QUEUE_ID, {**WORKER, "tasks": 1})["tasks"] == []
    assert queue.scheduleTask(task_id)["status"]["state"] == "pending"
    assert queue.scheduleTask(task_id)["status"]["runs"][0]["reasonCreated"] == "scheduled"
    assert kinds(em, task_id) == ["task-defined", "task-pending"]


def test_a_self_dependency_without_schedule_task_ends_at_the_deadline(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = taskcluster.slugid.nice()
    queue.createTask(task_id, em.task_definition(dependencies=[task_id]))
    em.clock.advance(3600)
    with pytest.raises(TaskclusterRestFailure) as late:
        queue.scheduleTask(task_id)
    assert late.value.status_code == 409
    assert queue.status(task_id)["status"]["state"] == "unscheduled"
    em.clock.advance(DEADLINE_DELAY)
    status = queue.status(task_id)["status"]
    assert status["state"] == "exception"
    exception = em.messages("task-exception", task_id)[0]
    assert exception["payload"]["runId"] == 0
    assert exception["routingKey"].startswith(f"primary.{task_id}.0._._.")


def test_runs_count_from_zero_and_only_the_last_one_is_live(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task()
    worker = as_worker(em, claim_one(em, queue, task_id))
    worker.reportException(task_id, 0, {"reason": "worker-shutdown"})
    runs = queue.status(task_id)["status"]["runs"]
    assert [(r["runId"], r["state"]) for r in runs] == [(0, "exception"), (1, "pending")]
    for call in (
        lambda: queue.claimTask(task_id, 0, WORKER),
        lambda: worker.reportCompleted(task_id, 0),
        lambda: worker.reclaimTask(task_id, 0),
    ):
        with pytest.raises(TaskclusterRestFailure) as stale:
            call()
        assert stale.value.status_code == 409
    assert queue.claimTask(task_id, 1, WORKER)["runId"] == 1


def test_a_claim_not_reclaimed_by_taken_until_expires_and_the_task_is_retried(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task(retries=2)
    claim = claim_one(em, queue, task_id)
    em.clock.advance(1199)
    assert queue.status(task_id)["status"]["state"] == "running"
    em.clock.advance(2)
    status = queue.status(task_id)["status"]
    assert status["retriesLeft"] == 1
    assert status["runs"][0]["reasonResolved"] == "claim-expired"
    assert status["runs"][0]["resolved"] == claim["takenUntil"]
    assert (status["runs"][1]["state"], status["runs"][1]["reasonCreated"]) == ("pending", "retry")
    # As the real claim resolver: task-exception for run 0 (its status already shows run 1
    # pending), then task-pending for run 1.
    assert kinds(em, task_id) == [
        "task-defined",
        "task-pending",
        "task-running",
        "task-exception",
        "task-pending",
    ]
    exception = em.messages("task-exception", task_id)[0]["payload"]
    assert (exception["runId"], exception["workerId"]) == (0, WORKER["workerId"])
    assert exception["status"] == status
    assert em.messages("task-pending", task_id)[-1]["payload"]["runId"] == 1


def test_an_expired_claim_without_retries_left_resolves_the_task_exception(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task(retries=0)
    claim_one(em, queue, task_id)
    em.clock.advance(1201)
    assert queue.status(task_id)["status"]["state"] == "exception"
    assert kinds(em, task_id)[-1] == "task-exception"
    message = em.messages("task-exception", task_id)[0]
    assert message["payload"]["workerId"] == WORKER["workerId"]


def test_the_deadline_resolves_a_running_task_and_its_worker_gets_409(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task()  # deadline: one hour
    worker = as_worker(em, claim_one(em, queue, task_id))
    for _ in range(3):  # keep the claim alive: reclaim every 1000 s (takenUntil is +1200 s)
        em.clock.advance(1000)
        worker = as_worker(em, worker.reclaimTask(task_id, 0))
    em.clock.advance(700)  # past the one-hour deadline, before the last takenUntil
    status = queue.status(task_id)["status"]
    assert status["runs"][0]["reasonResolved"] == "deadline-exceeded"
    with pytest.raises(TaskclusterRestFailure) as late:
        worker.reclaimTask(task_id, 0)
    assert late.value.status_code == 409
    exception = em.messages("task-exception", task_id)[0]
    assert "workerId" not in exception["payload"]  # as the real deadline resolver sends it


def test_cancel_task_resolves_exception_canceled_and_is_idempotent(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    running = em.create_task()
    worker = as_worker(em, claim_one(em, queue, running))
    waiting = taskcluster.slugid.nice()
    queue.createTask(waiting, em.task_definition(dependencies=[waiting]))

    assert queue.cancelTask(running)["status"]["runs"][0]["reasonResolved"] == "canceled"
    canceled = queue.cancelTask(waiting)["status"]["runs"]
    assert [(r["reasonCreated"], r["reasonResolved"]) for r in canceled] == [
        ("exception", "canceled")
    ]
    # Canceling again changes nothing but publishes the task-exception again, as the real
    # queue does; canceling a task resolved otherwise publishes nothing.
    assert queue.cancelTask(running)["status"]["state"] == "exception"
    assert kinds(em, running).count("task-exception") == 2
    again = em.messages("task-exception", running)
    assert again[1]["payload"] == again[0]["payload"]
    done = em.create_task()
    as_worker(em, claim_one(em, queue, done)).reportCompleted(done, 0)
    assert queue.cancelTask(done)["status"]["state"] == "completed"
    assert kinds(em, done)[-1] == "task-completed"
    with pytest.raises(TaskclusterRestFailure) as gone:
        worker.reclaimTask(running, 0)
    assert gone.value.status_code == 409


def test_a_task_is_deleted_when_it_expires(em: QueueEmulator, queue: CheckedQueue) -> None:
    task_id = em.create_task(expires=format_time(em.clock.now() + timedelta(hours=2)))
    as_worker(em, claim_one(em, queue, task_id)).reportCompleted(task_id, 0)
    em.clock.advance(3 * 3600)
    with pytest.raises(TaskclusterRestFailure) as gone:
        queue.status(task_id)
    assert gone.value.status_code == 404


def test_a_pending_task_not_claimed_by_its_deadline_is_resolved_exception(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task()
    deadline = queue.task(task_id)["deadline"]
    em.clock.advance(3600)
    # Past the deadline the task stays pending until the deadline resolver acts, deadline_delay
    # later, but is no longer handed out. (The clock follows real time too: a margin of 5 s.)
    assert queue.status(task_id)["status"]["state"] == "pending"
    em.clock.advance(DEADLINE_DELAY - 5)
    assert queue.status(task_id)["status"]["state"] == "pending"
    assert queue.claimWork(QUEUE_ID, {**WORKER, "tasks": 1})["tasks"] == []
    em.clock.advance(5)
    status = queue.status(task_id)["status"]
    assert (status["state"], status["runs"][0]["reasonResolved"]) == (
        "exception",
        "deadline-exceeded",
    )
    resolved = parse_time(status["runs"][0]["resolved"])
    assert resolved == parse_time(deadline) + timedelta(seconds=DEADLINE_DELAY)
    assert kinds(em, task_id) == ["task-defined", "task-pending", "task-exception"]
    with pytest.raises(TaskclusterRestFailure) as late:
        queue.claimTask(task_id, 0, WORKER)
    assert late.value.status_code == 409


def test_claim_work_serves_higher_priority_first_then_older_tasks(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    old_low = em.create_task(priority="low")
    new_low = em.create_task(priority="low")
    high = em.create_task(priority="high")
    assert queue.pendingTasks(QUEUE_ID)["pendingTasks"] == 3
    claims = queue.claimWork(QUEUE_ID, {**WORKER, "tasks": 3})["tasks"]
    assert [c["status"]["taskId"] for c in claims] == [high, old_low, new_low]


#: A long-poll bound far above the wake-up, so that a busy machine cannot blur the two.
LONG_POLL = dataclasses.replace(TEST_OPTIONS, claim_work_timeout=20.0)


@pytest.mark.parametrize("queue_emulator_options", [LONG_POLL])
def test_claim_work_waits_for_work_then_returns_it(em: QueueEmulator, queue: CheckedQueue) -> None:
    result: dict[str, object] = {}

    def poll_for_work() -> None:
        result["claims"] = queue.claimWork(QUEUE_ID, {**WORKER, "tasks": 1})["tasks"]

    started = time.monotonic()
    waiter = threading.Thread(target=poll_for_work)
    waiter.start()
    task_id = em.create_task()
    waiter.join(timeout=30)
    claims = result["claims"]
    assert isinstance(claims, list) and [c["status"]["taskId"] for c in claims] == [task_id]
    assert time.monotonic() - started < 10.0  # woken by the new task, not by the 20 s bound


def test_claim_work_returns_an_empty_list_after_the_long_poll_bound(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    started = time.monotonic()
    assert queue.claimWork(QUEUE_ID, {**WORKER, "tasks": 1})["tasks"] == []
    # The fixture's bound is 1 s; the upper limit only says it ends (with room for a busy box).
    assert 0.9 <= time.monotonic() - started < 10.0


def test_rerun_task_runs_a_resolved_task_again_with_its_retries_reset(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task(routes=["coalesce.v1.k"], retries=1)
    worker = as_worker(em, claim_one(em, queue, task_id))
    worker.reportException(task_id, 0, {"reason": "intermittent-task"})  # uses the one retry
    assert queue.status(task_id)["status"]["retriesLeft"] == 0
    worker = as_worker(em, claim_one(em, queue, task_id))
    worker.reportCompleted(task_id, 1)

    status = queue.rerunTask(task_id)["status"]
    assert status["state"] == "pending"
    assert status["retriesLeft"] == 1
    assert [(r["runId"], r["reasonCreated"]) for r in status["runs"]][-1] == (2, "rerun")
    rerun = em.messages("task-pending", task_id)[-1]
    assert rerun["payload"]["runId"] == 2 and rerun["CC"] == ["route.coalesce.v1.k"]
    # Idempotent while the new run is pending: no run, no message.
    assert queue.rerunTask(task_id)["status"]["runs"] == status["runs"]
    assert kinds(em, task_id).count("task-pending") == 3


def test_rerun_task_schedules_an_unscheduled_task_whatever_its_dependencies(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    waiting = taskcluster.slugid.nice()
    queue.createTask(waiting, em.task_definition(dependencies=[waiting]))
    runs = queue.rerunTask(waiting)["status"]["runs"]
    assert [(r["state"], r["reasonCreated"]) for r in runs] == [("pending", "rerun")]


def test_rerun_task_is_refused_past_the_deadline(em: QueueEmulator, queue: CheckedQueue) -> None:
    task_id = em.create_task()
    queue.cancelTask(task_id)
    em.clock.advance(3601)  # past the deadline
    with pytest.raises(TaskclusterRestFailure) as late:
        queue.rerunTask(task_id)
    assert late.value.status_code == 409


def test_tasks_and_statuses_answer_many_tasks_at_once_leaving_out_unknown_ones(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    # Created in an order that is neither taskId order (by code point or by the database's
    # collation) nor the request's.
    ids = ["aaaaaaaaQaaaaaaaaaaaaA", "AAAAAAAAQAaAAAAAAAAAAA", "baaaaaaaQaaaaaaaaaaaaA"]
    ids += ["-aaaaaaaQaaaaaaaaaaaaA", "_aaaaaaaQaaaaaaaaaaaaA"]
    routes = {t: [f"coalesce.v1.k{i}"] for i, t in enumerate(ids)}
    for task_id in ids:
        queue.createTask(task_id, em.task_definition(routes=routes[task_id]))
    created = ids  # the real queue's order: its table's, the order the tasks were created in
    unknown = taskcluster.slugid.nice()
    # Unknown and repeated ids are left out; the request's order is not kept.
    asked = {"taskIds": [ids[2], unknown, ids[0], *ids, ids[1]]}
    statuses = queue.statuses(asked)
    assert "continuationToken" not in statuses
    assert [s["taskId"] for s in statuses["statuses"]] == created
    assert all(s["status"] == queue.status(s["taskId"])["status"] for s in statuses["statuses"])
    definitions = queue.tasks(asked)["tasks"]
    assert [(d["taskId"], d["task"]["routes"]) for d in definitions] == [
        (t, routes[t]) for t in created
    ]
    # Paged by limit, each page's token leading to the next.
    first = queue.statuses(payload=asked, query={"limit": 2})
    token = first["continuationToken"]
    rest = queue.statuses(payload=asked, query={"limit": 2, "continuationToken": token})
    assert [s["taskId"] for s in first["statuses"] + rest["statuses"]] == created[:4]
